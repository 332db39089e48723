"""PNG: output tok/s and TTFT p50 against load, one line per system (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path


def plotted_peers(doc: dict, levels: list[float]) -> dict[str, list[dict]]:
    """The recorded peer figures drawn beside this run, by peer: only for a run in the peers'
    setting (`comparable`: the default model and workload; a GPU run of another model drew CPU
    peers among its own lines), and only at this run's levels, so they do not stretch the axis."""
    by_peer: dict[str, list[dict]] = {}
    for peer in doc["recorded_peers"]:
        if peer.get("comparable", True) and peer["concurrency"] in levels:
            by_peer.setdefault(peer["system"], []).append(peer)
    return by_peer


def plot_results(doc: dict, path: Path) -> Path:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xlabel = "concurrency" if doc["mode"] == "concurrency" else "request rate (req/s)"
    xs_all = sorted(
        {
            run["x"]
            for s in doc["systems"].values()
            if s["kind"] != "sequential"
            for run in s["runs"]
        }
    )
    fig, (ax_tps, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, sysd in enumerate(doc["systems"].values()):
        color = colors[i % len(colors)]
        runs = [r for r in sysd["runs"] if r["metrics"]["completed"] > 0]
        if not runs:
            continue
        tps = [r["metrics"]["output_throughput"] for r in runs]
        ttft = [r["metrics"]["ttft_ms"]["p50"] for r in runs]
        if sysd["kind"] == "sequential":  # load-independent: a horizontal reference line
            ax_tps.axhline(tps[0], linestyle="--", linewidth=1, label=sysd["label"], color=color)
            if ttft[0] is not None:
                ax_ttft.axhline(
                    ttft[0], linestyle="--", linewidth=1, label=sysd["label"], color=color
                )
            continue
        xs = [r["x"] for r in runs]
        width = 2.5 if sysd["kind"] == "server" else 1.5
        ax_tps.plot(xs, tps, marker="o", linewidth=width, label=sysd["label"], color=color)
        ax_ttft.plot(xs, ttft, marker="o", linewidth=width, label=sysd["label"], color=color)
    if doc["mode"] == "concurrency":
        for name, pts in plotted_peers(doc, xs_all).items():
            ax_tps.plot(
                [p["concurrency"] for p in pts],
                [p["output_throughput"] for p in pts],
                linestyle=":",
                marker="s",
                markerfacecolor="none",
                color="grey" if "llama" in name else "tan",
                label=f"{name} ({doc['recorded_note']})",
            )
    for ax, ylabel in (
        (ax_tps, "output tokens/s (higher is better)"),
        (ax_ttft, "TTFT p50, ms (lower is better)"),
    ):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if len(xs_all) > 1 and xs_all[0] > 0 and xs_all[-1] / xs_all[0] >= 8:
            ax.set_xscale("log", base=2)
        if xs_all:
            ax.set_xticks(xs_all, [f"{x:g}" for x in xs_all])
        ax.grid(True, alpha=0.3)
    ax_ttft.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax_ttft.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_ttft.yaxis.set_major_formatter(plain)
    ax_ttft.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_tps.legend(fontsize=7, loc="best")
    w = doc["workload"]
    fig.suptitle(
        f"{doc['system_under_test']} serving benchmark: {w['name']}, {w['num_requests']} requests, "
        f"outputs {w['output_tokens_range'][0]}-{w['output_tokens_range'][1]} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Side-by-side tables, ratios to the system under test, recorded peer figures, the JSON file."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

RECORDED_NOTE = "recorded, not measured in this run"

# Design notes §3: same machine kind (2 AVX2 cores), default model, full default workload
# (streaming /v1/completions, greedy, prompts 8-48 words, outputs 32-128 tokens, 48 requests).
RECORDED_PEERS: tuple[dict, ...] = (
    {"system": "llama.cpp llama-server --parallel 16", "concurrency": 1, "output_throughput": 63.0},
    {
        "system": "llama.cpp llama-server --parallel 16",
        "concurrency": 16,
        "output_throughput": 149.0,
    },
    {
        "system": "transformers serve --continuous-batching (fp32)",
        "concurrency": 1,
        "output_throughput": 9.7,
    },
    {
        "system": "transformers serve --continuous-batching (fp32)",
        "concurrency": 16,
        "output_throughput": 54.0,
    },
)


@dataclass
class Run:
    """One measured point: a system at one concurrency (or request rate)."""

    x: float
    metrics: dict
    note: str = ""


@dataclass
class SystemResult:
    name: str
    label: str
    kind: str  # "server" | "server-variant" (--compare-beamline) | "static-batching" | "sequential"
    runs: list[Run] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def at(self, x: float) -> Run | None:
        return next((r for r in self.runs if r.x == x), None)

    def to_dict(self) -> dict:
        return asdict(self)


def _get(m: dict, key: str, stat: str | None = None) -> float | None:
    v = m.get(key)
    return v.get(stat) if stat and isinstance(v, dict) else v


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def ratio_rows(ours: SystemResult, baselines: list[SystemResult]) -> list[dict]:
    """ours vs each baseline, oriented so that > 1 means ours is better.

    A sequential baseline has one point and is compared with every load level of ours (what serving
    buys over one request at a time); a batched baseline only at the same level.
    """
    rows = []
    for run in ours.runs:
        for base in baselines:
            other = base.runs[0] if base.kind == "sequential" and base.runs else base.at(run.x)
            if other is None or other.metrics.get("completed", 0) == 0:
                continue
            m, o = run.metrics, other.metrics
            rows.append(
                {
                    "x": run.x,
                    "baseline": base.name,
                    "output_throughput_ratio": _ratio(
                        _get(m, "output_throughput"), _get(o, "output_throughput")
                    ),
                    "request_throughput_ratio": _ratio(
                        _get(m, "request_throughput"), _get(o, "request_throughput")
                    ),
                    "ttft_p50_ratio": _ratio(_get(o, "ttft_ms", "p50"), _get(m, "ttft_ms", "p50")),
                    "e2el_mean_ratio": _ratio(
                        _get(o, "e2el_ms", "mean"), _get(m, "e2el_ms", "mean")
                    ),
                }
            )
    return rows


def peer_rows(ours: SystemResult, mode: str, comparable: bool) -> list[dict]:
    """The recorded peer figures, with our figure at the same concurrency beside them.

    The ratio is given only when this run used the peers' setting (default model, full default
    workload, concurrency sweep); otherwise the figures are shown for orientation only.
    """
    rows = []
    for peer in RECORDED_PEERS:
        run = ours.at(peer["concurrency"]) if mode == "concurrency" else None
        ours_tps = _get(run.metrics, "output_throughput") if run else None
        rows.append(
            {
                **peer,
                "note": RECORDED_NOTE,
                "ours_output_throughput": ours_tps,
                "comparable": comparable,
                "ratio": _ratio(ours_tps, peer["output_throughput"]) if comparable else None,
            }
        )
    return rows


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_report(doc: dict) -> str:
    """The human-readable summary printed at the end of a run."""
    xname = "c" if doc["mode"] == "concurrency" else "rate"
    out = [
        f"workload: {doc['workload']['name']}, {doc['workload']['num_requests']} requests, "
        f"outputs {doc['workload']['output_tokens_range']} tokens, seed {doc['workload']['seed']}"
    ]
    if doc["workload"].get("shared_prefix_words"):
        out[0] += f", shared {doc['workload']['shared_prefix_words']}-word prefix"
    rows = []
    for sysd in doc["systems"].values():
        for run in sysd["runs"]:
            m = run["metrics"]
            rows.append(
                [
                    sysd["name"],
                    "seq" if sysd["kind"] == "sequential" else f"{run['x']:g}",
                    str(m["completed"]),
                    str(m["errors"]),
                    _fmt(m["request_throughput"], 2),
                    _fmt(m["output_throughput"]),
                    _fmt(m["total_token_throughput"]),
                    "/".join(_fmt(m["ttft_ms"][k], 0) for k in ("mean", "p50", "p90", "p99")),
                    "/".join(_fmt(m["tpot_ms"][k], 0) for k in ("mean", "p50", "p99")),
                    "/".join(_fmt(m["itl_ms"][k], 0) for k in ("mean", "p50", "p99")),
                    "/".join(_fmt(m["e2el_ms"][k], 0) for k in ("mean", "p50", "p99")),
                ]
            )
    out.append(
        _table(
            [
                "system",
                xname,
                "ok",
                "err",
                "req/s",
                "out tok/s",
                "tot tok/s",
                "TTFT ms mean/p50/p90/p99",
                "TPOT ms mean/p50/p99",
                "ITL ms mean/p50/p99",
                "E2EL ms mean/p50/p99",
            ],
            rows,
        )
    )
    for name, info in doc["systems"].items():
        if info.get("info", {}).get("note"):
            out.append(f"  {name}: {info['info']['note']}")
    if doc["ratios"]:
        out.append(
            f"\n{doc['system_under_test']} vs baselines "
            f"(> 1 means {doc['system_under_test']} is better):"
        )
        out.append(
            _table(
                [xname, "baseline", "out tok/s x", "req/s x", "TTFT p50 x", "E2EL mean x"],
                [
                    [
                        f"{r['x']:g}",
                        r["baseline"],
                        _fmt(r["output_throughput_ratio"], 2),
                        _fmt(r["request_throughput_ratio"], 2),
                        _fmt(r["ttft_p50_ratio"], 2),
                        _fmt(r["e2el_mean_ratio"], 2),
                    ]
                    for r in doc["ratios"]
                ],
            )
        )
    out.append(f"\nPeers ({RECORDED_NOTE}; design notes §3, default model, full default workload):")
    if doc["recorded_peers"] and not doc["recorded_peers"][0]["comparable"]:
        out.append(
            "  this run used another model or workload: no ratio, the figures are for "
            "orientation only"
        )
    out.append(
        _table(
            ["peer", "c", "out tok/s", f"{doc['system_under_test']} out tok/s", "ratio"],
            [
                [
                    p["system"],
                    str(p["concurrency"]),
                    _fmt(p["output_throughput"]),
                    _fmt(p["ours_output_throughput"]),
                    _fmt(p["ratio"], 2),
                ]
                for p in doc["recorded_peers"]
            ],
        )
    )
    for name, why in doc["skipped"].items():
        out.append(f"skipped {name}: {why}")
    if doc.get("phase_seconds"):
        out.append(
            f"wall time {doc['duration_s']:.0f} s: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in doc["phase_seconds"].items())
        )
    cpus = doc["machine"].get("cpus") or 1
    if doc["machine"].get("cpu"):
        out.append(f"host CPU: {doc['machine']['cpu']} (ratios hold for this host)")
    load = doc["machine"].get("loadavg_1m_at_start")
    if load is not None and load > 0.5 * cpus:
        out.append(
            f"note: the 1-minute load average was {load:.1f} on {cpus} CPUs when this run started "
            "(other work on the machine?): the numbers may be noisy"
        )
    return "\n".join(out)


def write_json(doc: dict, path: Path) -> None:
    """Atomically (a temporary file in the same folder, then a rename): a run killed while it
    rewrites its results leaves the previous version whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)

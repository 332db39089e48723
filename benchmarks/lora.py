"""`python -m benchmarks.lora`: what serving LoRA adapters costs. One `beamline serve` with N
adapters resident (random peft adapters of the served model, every projection targeted), the same
closed-loop load twice per round: every request on the base model, then the requests spread over
the N adapters (request i uses adapter i mod N); rounds interleaved. Steps of base rows run the
server's compiled decode step where that is the default (traced with no adapter step), steps with
an adapter row its compiled adapter step (the deltas inside the graph; eager on CUDA, where the
graphs hold the base model), so the ratio of the two is what the adapters cost a step. With
`--plain`, the server without LoRA (its own default) runs the same load too: against the LoRA
server's base load, what merely turning LoRA on costs.

Speculation and prefix caching are off in every server here (`--num-speculative-tokens 0
--no-enable-prefix-caching`): with them, the adapters' different text would change how many
drafts are accepted and the rounds would reuse each other's blocks, and the ratio would measure
those, not a step. Memory per resident adapter is the server's own figure (start-up log).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.client import CompletionTarget, run_concurrency
from benchmarks.launch import first_model_id, launched_beamline
from benchmarks.machine import machine_info
from benchmarks.stats import summarize
from benchmarks.workload import BenchRequest, synthetic_workload
from server.docgen.published import reproducing_command

OUT_DIR = Path(__file__).resolve().parent / "results"
FIXED_ARGS = ["--num-speculative-tokens", "0", "--no-enable-prefix-caching"]
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class SpreadTarget(CompletionTarget):
    """Request i goes to `models[i % len(models)]`."""

    models: tuple[str, ...] = ()

    def body(self, req: BenchRequest) -> dict:
        body = super().body(req)
        if self.models:
            body["model"] = self.models[req.index % len(self.models)]
        return body


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` random adapters of `model_dir` (peft, every projection, rank `rank`), made once
    and kept in `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [out / f"adapter{i}" for i in range(count)]
    missing = [p for p in paths if not (p / "adapter_model.safetensors").is_file()]
    for i, path in enumerate(paths):
        if path not in missing:
            continue
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=ALL_TARGETS, init_lora_weights=False
        )
        get_peft_model(base, config).save_pretrained(path)
    return paths


def slot_mib(log: Path) -> float | None:
    """The server's own figure of device memory per adapter slot."""
    match = re.search(r"\(([\d.]+) MiB per slot\)", log.read_text(errors="replace"))
    return float(match[1]) if match else None


async def measure(
    target: CompletionTarget, requests: tuple[BenchRequest, ...], concurrency: int, label: str
) -> dict:
    results, duration = await run_concurrency(target, requests, concurrency, label)
    metrics = summarize(results, duration)
    print(
        f"{label}: {metrics['output_throughput']:.1f} out tok/s, TPOT p50 "
        f"{metrics['tpot_ms']['p50']:.1f} ms, {metrics['errors']} errors",
        file=sys.stderr,
    )
    return metrics


async def run(args: argparse.Namespace) -> dict:
    from server.model.loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    adapters = make_adapters(
        model_dir, args.cache / f"{model_dir.name}-r{args.rank}", args.adapters, args.rank
    )
    names = [f"adapter{i}" for i in range(len(adapters))]
    workload = synthetic_workload(args.num_requests, output_tokens=(32, 128), seed=0)
    lora_args = [
        *FIXED_ARGS,
        "--max-loras", str(len(adapters)), "--max-lora-rank", str(args.rank),
        "--lora-modules", *(f"{n}={p}" for n, p in zip(names, adapters)),
        *args.beamline_args.split(),
    ]  # fmt: skip
    rounds: list[dict] = []
    log = args.out_dir / "lora-server.log"
    with launched_beamline(args.model, log, lora_args, args.launch_timeout) as (url, _):
        base_name = first_model_id(url)
        base = CompletionTarget(url, base_name)
        spread = SpreadTarget(url, base_name, models=tuple(names))
        await measure(base, workload.requests[:4], 4, "warm-up")
        await measure(spread, workload.requests[:4], 4, "warm-up")
        for r in range(args.rounds):
            c = args.concurrency
            rounds.append(
                {
                    "base": await measure(base, workload.requests, c, f"round {r} base"),
                    "adapters": await measure(spread, workload.requests, c, f"round {r} adapters"),
                }
            )
    plain = None
    if args.plain:
        plain_log = args.out_dir / "plain-server.log"
        plain_args = [*FIXED_ARGS, *args.beamline_args.split()]
        with launched_beamline(args.model, plain_log, plain_args, args.launch_timeout) as (url, _):
            target = CompletionTarget(url, first_model_id(url))
            await measure(target, workload.requests[:4], 4, "warm-up")
            plain = await measure(target, workload.requests, args.concurrency, "no LoRA")

    def median(kind: str, key: str) -> float:
        values = [
            r[kind][key] if key == "output_throughput" else r[kind][key]["p50"] for r in rounds
        ]
        return statistics.median(values)

    summary = {
        "base_output_tok_s": median("base", "output_throughput"),
        "adapters_output_tok_s": median("adapters", "output_throughput"),
        "base_tpot_p50_ms": median("base", "tpot_ms"),
        "adapters_tpot_p50_ms": median("adapters", "tpot_ms"),
    }
    summary["step_time_ratio"] = summary["adapters_tpot_p50_ms"] / summary["base_tpot_p50_ms"]
    summary["throughput_ratio"] = summary["base_output_tok_s"] / summary["adapters_output_tok_s"]
    if plain is not None:
        summary["no_lora_output_tok_s"] = plain["output_throughput"]
        summary["no_lora_tpot_p50_ms"] = plain["tpot_ms"]["p50"]
    adapter_bytes = [(p / "adapter_model.safetensors").stat().st_size for p in adapters]
    return {
        "benchmark": "lora",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "command": reproducing_command(
            "benchmarks.lora", args.argv, ("--out", "--out-dir", "--cache")
        ),
        "model": str(model_dir),
        "adapters": {"count": len(adapters), "rank": args.rank, "targets": ALL_TARGETS},
        "server_args": lora_args[: len(FIXED_ARGS) + 4] + ["--lora-modules", "..."],
        "concurrency": args.concurrency,
        "workload": workload.describe(),
        "device_mib_per_resident_adapter": slot_mib(log),
        "host_mib_per_adapter_file": statistics.mean(adapter_bytes) / 2**20,
        "rounds": rounds,
        "no_lora": plain,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF directory, .gguf or hub id (default: Gemma 3 270M)")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--plain", action="store_true", help="also run the server without LoRA")
    p.add_argument("--beamline-args", default="", help="more `beamline serve` flags, all servers")
    p.add_argument("--launch-timeout", type=float, default=900.0)
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache/beamline/bench-lora")
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    p.add_argument("--out", type=Path, help="JSON result (default: <out-dir>/lora-<date>.json)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = asyncio.run(run(args))
    out = args.out or args.out_dir / f"lora-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    s = result["summary"]
    print(
        f"adapters / base: step time (TPOT p50) {s['step_time_ratio']:.2f}x, throughput "
        f"{s['throughput_ratio']:.2f}x; {result['device_mib_per_resident_adapter']} MiB per "
        f"resident adapter; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The GPU kit: everything a lent GPU machine should run, as one command that fits in 10 minutes.

    python -m benchmarks.gpu_kit --out OUT                       # on the GPU machine
    python -m benchmarks.gpu_kit --out OUT --device cpu --shapes tiny --concurrency 1,2 \\
        --num-requests 4 --tests tests/test_detokenizer.py       # the same code on a CPU (CI)

In order, each step's output under OUT (small files only: they travel back from the machine):
1. the model-running tests on the device (`BEAMLINE_TEST_DEVICE`): `tests.log`, `tests.xml`;
2. per random-weight model shape (random_models.py; bfloat16 on CUDA, built on the device, kept
   outside OUT): the engine's host time per decode step (`overhead-SHAPE.json`) and the serving
   benchmark against HF `generate()` static batching on the same device: beamline as it starts
   on CUDA (paged kernel, start-up CUDA graphs, overlapped outputs, async scheduling) and, unless
   `--no-compile`, plain eager (`--no-cuda-graphs --overlap-outputs off --async-scheduling off`)
   and `--torch-compile` in the same run
   (`serve-SHAPE.*`: JSON, PNG plot; `serve-SHAPE.log`);
3. `kit.json`: what ran, exit codes and seconds, so a partial run still says how far it got.
GPU time is scarce: the order is the one ../shared/gpu/README.md asks for, and `--budget`
seconds stop the kit before the next step would start too late.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Tests that run models or kernels (each through tests/conftest.py's device switch).
KIT_TESTS = (
    "tests/test_triton_attention.py",
    "tests/test_cuda_graphs.py",
    "tests/test_overlap_outputs.py",
    "tests/test_async_scheduling.py",
    "tests/test_host_syncs.py",
    "tests/test_engine_process.py",
    "tests/test_speculation.py",
    "tests/test_engine_correctness.py",
    "tests/test_decoding_hf_parity.py",
    "tests/test_strategies.py",
    "tests/test_batch_invariance.py",
    "tests/test_prompt_logprobs.py",
    "tests/test_engine_behaviour.py",
    "tests/test_prefix_cache.py",
    "tests/test_overload_and_preemption.py",
    "tests/test_beam_logprobs.py",
    "tests/test_api.py",
)


def _run(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> tuple[int, float]:
    """Run `cmd` with its output in `log`; (exit code, seconds). 124: it ran out of time."""
    start = time.monotonic()
    with log.open("w") as out:
        try:
            rc = subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="llama-1b,llama-8b")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--output-tokens", default="32,128")
    ap.add_argument("--rows", default="16,64,256", help="engine_overhead row counts")
    ap.add_argument("--tests", default=",".join(KIT_TESTS), help="comma list; empty: none")
    ap.add_argument(
        "--no-compile", action="store_true", help="skip the eager and --torch-compile variants"
    )
    ap.add_argument("--budget", type=float, default=570.0, help="seconds for the whole kit")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    left = lambda: args.budget - (time.monotonic() - started)  # noqa: E731
    env = {**os.environ, "BEAMLINE_TEST_DEVICE": args.device}
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    steps: list[dict[str, object]] = []

    def record(name: str, rc: int, seconds: float) -> None:
        steps.append({"step": name, "rc": rc, "seconds": round(seconds, 1)})
        (args.out / "kit.json").write_text(
            json.dumps({"device": args.device, "dtype": dtype, "steps": steps}, indent=2)
        )
        print(f"[kit] {name}: rc {rc} in {seconds:.0f} s ({left():.0f} s left)", flush=True)

    if args.tests:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
        cmd += ["--junitxml", str(args.out / "tests.xml"), *args.tests.split(",")]
        record("tests", *_run(cmd, args.out / "tests.log", env, timeout=max(1.0, left() * 0.4)))
    with tempfile.TemporaryDirectory() as models:
        for shape in args.shapes.split(","):
            if left() < 60:
                record(f"{shape}: skipped, out of time", 0, 0.0)
                break
            model = Path(models) / shape
            build = (
                "import torch; from benchmarks.random_models import build_random_model; "
                f"build_random_model({str(model)!r}, {shape!r}, dtype=torch.{dtype}, "
                f"device={args.device!r})"
            )
            cmd = [sys.executable, "-c", build]
            record(f"{shape}: build", *_run(cmd, args.out / f"build-{shape}.log", env, left()))
            cmd = [sys.executable, "-m", "benchmarks.engine_overhead", "--model", str(model)]
            cmd += ["--device", args.device, "--rows", args.rows, "--steps", "20"]
            cmd += ["--async-scheduling"] if args.device == "cuda" else []
            cmd += ["--out", str(args.out / f"overhead-{shape}.json")]
            log = args.out / f"overhead-{shape}.log"
            record(f"{shape}: engine overhead", *_run(cmd, log, env, left() * 0.3))
            cmd = [sys.executable, "-m", "benchmarks.serve", "--launch-beamline"]
            cmd += ["--model", str(model), "--device", args.device, "--dtype", dtype]
            cmd += ["--baselines", "hf-static", "--concurrency", args.concurrency]
            cmd += ["--num-requests", str(args.num_requests), "--output-tokens"]
            cmd += [args.output_tokens, "--out-dir", str(args.out), "--tag", f"serve-{shape}"]
            cmd += ["--label", "beamline", "--beamline-args", "--max-num-seqs 256"]
            cmd += ["--launch-timeout", str(int(max(60.0, min(300.0, left() / 3))))]
            if not args.no_compile:
                eager = "--no-cuda-graphs --overlap-outputs off --async-scheduling off"
                eager += " --max-num-seqs 256"
                cmd += ["--compare-beamline", f"eager={eager}"]
                cmd += ["--compare-beamline", "compiled=--torch-compile --max-num-seqs 256"]
            log = args.out / f"serve-{shape}.log"
            record(f"{shape}: serve", *_run(cmd, log, env, left()))
    return max((int(s["rc"]) for s in steps), default=0)  # type: ignore[call-overload]


if __name__ == "__main__":
    sys.exit(main())

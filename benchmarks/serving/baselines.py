"""The baselines of a serving run, one after the other on the same workload once the servers
under test are stopped: HF `generate()` static batching and sequential, llama-cpp-python,
llama.cpp's `llama-server` with and without its n-gram speculation, vLLM's CPU build."""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.client import level_requests
from benchmarks.serving import hf_baseline, llama_server, llamacpp_baseline, vllm_cpu
from benchmarks.serving.report import Run, SystemResult
from benchmarks.serving.results import Progress, server_log_path
from benchmarks.stats import summarize
from benchmarks.workload import Workload
from server.model.loader import resolve_model_dir


def run_baselines(args: argparse.Namespace, workload: Workload, progress: Progress) -> None:
    """Run the chosen baselines one after the other into `progress` (written after each point);
    its phases get each one's wall time (load included)."""
    phases, skipped = progress.phases, progress.skipped
    reqs = list(workload.requests)
    wants_hf = {"hf-static", "hf-sequential"} & set(args.baseline_names)
    if wants_hf:
        t0 = time.perf_counter()
        if "hf-static" in wants_hf and args.mode != "concurrency":
            skipped["hf-static"] = "static batching has no open-loop form; use --concurrency"
        print("loading the HF model for the baselines ...", file=sys.stderr)
        hf = hf_baseline.load_hf_model(args.model, args.hf_dtype, device=args.device)
        hf_baseline.warmup(hf)
        info = {"model_dir": str(hf.path), "dtype": hf.dtype, "load_s": hf.load_s}
        seq = None
        if "hf-sequential" in wants_hf:
            res, dur = hf_baseline.run_static_batches(
                hf, level_requests(reqs, 1, args.rounds), 1, args.ignore_eos, "hf sequential"
            )
            seq = Run(1, summarize(res, dur))
            progress.add(
                SystemResult(
                    "hf-sequential",
                    f"HF generate() sequential ({args.hf_dtype})",
                    "sequential",
                    [seq],
                    dict(info),
                )
            )
        if "hf-static" in wants_hf and args.mode == "concurrency":
            static = SystemResult(
                "hf-static",
                f"HF generate() static batching ({args.hf_dtype})",
                "static-batching",
                info={**info, "note": "batch = concurrency; E2EL = batch end; TTFT = first step"},
            )
            for c in [int(c) for c in args.levels]:
                if c == 1:  # a static batch of one is the sequential baseline: run it only once
                    if seq is not None:
                        static.runs.append(
                            Run(1, seq.metrics, "same run as hf-sequential (batch of 1)")
                        )
                        progress.add(static)
                    continue
                level = level_requests(reqs, c, args.rounds)
                hf_baseline.warmup(hf, level[:c])
                res, dur = hf_baseline.run_static_batches(
                    hf, level, c, args.ignore_eos, f"hf static b={c}"
                )
                static.runs.append(Run(c, summarize(res, dur)))
                progress.add(static)
        del hf
        phases["hf_baselines"] = time.perf_counter() - t0
    if "llama-cpp" in args.baseline_names:
        t0 = time.perf_counter()
        why = llamacpp_baseline.available()
        gguf = args.gguf or llamacpp_baseline.default_gguf(args.model)
        if why is None and gguf is None:
            why = "no GGUF file for --model; pass --gguf"
        if why:
            skipped["llama-cpp"] = why
        else:
            runner = llamacpp_baseline.LlamaCppRunner(gguf, args.llama_threads, args.llama_n_ctx)
            res, dur = runner.run_sequential(level_requests(reqs, 1, args.rounds), args.ignore_eos)
            phases["llama_cpp"] = time.perf_counter() - t0
            progress.add(
                SystemResult(
                    "llama-cpp",
                    llamacpp_baseline.LABEL,
                    "sequential",
                    [Run(1, summarize(res, dur))],
                    {
                        "gguf": str(gguf),
                        "n_threads": args.llama_threads,
                        "load_s": runner.load_s,
                        "version": runner.version,
                        "note": "llama-cpp-python, one request at a time: "
                        "a weaker peer than llama-server",
                    },
                )
            )
    for name in ("llama-server", "llama-server-ngram"):
        if name not in args.baseline_names:
            continue
        t0 = time.perf_counter()
        gguf = args.gguf or llamacpp_baseline.default_gguf(args.model)
        if gguf is None:
            skipped[name] = "no GGUF file for --model; pass --gguf"
        elif args.mode != "concurrency":
            skipped[name] = "one slot per client needs --concurrency levels"
        else:
            log_path = server_log_path(args).with_name(f"{name}.log")
            levels = [int(c) for c in args.levels]
            result = llama_server.measure(
                gguf,
                reqs,
                levels,
                log_path,
                args.ignore_eos,
                args.llama_threads,
                chat=workload.chat,
                ngram=name == "llama-server-ngram",
                rounds=args.rounds,
            )
            phases[name.replace("-", "_")] = time.perf_counter() - t0
            progress.add(result)
    if "vllm-cpu" in args.baseline_names:
        if args.mode != "concurrency":
            skipped["vllm-cpu"] = "measured at --concurrency levels"
        else:
            t0 = time.perf_counter()
            result = vllm_cpu.measure(
                resolve_model_dir(args.model),
                reqs,
                [int(c) for c in args.levels],
                server_log_path(args).with_name("vllm-cpu.log"),
                args.ignore_eos,
                chat=workload.chat,
                threads_bind=args.vllm_threads_bind,
                kv_cache_gib=args.vllm_kv_cache_gib,
                rounds=args.rounds,
            )
            phases["vllm_cpu"] = time.perf_counter() - t0
            progress.add(result)

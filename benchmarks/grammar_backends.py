"""`python -m benchmarks.grammar_backends`: llguidance against xgrammar on our tokenizer and our
schemas, one core, same run: tokenizer set-up, compile time per schema, mask time per token.

Workload: the 52 schemas of benchmarks/schema_suite.py with the default model's 262k-token tokenizer
(or `--model`). For each schema a token path is walked once with llguidance (a seeded random
allowed token per step, up to 64 tokens, compact JSON as beamline compiles it); then each
backend compiles the schema (cold: its own cache off or emptied) and computes the mask before
every token of that path and consumes the token. Both backends run single-threaded.

xgrammar is not a beamline dependency: `pip install xgrammar` first. Results go to
benchmarks/results/grammar-backends-<tag>.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import llguidance
import llguidance.torch
import torch
from transformers import AutoTokenizer

from benchmarks.schema_suite import SCHEMAS
from decoding.constraints import unpack_bitmask
from decoding.grammar import JSON_DEFAULTS, GrammarCompiler, GrammarSpec
from server.model.loader import resolve_model_dir

RESULTS = Path(__file__).resolve().parent / "results"


def walk(compiler: GrammarCompiler, schema: dict[str, Any], rng: random.Random) -> list[int]:
    """A path of tokens the compact-JSON grammar allows, ending where it accepts if it can."""
    state = compiler.compile(GrammarSpec.json_schema(schema)).new_constraint()
    bitmask = torch.zeros((1, (compiler.vocab_size + 31) // 32), dtype=torch.int32)
    path: list[int] = []
    for _ in range(64):
        if state.accepting and state.matcher.is_stopped():
            break
        bitmask.zero_()
        state.fill_allowed(bitmask, 0)
        allowed = [
            t
            for t in llguidance_allowed(bitmask, compiler.vocab_size)
            if t != compiler.ll_tokenizer.eos_token
        ]
        if not allowed:
            break
        token = rng.choice(allowed)
        assert state.advance(token)
        path.append(token)
    return path


def llguidance_allowed(bitmask: torch.Tensor, vocab: int) -> list[int]:
    return unpack_bitmask(bitmask, vocab)[0].nonzero().flatten().tolist()


def time_llguidance(
    ll_tokenizer: llguidance.LLTokenizer, schema: dict[str, Any], path: list[int], vocab: int
) -> tuple[float, list[float]]:
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    compile_s = time.perf_counter() - start
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    masks = []
    for token in path:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        masks.append(time.perf_counter() - start)
        assert matcher.consume_token(token), matcher.get_error()
    return compile_s, masks


def time_xgrammar(
    xgr: Any, info: Any, schema: dict[str, Any], path: list[int], vocab: int
) -> tuple[float, list[float]]:
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
    )
    compile_s = time.perf_counter() - start
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    masks = []
    for token in path:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        masks.append(time.perf_counter() - start)
        if not matcher.accept_token(token):
            raise RuntimeError("xgrammar rejected a token llguidance allowed")
    return compile_s, masks


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "mean_ms": 1000 * statistics.fmean(ordered),
        "p50_ms": 1000 * pick(0.5),
        "p99_ms": 1000 * pick(0.99),
        "max_ms": 1000 * ordered[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory or .gguf (default model)")
    parser.add_argument("--tag", default="local")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import xgrammar as xgr  # a benchmark-only dependency

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.model))
    vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab, frozenset({eos}))
    ll_setup = time.perf_counter() - start
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[eos])
    xg_setup = time.perf_counter() - start
    rng = random.Random(args.seed)
    rows: dict[str, dict[str, list[float]]] = {
        "llguidance": {"compile": [], "mask": []},
        "xgrammar": {"compile": [], "mask": []},
    }
    skipped = []
    for what, schema in SCHEMAS:
        path = walk(compiler, schema, rng)
        ll = time_llguidance(compiler.ll_tokenizer, schema, path, vocab)
        try:
            xg = time_xgrammar(xgr, info, schema, path, vocab)
        except Exception as exc:  # a schema one backend cannot take counts for neither
            skipped.append(f"{what}: {exc}")
            continue
        for name, (compile_s, masks) in (("llguidance", ll), ("xgrammar", xg)):
            rows[name]["compile"].append(compile_s)
            rows[name]["mask"].extend(masks)
    report = {
        "tag": args.tag,
        "vocab_size": vocab,
        "schemas": len(SCHEMAS) - len(skipped),
        "skipped": skipped,
        "tokenizer_setup_s": {"llguidance": ll_setup, "xgrammar": xg_setup},
        "compile": {k: quantiles(v["compile"]) for k, v in rows.items()},
        "mask_per_token": {k: quantiles(v["mask"]) for k, v in rows.items()},
        "masks_timed": len(rows["llguidance"]["mask"]),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"grammar-backends-{args.tag}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"vocab {vocab}, {report['schemas']} schemas, {report['masks_timed']} masks each")
    print("backend     setup s  compile p50/p99 ms  mask mean/p50/p99/max ms")
    for name in rows:
        c, m = report["compile"][name], report["mask_per_token"][name]
        print(
            f"{name:<11} {report['tokenizer_setup_s'][name]:7.2f}  "
            f"{c['p50_ms']:7.2f} / {c['p99_ms']:7.2f}   "
            f"{m['mean_ms']:.3f} / {m['p50_ms']:.3f} / {m['p99_ms']:.3f} / {m['max_ms']:.3f}"
        )
    print(f"written {out}")


if __name__ == "__main__":
    main()

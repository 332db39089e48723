"""Accuracy of the fast weight formats against fp32: perplexity on a bundled text, greedy agreement.

    python -m benchmarks.accuracy [--model M] [--formats fp32,bf16,int8] [--prompts 8 --tokens 32]
        [--more-text docs/guides]

Perplexity runs the model over `benchmarks/accuracy_text.txt` in one forward pass (about 400 of
Gemma's tokens: formats closer than about 1% do not separate on it); `--more-text` adds the pooled
perplexity of longer text, one forward per 2,000 characters. Greedy agreement
runs our engine on the bundled prompts with each format and counts, per prompt, how many leading
tokens equal the fp32 engine's (a format that flips one early token drifts from there on, so the
"first divergence" is the honest measure), plus the share of prompts whose whole output is equal.
Writes JSON to --out-dir: each format's figures, the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from benchmarks.machine import machine_info
from decoding import DecodingParams
from server.docgen.published import reproducing_command
from server.engine.engine import Engine
from server.engine.request import EngineRequest
from server.model.loader import resolve_model_dir
from server.model.quantization import RescoredInt8Head
from server.model.runner import ModelRunner

HERE = Path(__file__).resolve().parent
TOP_RANKED = 8  # the tokens a beam search of 4 ranks per row
CHUNK_CHARS = 2000  # --more-text's pieces: about 500 tokens, 0.5 GB of logits over 262k tokens
FORMATS = {
    "fp32": (torch.float32, "none"),
    "bf16": (torch.bfloat16, "none"),
    "int8": (torch.float32, "int8"),  # int8 LM head, fp32 body
    "bf16-int8": (torch.bfloat16, "int8"),  # int8 LM head, bf16 body
    "int8-weights": (torch.float32, "int8-weights"),  # int8 LM head, weight-only int8 body
    "w8a8": (torch.float32, "w8a8"),  # int8 head, int8 x int8 body (q/k/v, down_proj not)
    "w8a8-all": (torch.float32, "w8a8-all"),  # int8 LM head, every body layer int8 x int8
}


def load_prompts(count: int) -> list[str]:
    lines = (HERE / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()][:count]


def perplexity(runner: ModelRunner, tokenizer, text: str) -> tuple[float, tuple[int, int] | None]:
    """exp(mean next-token NLL) over `text`: the runner's decoder with transformers' own (non-paged)
    attention, then the runner's LM head (quantized or not). With an int8 head, also the worst
    rank (0 = first) that the rescored top token, and any of the top 8, held among the int8
    logits before rescoring: below what the head re-scores (RESCORED_CANDIDATES; fewer for steps
    that rank few tokens: RescoredInt8Head.rescored) at every position means greedy, and a beam
    search of 4, never missed them."""
    ids = torch.tensor([tokenizer(text).input_ids], device=runner.device)
    model = runner.model
    saved = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            hidden = runner.decoder(input_ids=ids).last_hidden_state[0, :-1]
            logits = runner.lm_head(hidden.to(runner.head_dtype)).float()
            worst_ranks = None
            if isinstance(runner.lm_head, RescoredInt8Head):
                approx = runner.lm_head.approximate(hidden.float())
                top = approx.gather(1, logits.topk(TOP_RANKED, dim=1).indices)  # [N, 8]
                # one column at a time: [N, V] compares, not an [N, 8, V] one
                ranks = [
                    int((approx > top[:, j : j + 1]).sum(dim=1).max()) for j in range(TOP_RANKED)
                ]
                worst_ranks = (ranks[0], max(ranks))
            if runner.final_softcap is not None:
                logits = torch.tanh(logits / runner.final_softcap) * runner.final_softcap
    finally:
        model.set_attn_implementation(saved)
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(float(nll)), worst_ranks


def text_chunks(paths: list[Path], chars: int = CHUNK_CHARS) -> list[str]:
    """The files named (a folder: its *.md and *.txt files, sorted), cut into pieces of `chars`
    characters: one forward each."""
    files = [
        f
        for path in paths
        for f in (sorted([*path.glob("*.md"), *path.glob("*.txt")]) if path.is_dir() else [path])
    ]
    text = "\n".join(f.read_text() for f in files)
    return [text[i : i + chars] for i in range(0, len(text), chars)]


def pooled_perplexity(runner: ModelRunner, tokenizer, texts: list[str]) -> float:
    """exp(mean next-token NLL) over every token of every text (each its own forward)."""
    total = count = 0.0
    for text in texts:
        tokens = len(tokenizer(text).input_ids) - 1
        total += math.log(perplexity(runner, tokenizer, text)[0]) * tokens
        count += tokens
    return math.exp(total / count)


def greedy_outputs(
    runner: ModelRunner, tokenizer, prompts: list[str], tokens: int
) -> tuple[list[list[int]], float]:
    engine = Engine(runner, tokenizer, max_num_batched_tokens=1024)
    results: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    params = DecodingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.submit(
            EngineRequest(
                str(i),
                tokenizer(p).input_ids,
                params,
                lambda out, i=i: results[i].extend(out.token_ids),
            )
        )
    start = time.perf_counter()
    while engine.step():
        pass
    elapsed = time.perf_counter() - start
    return [results[i] for i in range(len(prompts))], len(prompts) * tokens / elapsed


def leading_agreement(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="model directory or .gguf (default: Gemma 3 270M)"
    )
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument(
        "--more-text",
        type=Path,
        nargs="*",
        default=[],
        help="files or folders (their *.md, *.txt) whose pooled perplexity is reported too: "
        "a longer text than the bundled one separates formats better",
    )
    args = parser.parse_args(argv)
    more_text = text_chunks(args.more_text) if args.more_text else []
    torch.manual_seed(0)
    model_dir = resolve_model_dir(args.model)
    prompts = load_prompts(args.prompts)
    text = (HERE / "accuracy_text.txt").read_text()
    report: dict[str, object] = {
        "command": reproducing_command(
            "benchmarks.accuracy", sys.argv[1:] if argv is None else argv, ("--out-dir",)
        ),
        "machine": machine_info(),
    }
    reference: list[list[int]] | None = None
    for name in args.formats.split(","):
        dtype, quantization = FORMATS[name]
        runner = ModelRunner(
            model_dir,
            device=torch.device("cpu"),
            dtype=dtype,
            block_size=16,
            num_blocks=512,
            quantization=quantization,
        )
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        outputs, tok_s = greedy_outputs(runner, tokenizer, prompts, args.tokens)
        ppl, worst_ranks = perplexity(runner, tokenizer, text)
        entry: dict[str, object] = {
            "perplexity": round(ppl, 4),
            "greedy_tok_s_batch": round(tok_s, 1),
        }
        if more_text:
            pooled = pooled_perplexity(runner, tokenizer, more_text)
            entry["perplexity_more_text"] = round(pooled, 4)
        if worst_ranks is not None:
            entry["worst_int8_rank_of_top_token"] = worst_ranks[0]
            entry[f"worst_int8_rank_of_top_{TOP_RANKED}"] = worst_ranks[1]
        if reference is None:
            reference = outputs
        else:
            lead = [leading_agreement(o, r) for o, r in zip(outputs, reference)]
            entry["mean_tokens_before_first_divergence"] = round(sum(lead) / len(lead), 2)
            entry["identical_outputs"] = (
                f"{sum(o == r for o, r in zip(outputs, reference))}/{len(outputs)}"
            )
            entry["token_agreement"] = round(
                sum(x == y for o, r in zip(outputs, reference) for x, y in zip(o, r))
                / (len(outputs) * args.tokens),
                3,
            )
        report[name] = entry
        print(f"{name:5s} {entry}", flush=True)
        del runner
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "accuracy.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Exact parity with transformers 4.55.4, the last release with v4 beam machinery in the library.

It needs a scratch virtualenv with transformers 4.55.4, which `tests/hf455_venv.sh` builds once
(about a minute; ~/.cache/beamline/hf455, or $BEAMLINE_HF455_VENV) and reuses after; it prints
the venv's python:

    BEAMLINE_HF455_PYTHON="$(tests/hf455_venv.sh)" python -m pytest tests/test_decoding_hf455.py

`.ci/run` does exactly that. Without BEAMLINE_HF455_PYTHON the test skips, except under CI=true,
where it fails: CI must run it. A BEAMLINE_HF455_PYTHON that cannot import transformers 4.55.4
and torch always fails.

The test builds the tiny llama and runs this file as a script under that interpreter, which
compares our state machines with:
- beam search: a v4 `_beam_search` loop around 4.55's own `BeamSearchScorer` (the class whose
  semantics we follow, including early_stopping=True on the last step);
- beam sampling: the v4 `_beam_sample` loop (warpers per step, `torch.multinomial` over all beams,
  candidates sorted by score) with HF's global RNG seeded like our per-request generator;
- group beam search: 4.55's `generate(num_beam_groups=..., diversity_penalty=...)`.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

HF455_PYTHON = os.environ.get("BEAMLINE_HF455_PYTHON")
ROOT = Path(__file__).resolve().parents[1]
PROBE = "import torch, transformers; assert transformers.__version__ == '4.55.4'"
PROMPTS = [
    [330, 320, 299, 78, 265, 379, 81, 268, 376],
    [43, 296, 367, 327, 301, 4, 314, 303, 262, 286],
]


def test_parity_with_transformers_4_55(tmp_path: Path) -> None:
    import pytest

    if not HF455_PYTHON:
        why = (
            "BEAMLINE_HF455_PYTHON is not set; build the transformers 4.55.4 venv with "
            'BEAMLINE_HF455_PYTHON="$(tests/hf455_venv.sh)" (see this file\'s docstring)'
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {why}", pytrace=False)
        pytest.skip(why)
    # Set but broken fails everywhere: whoever set it meant the test to run.
    if shutil.which(HF455_PYTHON) is None:
        problem = "is not an executable"
    else:
        probe = subprocess.run(
            [HF455_PYTHON, "-c", PROBE], capture_output=True, text=True, timeout=300
        )
        problem = f"fails {PROBE!r}:\n{probe.stderr[-2000:]}" if probe.returncode else ""
    if problem:
        pytest.fail(
            f"BEAMLINE_HF455_PYTHON={HF455_PYTHON} {problem}\n"
            "(re)build it with tests/hf455_venv.sh",
            pytrace=False,
        )
    from tests.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "llama", "llama")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [HF455_PYTHON, __file__, str(model_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    print(run.stdout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "mismatches: 0" in run.stdout


def main(model_dir: str) -> int:  # pragma: no cover - runs under transformers 4.55
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.generation.beam_search import BeamSearchScorer
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from decoding import DecodingParams, SamplingTensors, make_beam_search, process_logits

    assert transformers.__version__ == "4.55.4", transformers.__version__
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    vocab, eos = model.config.vocab_size, 2

    @torch.no_grad()
    def logits_of(rows: list[list[int]]) -> torch.Tensor:
        return model(input_ids=torch.tensor(rows), use_cache=False).logits[:, -1, :]

    def ours(params: DecodingParams, prompt: list[int]) -> list[tuple[list[int], float]]:
        search = make_beam_search(params, {eos})
        rows: list[list[int]] = [[]]
        while not search.done:
            t = SamplingTensors.from_rows(
                [params] * len(rows), [prompt] * len(rows), rows, {eos}, vocab, "cpu"
            )
            step = search.step(process_logits(logits_of([prompt + r for r in rows]), t))
            rows = [rows[p] + [tok] for p, tok in zip(step.parents, step.tokens)]
        return [(h.token_ids, h.score) for h in search.finalize()]

    def trim(
        sequences: torch.Tensor, scores: torch.Tensor, prompt_len: int
    ) -> list[tuple[list[int], float]]:
        out = []
        for row, score in zip(sequences[:, prompt_len:].tolist(), scores.tolist()):
            row = row[: row.index(eos) + 1] if eos in row else [t for t in row if t != 0]
            out.append((row, score))
        return out

    @torch.no_grad()
    def v4_loop(params, prompt, processors, warpers=None, seed=None):  # noqa: ANN001, ANN202
        """transformers v4 `_beam_search` / `_beam_sample` around HF's own BeamSearchScorer."""
        w, max_length = params.num_beams, len(prompt) + params.max_tokens
        scorer = BeamSearchScorer(
            1,
            w,
            "cpu",
            length_penalty=params.length_penalty,
            do_early_stopping=params.early_stopping,
            num_beam_hyps_to_keep=params.n,
            max_length=max_length,
        )
        ids = torch.tensor([prompt] * w)
        beam_scores = torch.zeros(w)
        beam_scores[1:] = -1e9
        if seed is not None:
            torch.manual_seed(seed)
        while True:
            scores = processors(ids, logits_of(ids.tolist()).float().log_softmax(-1))
            if warpers is not None:
                scores = warpers(ids, scores)
            flat = (scores + beam_scores[:, None]).view(1, w * vocab)
            if warpers is None:
                top, index = flat.topk(2 * w, dim=1)
            else:
                index = torch.multinomial(flat.softmax(-1), 2 * w)
                top, order = flat.gather(-1, index).sort(descending=True, dim=1)
                index = index.gather(-1, order)
            out = scorer.process(
                ids,
                top,
                index % vocab,
                index // vocab,
                pad_token_id=0,
                eos_token_id=[eos],
                decoder_prompt_len=len(prompt),
            )
            beam_scores = out["next_beam_scores"]
            ids = torch.cat(
                [ids[out["next_beam_indices"]], out["next_beam_tokens"].unsqueeze(-1)], -1
            )
            if scorer.is_done or ids.shape[1] >= max_length:
                break
        final = scorer.finalize(
            ids,
            beam_scores,
            None,
            None,
            max_length=max_length,
            pad_token_id=0,
            eos_token_id=[eos],
            decoder_prompt_len=len(prompt),
        )
        return trim(final["sequences"], final["sequence_scores"], len(prompt))

    def same(a, b) -> bool:  # noqa: ANN001
        return [x[0] for x in a] == [y[0] for y in b] and all(
            abs(x[1] - y[1]) < 1e-4 for x, y in zip(a, b)
        )

    mismatches = total = 0

    def record(label: str, a, b) -> None:  # noqa: ANN001
        nonlocal mismatches, total
        total += 1
        if not same(a, b):
            mismatches += 1
            print(f"MISMATCH {label}\n  ours {a}\n  hf   {b}")

    for w, lp, es, bias, rep in itertools.product(
        (2, 4), (-1.0, 1.0, 2.0), (True, False, "never"), (0.0, 5.0), (1.0, 1.3)
    ):
        for prompt in PROMPTS:
            params = DecodingParams(
                max_tokens=7,
                num_beams=w,
                n=min(w, 3),
                length_penalty=lp,
                early_stopping=es,
                logit_bias={eos: bias} if bias else {},
                repetition_penalty=rep,
            )
            procs = ([SequenceBiasLogitsProcessor({(eos,): bias})] if bias else []) + (
                [RepetitionPenaltyLogitsProcessor(rep)] if rep != 1.0 else []
            )
            record(
                f"beam {w} {lp} {es} {bias} {rep}",
                ours(params, prompt),
                v4_loop(params, prompt, LogitsProcessorList(procs)),
            )

    for w, seed, temp, top_k, top_p in itertools.product(
        (2, 4), (0, 1, 2), (0.7, 1.3), (0, 20), (1.0, 0.9)
    ):
        prompt = PROMPTS[seed % 2]
        params = DecodingParams(
            max_tokens=6,
            num_beams=w,
            n=2,
            do_sample=True,
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            logit_bias={eos: 4.0},
            seed=seed,
        )
        warpers = [TemperatureLogitsWarper(temp)] + (
            [TopKLogitsWarper(top_k, min_tokens_to_keep=2)] if top_k else []
        )
        warpers += [TopPLogitsWarper(top_p, min_tokens_to_keep=2)] if top_p < 1.0 else []
        ref = v4_loop(
            params,
            prompt,
            LogitsProcessorList([SequenceBiasLogitsProcessor({(eos,): 4.0})]),
            LogitsProcessorList(warpers),
            seed=seed,
        )
        record(f"beam_sample {w} {seed} {temp} {top_k} {top_p}", ours(params, prompt), ref)

    for (w, g), div, lp, es in itertools.product(
        ((4, 2), (6, 3), (4, 4), (6, 2)), (0.5, 2.0), (1.0, -1.0), (False, True, "never")
    ):
        for prompt in PROMPTS:
            params = DecodingParams(
                max_tokens=7,
                num_beams=w,
                num_beam_groups=g,
                diversity_penalty=div,
                n=3,
                length_penalty=lp,
                early_stopping=es,
                logit_bias={eos: 4.0},
            )
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=7,
                num_beams=w,
                num_beam_groups=g,
                diversity_penalty=div,
                num_return_sequences=3,
                length_penalty=lp,
                early_stopping=es,
                sequence_bias={(eos,): 4.0},
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                trust_remote_code=True,
            )
            record(
                f"group {w} {g} {div} {lp} {es}",
                ours(params, prompt),
                trim(out.sequences, out.sequences_scores, len(prompt)),
            )

    print(f"cases: {total} mismatches: {mismatches}")
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""lm-evaluation-harness end to end: `lm_eval --model local-completions` against a live beamline
serving the default model, and `lm_eval --model hf` on the same weights, on a small task bundled
in tests/lm_eval_tasks (a multiple-choice task scored through echo + logprobs, and a greedy
generate-until task). Same picks, per-item loglikelihoods within 1e-3 (fp32 on both sides), same
generations. Through the CPU default's number format (w8a8) too: the scored prompts run at full
precision (server/model/exact_weights.py), so the loglikelihoods are those of the exact mode.

Both sides see the same tokens: `--model hf` prepends Gemma's BOS (its tokenizer adds one), and
`local-completions` is told to (`add_bos_token=True`) and sends token ids, taking its tokenizer
from the served model's local directory (no hub); the server adds no second BOS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.api.app import create_app
from server.api.serving import ServingContext
from server.model.loader import resolve_model_dir
from tests.conftest import make_engine, serving_context
from tests.live_server import live_server

pytestmark = [pytest.mark.default_model, pytest.mark.lm_eval]

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval_tasks"
TASK_NAMES = ("beamline_mc", "beamline_gen")
SERVED_NAME = "gemma-3-270m"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_dir(None)


def serving(model_dir: Path, quantization: str) -> ServingContext:
    engine = make_engine(model_dir, num_blocks=512, block_size=16, quantization=quantization)
    return serving_context(engine, name=SERVED_NAME)


@pytest.fixture(scope="module")
def hf(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    """lm-eval's own transformers backend on the same weights, in fp32: the reference."""
    return run_lm_eval("hf", f"pretrained={model_dir},dtype=float32", tmp_path_factory.mktemp("hf"))


def run_served(ctx: ServingContext, model_dir: Path, out: Path, tasks: tuple[str, ...]) -> dict:
    try:
        with live_server(create_app(ctx=ctx)) as base:
            return run_lm_eval(
                "local-completions",
                f"base_url={base}/v1/completions,model={SERVED_NAME},"
                f"tokenizer_backend=huggingface,tokenizer={model_dir},add_bos_token=True,"
                "tokenized_requests=True,num_concurrent=1,max_retries=1",
                out,
                tasks,
            )
    finally:
        ctx.engine.shutdown()


def loglikelihoods(samples: dict[int, dict]) -> dict[int, list[float]]:
    return {doc: [float(r[0]) for r in s["filtered_resps"]] for doc, s in samples.items()}


def run_lm_eval(
    model: str, model_args: str, out: Path, tasks: tuple[str, ...] = TASK_NAMES
) -> dict[str, dict[int, dict]]:
    """Run the lm_eval CLI offline; per task, its logged samples by doc id."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        ",".join(tasks),
        "--include_path",
        str(TASKS),
        "--output_path",
        str(out),
        "--log_samples",
        "--batch_size",
        "1",
        "--device",
        "cpu",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    samples: dict[str, dict[int, dict]] = {}
    for task in tasks:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        lines = path.read_text().splitlines()
        samples[task] = {s["doc_id"]: s for s in map(json.loads, lines)}
    return samples


def test_lm_eval_through_beamline_equals_lm_eval_on_hf(
    hf: dict[str, dict[int, dict]], model_dir: Path, tmp_path: Path
) -> None:
    served = run_served(serving(model_dir, "none"), model_dir, tmp_path, TASK_NAMES)

    mc_served, mc_hf = served["beamline_mc"], hf["beamline_mc"]
    assert set(mc_served) == set(mc_hf) and len(mc_hf) == 8
    worst = 0.0
    for doc_id, ref in mc_hf.items():
        got = mc_served[doc_id]
        ref_ll = [float(r[0]) for r in ref["filtered_resps"]]
        got_ll = [float(r[0]) for r in got["filtered_resps"]]
        assert len(got_ll) == len(ref_ll) == 4 and max(ref_ll) < 0
        assert got_ll == pytest.approx(ref_ll, abs=1e-3), doc_id
        assert got_ll.index(max(got_ll)) == ref_ll.index(max(ref_ll))  # the same pick
        assert got["acc"] == ref["acc"]
        worst = max(worst, max(abs(a - b) for a, b in zip(got_ll, ref_ll)))
    print(f"largest loglikelihood difference: {worst:.2e}")
    assert len({round(float(r[0]), 3) for s in mc_hf.values() for r in s["filtered_resps"]}) > 8

    gen_served, gen_hf = served["beamline_gen"], hf["beamline_gen"]
    assert set(gen_served) == set(gen_hf) and len(gen_hf) == 4
    for doc_id, ref in gen_hf.items():
        assert gen_served[doc_id]["filtered_resps"] == ref["filtered_resps"], doc_id
    assert any(s["filtered_resps"][0].strip() for s in gen_hf.values())  # not all empty


def test_lm_eval_through_the_int8_default_scores_as_the_exact_mode(
    hf: dict[str, dict[int, dict]], model_dir: Path, tmp_path: Path
) -> None:
    """The CPU default's w8a8 decoder: every choice's loglikelihood within 1e-3 of transformers'
    in fp32 (the int8 kernels moved them by up to about a nat), the same picks."""
    served = run_served(serving(model_dir, "w8a8"), model_dir, tmp_path, ("beamline_mc",))
    got, ref = loglikelihoods(served["beamline_mc"]), loglikelihoods(hf["beamline_mc"])
    assert set(got) == set(ref) and len(ref) == 8
    worst = max(abs(a - b) for doc in ref for a, b in zip(got[doc], ref[doc], strict=True))
    print(f"largest loglikelihood difference under w8a8: {worst:.2e}")
    assert worst < 1e-3
    assert {d: v.index(max(v)) for d, v in got.items()} == {
        d: v.index(max(v)) for d, v in ref.items()
    }

"""`python -m benchmarks.seq2seq` end to end at toy size: the random Marian- and T5-shaped models
load in beamline, CTranslate2 (through its own converter) and transformers alike, every system
decodes exactly the asked lengths, beamline and CTranslate2 give `generate()`'s beams, and the
ratios come from what was measured. CTranslate2 is in the test extra: without it this fails."""

from __future__ import annotations

import json
from pathlib import Path

import ctranslate2  # noqa: F401  (the peer: a missing install fails here, not skips)
import pytest

from benchmarks import seq2seq
from benchmarks.translation.models import build_translation_model


def test_the_workload_is_seeded_and_ends_each_source_with_eos() -> None:
    first = seq2seq.workload(512, 6, "10,60", eos=0, seed=3)
    assert first == seq2seq.workload(512, 6, "10,60", eos=0, seed=3)
    assert all(10 <= len(s) <= 60 and s[-1] == 0 and 0 not in s[:-1] for s in first)
    assert all(3 <= t < 511 for s in first for t in s[:-1])  # no special, never Marian's pad


@pytest.mark.parametrize("shape", ["tiny-marian", "tiny-t5"])
def test_the_models_put_special_tokens_where_the_converters_read_them(
    tmp_path: Path, shape: str
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_translation_model(shape, tmp_path))
    if shape == "tiny-marian":  # opus-mt: </s> 0, <unk> 1, <pad> last (the decoder's start)
        assert (tokenizer.eos_token_id, tokenizer.unk_token_id, tokenizer.pad_token_id) == (
            0,
            1,
            511,
        )
    else:
        assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.decode(tokenizer("wf wg").input_ids, skip_special_tokens=True) == "wf wg"


def test_the_benchmark_runs_every_system_and_reports_its_ratios(tmp_path: Path) -> None:
    import torch

    threads = torch.get_num_threads()
    code = seq2seq.main(
        [
            "--short", "--concurrency", "1,3", "--num-requests", "6", "--rounds", "1",
            "--max-tokens", "6", "--ct2", "float32:1x2,int8:2x1", "--repeats", "2",
            "--model-root", str(tmp_path / "models"), "--out-dir", str(tmp_path), "--tag", "t",
        ]
    )  # fmt: skip
    assert code == 0
    assert torch.get_num_threads() == threads  # generate()'s threads given back to the worker
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["complete"] and doc["machine"]["ctranslate2"]
    assert doc["command"] == (
        "python -m benchmarks.seq2seq --short --concurrency 1,3 --num-requests 6 --rounds 1 "
        "--max-tokens 6 --ct2 float32:1x2,int8:2x1 --repeats 2"
    )
    for shape in ("tiny-marian", "tiny-t5"):
        for level, requests in (("c=1", 6), ("c=3", 6)):
            systems = doc["results"][shape][level]
            summary = systems.pop("summary")
            expected = {"beamline", "beamline-w8a8-all", "beamline-w8a8-all-eager"}
            expected.add("ct2-float32-1x2")
            expected.add("generate")
            if level == "c=3":  # two translators only where a batch can be split
                expected.add("ct2-int8-2x1")
            assert set(systems) == expected
            for row in systems.values():
                assert row["requests"] == requests
                assert row["output_tokens_per_s"] == pytest.approx(requests * 6 / row["wall_s"])
                assert len(row["turns_tokens_per_s"]) == 2  # the fastest of two turns kept
                assert row["output_tokens_per_s"] == max(row["turns_tokens_per_s"])
            matches = summary["exact_vs_generate"]
            assert matches["beamline"] == matches["ct2-float32-1x2"] == f"{requests}/{requests}"
            ct2 = {name: row for name, row in systems.items() if name.startswith("ct2-")}
            best = max(ct2, key=lambda name: ct2[name]["output_tokens_per_s"])
            assert summary["best_ctranslate2"] == best
            assert "beamline-w8a8-all" in matches  # int8: compared, not required to match
            for mode in ("beamline", "beamline-w8a8-all", "beamline-w8a8-all-eager"):
                key = mode.replace("-", "_")
                ours = systems[mode]["output_tokens_per_s"]
                assert summary[f"{key}_vs_ctranslate2"] == pytest.approx(
                    ours / ct2[best]["output_tokens_per_s"]
                )
                assert summary[f"{key}_vs_generate"] == pytest.approx(
                    ours / systems["generate"]["output_tokens_per_s"]
                )

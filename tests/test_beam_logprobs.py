"""Logprobs of beam choices: taken from the search's own hypotheses, exact, and linear in memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoding import DecodingParams
from server.engine.request import EngineRequest, RequestOutput
from tests.conftest import hf_reference, make_engine
from tests.engine_driver import run_to_completion

STRATEGIES = {
    "beam": {"num_beams": 3},
    "beam_sample": {"num_beams": 3, "do_sample": True, "seed": 7},
    "group_beam": {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5},
}


def run_request(
    model_dir: Path, prompt: list[int], params: DecodingParams
) -> tuple[EngineRequest, list[RequestOutput]]:
    engine = make_engine(model_dir)
    outputs: list[RequestOutput] = []
    req = EngineRequest("beams", prompt, params, outputs.append)
    engine.submit(req)
    run_to_completion(engine)
    assert engine.pool.num_free == engine.pool.num_blocks
    return req, outputs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_beam_choice_has_the_raw_model_logprobs_of_its_tokens(
    llama_dir: Path, strategy: str
) -> None:
    ref, tok = hf_reference(llama_dir)
    prompt = tok("Once upon a time there was").input_ids
    num_beams = STRATEGIES[strategy]["num_beams"]
    params = DecodingParams(
        max_tokens=8, n=num_beams, logprobs=2, ignore_eos=True, **STRATEGIES[strategy]
    )
    req, outputs = run_request(llama_dir, prompt, params)
    assert req.params.strategy == strategy
    assert [o.index for o in outputs] == list(range(num_beams))
    for out in outputs:
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 8
        with torch.no_grad():
            logits = ref(torch.tensor([prompt + out.token_ids])).logits[0]
        logp = logits[len(prompt) - 1 : -1].log_softmax(dim=-1)  # the step that chose each token
        for t, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(logp[t, token]), abs=1e-4)
            top = logp[t].topk(2)
            assert [i for i, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("max_tokens", [60, 120])
def test_stored_beam_logprobs_grow_linearly_with_the_output(
    llama_dir: Path, max_tokens: int
) -> None:
    """One record per chosen (row, token) per step: beams x steps entries, never a prefix each."""
    params = DecodingParams(
        max_tokens=max_tokens, temperature=0, num_beams=4, logprobs=1, ignore_eos=True
    )
    req, outputs = run_request(llama_dir, [5, 6, 7, 8, 9], params)
    assert all(len(o.token_ids) == max_tokens for o in outputs)
    assert len(req.beam_logprobs) == max_tokens  # one record per step
    assert sum(len(step) for step in req.beam_logprobs) == 4 * max_tokens

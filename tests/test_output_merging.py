"""What AsyncEngine hands on: merged deltas for a consumer that fell behind, and the engine's
busy time.

A consumer that falls behind the engine gets one merged delta per choice, not a backlog.

AsyncEngine.generate merges the outputs already queued for a request (as vLLM's output collector
does): fewer chunks and writes when the event loop lags, the same text, tokens and logprobs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from decoding import DecodingParams
from server.engine.async_engine import AsyncEngine
from server.engine.client import merge_into
from server.engine.request import RequestOutput, TokenLogprob
from tests.conftest import make_engine


def delta(index: int, tokens: list[int], **fields: object) -> RequestOutput:
    logprobs = [TokenLogprob(t, -1.0, []) for t in tokens]
    base: dict = dict(
        request_id="r",
        index=index,
        text="".join(f"<{t}>" for t in tokens),
        token_ids=tokens,
        finish_reason=None,
        prompt_tokens=3,
        completion_tokens=tokens[-1] if tokens else 0,
        logprobs=logprobs,
    )
    return RequestOutput(**{**base, **fields})


def test_deltas_of_one_choice_merge_in_order() -> None:
    first, second = delta(0, [1]), delta(0, [2, 3], finish_reason="length", request_done=True)
    merged = first.merged(second)
    assert merged is not None
    assert (merged.text, merged.token_ids) == ("<1><2><3>", [1, 2, 3])
    assert [lp.token_id for lp in merged.logprobs or []] == [1, 2, 3]
    assert merged.finish_reason == "length" and merged.request_done
    assert merged.completion_tokens == 3


def test_what_must_stay_apart_does_not_merge() -> None:
    first = delta(0, [1])
    assert first.merged(delta(1, [2])) is None  # another choice
    assert delta(0, [1], finish_reason="stop").merged(delta(0, [2])) is None  # ended before
    assert first.merged(delta(0, [], error="boom")) is None
    assert first.merged(delta(0, [2], prompt_logprobs=[None])) is None
    assert first.merged(delta(0, [2], beam_score=-1.0)) is None
    assert first.merged(delta(0, [2], logprobs=[])) is None  # logprobs not one per token


def test_choices_merge_apart_and_the_last_output_stays_last() -> None:
    batch = [delta(0, [1]), delta(1, [2])]
    merge_into(batch, delta(0, [3]))  # into choice 0's delta, past choice 1's
    assert [(o.index, o.token_ids) for o in batch] == [(0, [1, 3]), (1, [2])]
    merge_into(batch, delta(0, [4], finish_reason="stop", request_done=True))
    assert [(o.index, o.token_ids) for o in batch] == [(0, [1, 3]), (1, [2]), (0, [4])]
    assert batch[-1].request_done


async def test_a_consumer_that_falls_behind_gets_the_same_stream_in_fewer_outputs(
    llama_dir: Path,
) -> None:
    engine = AsyncEngine(make_engine(llama_dir))
    engine.start()
    try:
        params = DecodingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1, n=2)
        prompt = [5, 9, 13, 17]

        async def collect(lag: float) -> list[RequestOutput]:
            got = []
            async for out in engine.generate(f"lag{lag}", prompt, params):
                got.append(out)
                await asyncio.sleep(lag)
            return got

        prompt_first = await collect(0.0)  # the prompt is cached: both runs decode alike
        steady, lagging = await collect(0.0), await collect(0.5)
        for runs in (steady, lagging):
            assert runs[-1].request_done and sum(o.request_done for o in runs) == 1
        for choice in (0, 1):
            outs = [[o for o in run if o.index == choice] for run in (steady, lagging)]
            texts = ["".join(o.text for o in run) for run in outs]
            tokens = [[t for o in run for t in o.token_ids] for run in outs]
            logprobs = [[lp.token_id for o in run for lp in o.logprobs or []] for run in outs]
            assert texts[0] == texts[1] and tokens[0] == tokens[1] == logprobs[1]
            assert len(tokens[1]) == 24
        assert len(lagging) < len(steady)  # the backlog came as merged deltas
        assert prompt_first
    finally:
        engine.shutdown()


async def test_engine_stats_count_the_seconds_spent_in_steps(llama_dir: Path) -> None:
    """busy_seconds: wall time inside steps that did work; idle waiting does not count."""
    engine = AsyncEngine(make_engine(llama_dir))
    engine.start()
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        async for _ in engine.generate("r", [5, 9, 13], DecodingParams(max_tokens=8)):
            pass
        busy = engine.stats()["busy_seconds"]
        assert 0 < busy <= loop.time() - start
        await asyncio.sleep(0.3)  # idle: the loop waits for work, nothing is added
        assert engine.stats()["busy_seconds"] == busy
    finally:
        engine.shutdown()

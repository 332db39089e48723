"""Several models in one engine (engine level): requests that name an extra model run their rows
on it, in the same steps as the served model's rows. Each request equals its run alone on an
engine that serves its model (that engine checked against transformers' `generate()`), in one
busy batch of plain, sampled, beam, constrained and fused requests, with async scheduling and
with n-gram drafts; a cached prompt of one model is never another's; every block comes back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from decoding import DecodingParams
from decoding.fusion import LMFusion
from decoding.grammar import GrammarCompiler, GrammarSpec
from server.config import ServerConfig
from server.engine.engine import Engine
from server.engine.fusion import Companions
from server.engine.request import EngineRequest
from server.plan_split import merge_outputs, subset_plan
from server.runner_setup import build_companions, build_runner
from server.step_plan import DeferredTokens, PlanScore, StepOutput, StepPlan, TableEdit
from tests.conftest import make_engine
from tests.engine_driver import Collected, Counted, run_to_completion, submit
from tests.lora_adapters import make_adapter
from tests.test_lm_fusion import runner
from tests.tiny_models import build_tiny_model

PROMPTS = [[1, 45, 97, 20], [1, 300, 12], [1, 7, 7, 7, 8, 9, 100, 200, 33, 7, 8, 9, 100]]
ALLOWED = tuple(range(0, 400, 3))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("named")
    return {name: build_tiny_model(root / name, "llama", seed=s) for s, name in enumerate("abc")}


def engine(dirs: dict[str, Path], main: str, *extra: str, **options: object) -> Engine:
    """An engine serving `main` with the `extra` models, each of which requests may name."""
    runners = {name: runner(dirs[name]) for name in extra}
    return Engine(
        runner(dirs[main]),
        AutoTokenizer.from_pretrained(dirs[main]),
        max_num_seqs=32,
        max_num_batched_tokens=16,  # prompts split over steps
        companions=Companions(runners, served={name: None for name in extra}),
        **options,  # type: ignore[arg-type]
    )


CASES: list[tuple[str | None, DecodingParams]] = [  # (the model named, or the served one)
    (None, DecodingParams(max_tokens=9, temperature=0.0)),
    ("b", DecodingParams(max_tokens=9, temperature=0.0)),
    ("b", DecodingParams(max_tokens=8, n=3, seed=5)),
    (None, DecodingParams(max_tokens=8, n=2, seed=5)),
    ("b", DecodingParams(max_tokens=6, num_beams=3, n=2)),
    (None, DecodingParams(max_tokens=6, num_beams=2)),
    ("b", DecodingParams(max_tokens=8, temperature=0.0, allowed_token_ids=ALLOWED)),
    ("b", DecodingParams(max_tokens=7, temperature=0.0, lm_fusion=LMFusion("c", 0.5))),
    (None, DecodingParams(max_tokens=7, temperature=0.0, lm_fusion=LMFusion("c", 0.5))),
    ("b", DecodingParams(max_tokens=7, temperature=0.0, repetition_penalty=1.3)),
    ("b", DecodingParams(max_tokens=40, seed=3)),  # structured (REGEX), sampled
    (None, DecodingParams(max_tokens=40, num_beams=2)),  # structured, beams
]
REGEX = "(yes|no|maybe)( (yes|no|maybe)){1,3}!"
STRUCTURED = {len(CASES) - 2, len(CASES) - 1}  # the cases constrained by REGEX


def send(engine: Engine, i: int, model: str | None = None) -> Collected:
    """Submit case `i` (its prompt, its params, REGEX's grammar for a structured case)."""
    params, prompt = CASES[i][1], PROMPTS[i % len(PROMPTS)]
    if i not in STRUCTURED:
        return submit(engine, str(i), prompt, params, model)
    tok = engine.tokenizer
    grammar = GrammarCompiler(tok, len(tok), engine.eos_token_ids).compile(
        GrammarSpec("regex", REGEX)
    )
    got = Collected()
    request = EngineRequest(
        str(i), prompt, params, got.outputs.append, constraint=grammar.new_constraint()
    )
    request.model_name = model
    engine.submit(request)
    return got


def tokens(got: Collected) -> list[list[int]]:
    return [t for _, t, _ in got.choices().values()]


def solo(dirs: dict[str, Path], i: int) -> list[list[int]]:
    """Case `i` alone on an engine that serves its model (`c` beside it, to fuse)."""
    alone = engine(dirs, CASES[i][0] or "a", "c")
    got = send(alone, i)
    run_to_completion(alone)
    return tokens(got)


def tokens_of(dirs: dict[str, Path], model: str, prompt: list[int], params: DecodingParams):
    """A request alone on an engine serving `model`."""
    alone = engine(dirs, model)
    got = submit(alone, "alone", prompt, params)
    run_to_completion(alone)
    return tokens(got)


@pytest.fixture(scope="module")
def solo_runs(dirs: dict[str, Path]) -> list[list[list[int]]]:
    return [solo(dirs, i) for i in range(len(CASES))]


def test_the_solo_engine_of_an_extra_model_matches_generate(dirs, solo_runs) -> None:
    """The reference runs are right: b's greedy request is b's generate()."""
    hf = AutoModelForCausalLM.from_pretrained(dirs["b"], dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[1]])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=9)
    assert solo_runs[1] == [out[0, ids.shape[1] :].tolist()]
    assert solo_runs[1] != tokens_of(dirs, "a", PROMPTS[1], CASES[1][1])  # the models differ


@pytest.mark.parametrize(
    "options",
    [{}, {"async_scheduling": True}, {"speculative_tokens": 3}],
    ids=["plain", "async", "ngram"],
)
def test_requests_of_two_models_in_one_batch_equal_their_solo_runs(
    dirs: dict[str, Path], solo_runs: list[list[list[int]]], options: dict
) -> None:
    both = engine(dirs, "a", "b", "c", **options)
    together = [send(both, i, model) for i, (model, _) in enumerate(CASES)]
    steps = 0
    while both.step():
        steps += 1
    assert [tokens(got) for got in together] == solo_runs
    assert all(t in ALLOWED for t in solo_runs[6][0])
    tok = both.tokenizer
    for i in STRUCTURED:
        assert all(
            re.fullmatch(REGEX, tok.decode(row, skip_special_tokens=True)) for row in solo_runs[i]
        ), solo_runs[i]
    assert both.pool.num_free == both.pool.num_blocks
    assert steps < 80  # one batch: the rows of both models advance in the same steps


def test_a_cached_prompt_of_one_model_is_not_another_models(dirs: dict[str, Path]) -> None:
    both = engine(dirs, "a", "b", "c")
    greedy = DecodingParams(max_tokens=5, temperature=0.0)
    prompt = PROMPTS[2]  # three full blocks: cached after the first request
    first = submit(both, "a", prompt, greedy)
    run_to_completion(both)
    second = submit(both, "b", prompt, greedy, "b")
    run_to_completion(both)
    assert tokens(first) == tokens_of(dirs, "a", prompt, greedy)
    assert tokens(second) == tokens_of(dirs, "b", prompt, greedy)
    assert both.stats.prefix_cache_hits == 0


def scored(got: Collected) -> list[float]:
    """The logprobs a request returned: its prompt's, then its tokens'."""
    prompt = [p.logprob for o in got.outputs for p in o.prompt_logprobs or [] if p is not None]
    return prompt + [t.logprob for o in got.outputs for t in o.logprobs or []]


def test_an_extra_models_logprobs_and_prompt_logprobs_are_its_own(dirs: dict[str, Path]) -> None:
    """A scored request of an extra model beside the served model's rows: its prompt is scored
    by the extra model (the plan's scored spans reindexed for its part), as alone."""
    params = DecodingParams(max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=2)
    plain = DecodingParams(max_tokens=6, temperature=0.0)
    both = engine(dirs, "a", "b")
    beside = [submit(both, f"p{i}", PROMPTS[i], plain) for i in range(2)]
    got = submit(both, "scored", PROMPTS[2], params, "b")
    run_to_completion(both)
    alone = {}
    for model in ("a", "b"):
        one = engine(dirs, model)
        alone[model] = submit(one, "scored", PROMPTS[2], params)
        run_to_completion(one)
    assert len(scored(got)) == len(PROMPTS[2]) - 1 + 4
    assert tokens(got) == tokens(alone["b"])
    assert scored(got) == pytest.approx(scored(alone["b"]), abs=1e-4)
    assert scored(got) != pytest.approx(scored(alone["a"]), abs=1e-4)
    want = [tokens_of(dirs, "a", PROMPTS[i], plain) for i in range(2)]
    assert [tokens(g) for g in beside] == want


def test_lora_adapters_and_an_extra_model_share_one_batch(
    dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Requests through an adapter of the served model, on the served model and on an extra
    model run together, each as alone; the adapters stay the served model's."""
    adapter = make_adapter(dirs["a"], tmp_path_factory.mktemp("named_lora") / "qv", r=8,
                           targets=["q_proj", "v_proj"], seed=0, scale=30.0)  # fmt: skip
    greedy = DecodingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    jobs = [(PROMPTS[i % 3], name) for i, name in enumerate(["qv", "b", None, "b", "qv", None])]

    def served(main: str, *extra: str) -> Engine:
        made = make_engine(
            dirs[main],
            num_blocks=128,
            max_loras=1,
            companions=Companions(
                {name: runner(dirs[name]) for name in extra}, served={n: None for n in extra}
            ),
        )
        made.load_adapter("qv", str(adapter))
        return made

    alone = []
    for prompt, name in jobs:
        engine_alone = served("b") if name == "b" else served("a")
        got = submit(engine_alone, "alone", prompt, greedy, None if name == "b" else name)
        run_to_completion(engine_alone)
        alone.append(tokens(got))
    both = served("a", "b")
    together = [submit(both, str(i), prompt, greedy, name) for i, (prompt, name) in enumerate(jobs)]
    run_to_completion(both)
    assert [tokens(got) for got in together] == alone
    assert alone[0] != alone[2]  # the adapter changes the served model's tokens
    assert both.pool.num_free == both.pool.num_blocks


def test_beside_a_compiled_model_an_extra_model_runs_its_compiled_step(
    dirs: dict[str, Path], tmp_path: Path
) -> None:
    """An extra model takes the served model's decode step: compiled (here at warm-up; beside
    serving on the CPU default, as the served model's), and its tokens are the eager step's."""
    config = ServerConfig(
        model=str(dirs["a"]),
        dtype="float32",
        torch_compile=True,
        compile_while_serving=False,
        cache_dir=tmp_path,
        num_kv_blocks=128,
        block_size=4,
        extra_models=[f"b={dirs['b']}"],
    )
    main = build_runner(config, dirs["a"], torch.device("cpu"))
    extra = build_companions(config, main, torch.device("cpu"))["b"]
    assert extra.compile_decode and extra.decode_step.compiled is not None
    extra.warm_up()  # compiles (or reads from the cache) and runs each graph once
    assert extra.decode_step.state == "compiled"
    extra.decode_step.run = counted = Counted(extra.decode_step.run)
    both = Engine(
        main,
        AutoTokenizer.from_pretrained(dirs["a"]),
        max_num_batched_tokens=16,
        companions=Companions({"b": extra}, served={"b": None}),
    )
    greedy = DecodingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = submit(both, "compiled", PROMPTS[1], greedy, "b")
    run_to_completion(both)
    assert tokens(got) == tokens_of(dirs, "b", PROMPTS[1], greedy)  # the eager engine's
    assert counted.calls >= 7  # every decode step after the prompt's


def test_a_model_that_cannot_serve_fails_its_request_alone(dirs: dict[str, Path]) -> None:
    main = runner(dirs["a"])
    both = Engine(
        main,
        AutoTokenizer.from_pretrained(dirs["a"]),
        companions=Companions(
            {"b": runner(dirs["b"]), "c": runner(dirs["c"])},
            served={"b": None, "c": "its sequences end at token ids [9]"},
        ),
    )
    greedy = DecodingParams(max_tokens=4, temperature=0.0)
    refused = submit(both, "r", PROMPTS[0], greedy, "c")
    twice = submit(both, "t", PROMPTS[0], DecodingParams(lm_fusion=LMFusion("b", 1.0)), "b")
    good = submit(both, "g", PROMPTS[0], greedy, "b")
    run_to_completion(both)
    assert refused.finish_reason == "error"
    message = str(refused.outputs[-1].error)
    assert "'c' cannot serve requests on this server: its sequences end" in message
    assert twice.finish_reason == "error" and "not fused twice" in str(twice.outputs[-1].error)
    assert good.finish_reason == "length" and len(tokens(good)[0]) == 4


def test_subset_plan_reindexes_a_rows_columns_scores_and_deferred_tokens() -> None:
    plan = StepPlan(
        row_ids=[10, 11, 12],
        starts=[0, 5, 7],
        num_new=[3, 1, 2],
        num_drafts=[0, 0, 1],
        samples=[False, True, True],
        tokens=[1, 2, 3, 4, 5, 6],
        table_edits=[TableEdit(0, 0, [1]), TableEdit(2, 1, [9])],
        released=[4],
        copies=[(1, 2)],
        scores=[PlanScore(2, 6, 7, 1, [6])],
        exact=[2],
        exact_logits=[1, 2],
        deferred=DeferredTokens(torch.tensor([7, 8]), [1, 2], [0, 1]),
    )
    part, logits_rows = subset_plan(plan, [0, 2])
    assert part.row_ids == [10, 12] and part.tokens == [1, 2, 3, 5, 6]
    assert part.table_edits == [TableEdit(0, 0, [1]), TableEdit(1, 1, [9])]
    assert part.released == [4] and part.copies == [(1, 2)]
    assert part.scores == [PlanScore(1, 6, 7, 1, [6])] and part.exact == [1]
    assert logits_rows == [1, 2] and part.exact_logits == [0, 1]
    assert part.deferred is not None and (part.deferred.rows, part.deferred.sources) == ([1], [1])
    assert subset_plan(plan, [0])[0].deferred is None
    merged = merge_outputs(
        3,
        [
            ([1], [0], StepOutput(torch.zeros(1, 4))),
            ([0, 2], [1, 2], StepOutput(torch.ones(2, 4), scores={1: "scored"})),  # type: ignore[dict-item]
        ],
    )
    assert merged.logits[:, 0].tolist() == [0.0, 1.0, 1.0] and merged.scores == {2: "scored"}

"""LM fusion in the continuous batch (engine level): a second tiny Llama with the same vocabulary
fused into every step, token-exact against transformers' `generate()` given a logits processor
that implements fairseq's formula (`log_softmax(main) + weight * log_softmax(lm)`, applied to
generate()'s scores: raw logits for greedy and sampling, log-probs for beams, as fairseq's
beams accumulate them); contrastive decoding against a reference loop; fused rows mixed with
plain ones; the companion's KV blocks (the main pool's ids) freed with the request."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from decoding import (
    DecodingParams,
    SamplingTensors,
    choose_tokens,
    make_beam_search,
    process_logits,
)
from decoding.fusion import LMFusion, fuse_logits_
from decoding.random_streams import RandomStreams, stream_key
from server.api.encoder_decoder import SourceModel
from server.engine.engine import Engine
from server.engine.fusion import Companions, plan_rows
from server.model.runner import ModelRunner
from server.model.seq2seq.runner import Seq2SeqRunner
from server.model.seq2seq.target_lm import TargetLM
from server.step_plan import StepPlan, TableEdit
from tests.conftest import TEST_DEVICE
from tests.engine_driver import run_to_completion, submit
from tests.test_decoding_beams import drive
from tests.tiny_models import build_tiny_model
from tests.tiny_seq2seq import build_tiny_seq2seq

PROMPTS = [[1, 45, 97, 20], [1, 300, 12], [1, 7, 7, 7, 8, 9, 100, 200, 33]]
BLOCKS = 128


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fusion")
    return build_tiny_model(root / "main", "llama", seed=0), build_tiny_model(
        root / "lm", "llama", seed=1
    )


def runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(
        model_dir,
        device=TEST_DEVICE,
        dtype=torch.float32,
        block_size=4,
        num_blocks=BLOCKS,
        linear_layout="native",
    )


@pytest.fixture
def engine(model_dirs: tuple[Path, Path]) -> Engine:
    main, lm = model_dirs
    return Engine(
        runner(main),
        AutoTokenizer.from_pretrained(main),
        max_num_seqs=32,
        max_num_batched_tokens=16,  # prompts split over steps: the companion follows
        companions=Companions({"lm": runner(lm)}),
    )


@pytest.fixture(scope="module")
def hf_models(model_dirs: tuple[Path, Path]) -> tuple[torch.nn.Module, torch.nn.Module]:
    return tuple(  # type: ignore[return-value]
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in model_dirs
    )


class FusedScores(LogitsProcessor):
    """fairseq's LM fusion as a generate() processor: the scores' log_softmax (a no-op on beam
    search's log-probs) plus `weight` times the LM's log-probs after the same tokens; with
    `plausibility`, tokens below that times the best main-model probability are banned."""

    def __init__(self, lm: torch.nn.Module, weight: float, plausibility: float = 0.0) -> None:
        self.lm, self.weight, self.plausibility = lm, weight, plausibility

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        lm = self.lm(input_ids).logits[:, -1, :].float().log_softmax(dim=-1)
        main = scores.log_softmax(dim=-1)
        fused = main + self.weight * lm
        if self.plausibility:
            floor = main.max(dim=-1, keepdim=True).values + torch.tensor(self.plausibility).log()
            fused = fused.masked_fill(main < floor, float("-inf"))
        return fused


def reference(
    hf: tuple[torch.nn.Module, torch.nn.Module], prompt: list[int], fusion: LMFusion, **kw: object
) -> list[list[int]]:
    main, lm = hf
    ids = torch.tensor([prompt])
    out = main.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        logits_processor=LogitsProcessorList([FusedScores(lm, fusion.weight)]),
        do_sample=False,
        pad_token_id=0,
        **kw,
    )
    eos = main.generation_config.eos_token_id
    rows = out[:, len(prompt) :].tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


def run(engine: Engine, prompt: list[int], params: DecodingParams) -> list[list[int]]:
    got = submit(engine, "r", prompt, params)
    run_to_completion(engine)
    return [tokens for _, tokens, _ in got.choices().values()]


@pytest.mark.parametrize("weight", [0.5, 1.0, -0.3])
def test_fused_greedy_matches_generate(engine: Engine, hf_models, weight: float) -> None:
    fusion = LMFusion("lm", weight)
    changed = 0
    for prompt in PROMPTS:
        params = DecodingParams(max_tokens=12, temperature=0.0, lm_fusion=fusion)
        fused = run(engine, prompt, params)
        assert fused == reference(hf_models, prompt, fusion, max_new_tokens=12)
        changed += fused != run(engine, prompt, DecodingParams(max_tokens=12, temperature=0.0))
    assert changed  # the companion changed what greedy chose
    assert engine.pool.num_free == engine.pool.num_blocks  # the companion's ids are the pool's


@pytest.mark.parametrize(("num_beams", "length_penalty"), [(2, 1.0), (3, 0.6), (4, 1.5)])
def test_fused_beam_search_matches_generate(
    engine: Engine, hf_models, num_beams: int, length_penalty: float
) -> None:
    """Beam scores accumulate the fused scores unnormalised, as fairseq's do."""
    fusion = LMFusion("lm", 0.7)
    for prompt in PROMPTS[:2]:
        params = DecodingParams(
            max_tokens=8,
            num_beams=num_beams,
            n=num_beams,
            length_penalty=length_penalty,
            lm_fusion=fusion,
        )
        expected = reference(
            hf_models,
            prompt,
            fusion,
            max_new_tokens=8,
            num_beams=num_beams,
            num_return_sequences=num_beams,
            length_penalty=length_penalty,
        )
        assert run(engine, prompt, params) == expected
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize(
    "beams",
    [
        dict(num_beams=3, n=3, do_sample=True, temperature=0.8, top_k=20, seed=5),
        dict(num_beams=4, n=4, num_beam_groups=2, diversity_penalty=0.8, length_penalty=0.7),
    ],
    ids=["beam_sample", "group_beam"],
)
def test_fused_beam_sampling_and_group_beams_match_the_beam_library(
    engine: Engine, hf_models, beams: dict
) -> None:
    """The reference is decoding/'s own beam state machine (exact against transformers 4.55's
    beam sampling and group beam search: test_decoding_hf455.py) driven as the engine drives it,
    by a model that returns fairseq's fused scores: the engine hands a fused request's beams
    those scores as its log-probs, unnormalised, with the same seeded draws."""
    main, lm = hf_models
    fusion = LMFusion("lm", 0.6)
    params = DecodingParams(max_tokens=8, lm_fusion=fusion, **beams)

    @torch.no_grad()
    def fused(history: list[int]) -> torch.Tensor:
        x = torch.tensor([history])
        return FusedScores(lm, fusion.weight)(x, main(x).logits[:, -1, :].float())[0]

    for prompt in PROMPTS[:2]:
        room = engine.max_model_len - len(prompt)
        search = make_beam_search(params, engine.eos_token_ids, max_new_tokens=room)
        hyps, _ = drive(search, fused, params, prompt, eos_ids=engine.eos_token_ids)
        assert run(engine, prompt, params) == [h.token_ids for h in hyps]
    assert engine.pool.num_free == engine.pool.num_blocks


def test_fused_sampling_draws_from_the_fused_warped_distribution(engine: Engine, hf_models) -> None:
    """A seeded fused request repeats itself, and every token it drew lies in the support of
    generate()'s fused, then warped scores after the same prefix (temperature, top-k): the
    processor first, as the engine fuses before it processes anything."""
    main, lm = hf_models
    fusion = LMFusion("lm", 0.8)
    params = DecodingParams(max_tokens=10, temperature=0.7, top_k=5, seed=3, lm_fusion=fusion)
    prompt = PROMPTS[0]
    first, again = run(engine, prompt, params)[0], run(engine, prompt, params)[0]
    assert first == again
    processors = LogitsProcessorList(
        [FusedScores(lm, 0.8), TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]
    )
    plain = run(engine, prompt, DecodingParams(max_tokens=10, temperature=0.7, top_k=5, seed=3))
    assert plain[0] != first  # the companion changed what was drawn
    with torch.no_grad():
        for i, token in enumerate(first):
            ids = torch.tensor([prompt + first[:i]])
            scores = processors(ids, main(ids).logits[:, -1, :])
            assert torch.isfinite(scores[0, token]), f"token {i} outside the fused top-k"


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.8, repetition_penalty=1.2)],
    ids=["top_k", "top_p_penalty"],
)
def test_seeded_fused_sampling_is_token_exact_against_a_reference_loop(
    engine: Engine, hf_models, sampling: dict
) -> None:
    """A reference loop over the two transformers models: fairseq's fused scores, then decoding/'s
    processing (equal to generate()'s processors and warpers: test_decoding_hf_parity.py) and its
    inverse-CDF draw with the request's own random stream: the engine's tokens, one for one."""
    main, lm = hf_models
    fusion = LMFusion("lm", 0.8)
    params = DecodingParams(max_tokens=12, seed=11, lm_fusion=fusion, **sampling)
    for prompt in PROMPTS:
        out: list[int] = []
        with torch.no_grad():
            for _ in range(params.max_tokens):
                ids = torch.tensor([prompt + out])
                fused = FusedScores(lm, fusion.weight)(ids, main(ids).logits[:, -1, :].float())
                t = SamplingTensors.from_rows(
                    [params], [prompt], [out], engine.eos_token_ids, fused.shape[-1], "cpu"
                )
                streams = RandomStreams.of([stream_key(params.seed)], [len(out)], "cpu")
                out.append(int(choose_tokens(process_logits(fused, t), t, streams)[0]))
                if out[-1] in engine.eos_token_ids:
                    break
        assert run(engine, prompt, params) == [out]


def test_contrastive_decoding_matches_a_reference_loop(engine: Engine, hf_models) -> None:
    """weight -1 with plausibility 0.1: expert minus amateur among the expert's plausible tokens
    (Li et al., 2023), greedy."""
    main, lm = hf_models
    fusion = LMFusion("lm", -1.0, plausibility=0.1)
    for prompt in PROMPTS:
        ids = list(prompt)
        step = FusedScores(lm, -1.0, plausibility=0.1)
        with torch.no_grad():
            for _ in range(10):
                x = torch.tensor([ids])
                ids.append(int(step(x, main(x).logits[:, -1, :]).argmax()))
        params = DecodingParams(max_tokens=10, temperature=0.0, ignore_eos=True, lm_fusion=fusion)
        assert run(engine, prompt, params) == [ids[len(prompt) :]]


def test_fused_rows_mixed_with_plain_ones_equal_their_solo_runs(engine: Engine) -> None:
    """Plain, fused (two weights), fused beams, plain beams, a fused row with an allow-list and
    n fused samples in one busy batch: each equals its own run alone; every block comes back."""
    allowed = tuple(range(0, 400, 3))
    cases = [
        DecodingParams(max_tokens=9, temperature=0.0),
        DecodingParams(max_tokens=9, temperature=0.0, lm_fusion=LMFusion("lm", 0.5)),
        DecodingParams(max_tokens=7, temperature=0.0, lm_fusion=LMFusion("lm", 2.0)),
        DecodingParams(max_tokens=6, num_beams=3, n=2, lm_fusion=LMFusion("lm", 0.6)),
        DecodingParams(max_tokens=6, num_beams=2),
        DecodingParams(
            max_tokens=8, temperature=0.0, allowed_token_ids=allowed, lm_fusion=LMFusion("lm", 1)
        ),
        DecodingParams(max_tokens=8, n=3, seed=5, lm_fusion=LMFusion("lm", 0.4, 0.05)),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))]
    solo = [run(engine, p, params) for p, params in zip(prompts, cases)]
    together = [submit(engine, str(i), p, c) for i, (p, c) in enumerate(zip(prompts, cases))]
    run_to_completion(engine)
    assert [[t for _, t, _ in got.choices().values()] for got in together] == solo
    assert all(t in allowed for t in solo[5][0])
    assert engine.pool.num_free == engine.pool.num_blocks


def test_an_unknown_companion_fails_its_request_alone(engine: Engine) -> None:
    bad = submit(engine, "bad", PROMPTS[0], DecodingParams(lm_fusion=LMFusion("nope", 1.0)))
    good = submit(engine, "good", PROMPTS[0], DecodingParams(max_tokens=4, temperature=0.0))
    run_to_completion(engine)
    assert bad.finish_reason == "error" and "'nope' is not loaded" in bad.outputs[-1].error
    assert good.finish_reason == "length" and len(good.token_ids) == 4


# ---- a translation model with a target-side LM (fairseq's use) -----------------------------------
TARGET_LMS = {  # RoPE positions (shift-invariant), and learned absolute ones
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    ),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128),
}


@pytest.fixture(scope="module")
def marian_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Marian and tiny random target-side LMs over its vocabulary."""
    root = tmp_path_factory.mktemp("fusion_marian")
    dirs = {"marian": build_tiny_seq2seq(root / "marian", "marian")}
    vocab = AutoConfig.from_pretrained(dirs["marian"]).vocab_size
    for arch, shape in TARGET_LMS.items():
        config = AutoConfig.for_model(
            arch,
            vocab_size=vocab,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=True,
            **shape,
        )
        torch.manual_seed(2)
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in lm.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.3)
        lm.save_pretrained(root / arch)
        dirs[arch] = root / arch
    return dirs


@pytest.mark.parametrize("arch", sorted(TARGET_LMS))
@pytest.mark.parametrize(("num_beams", "weight"), [(1, 0.8), (3, 0.6), (4, -0.4)])
def test_a_translation_model_fuses_its_target_lm_as_generate(
    marian_dirs: dict[str, Path], arch: str, num_beams: int, weight: float
) -> None:
    """The LM reads what generate() feeds the decoder (its start token, then the output) and
    runs on the translation model's block ids, its positions counted from the decoder's start."""
    marian, lm_dir = marian_dirs["marian"], marian_dirs[arch]
    options: dict = dict(device=TEST_DEVICE, dtype=torch.float32, block_size=4, num_blocks=256)
    main = Seq2SeqRunner(marian, **options)
    tokenizer = AutoTokenizer.from_pretrained(marian)
    engine = Engine(
        main,
        tokenizer,
        max_num_batched_tokens=16,  # sources split over steps: the LM skips their positions
        companions=Companions({"lm": TargetLM(lm_dir, linear_layout="native", **options)}),
    )
    source_model = SourceModel.read(marian, tokenizer)
    assert source_model is not None
    model = AutoModelForSeq2SeqLM.from_pretrained(marian).eval()
    lm = AutoModelForCausalLM.from_pretrained(lm_dir).eval()
    texts = ["The quick brown fox jumps over the lazy dog.", "Hello world!", "Beam search"]
    fusion = LMFusion("lm", weight)
    params = DecodingParams(
        max_tokens=8, temperature=0, num_beams=num_beams, n=num_beams, lm_fusion=fusion
    )
    sources = [tokenizer(text).input_ids for text in texts]
    got = [
        submit(engine, str(i), source_model.job_prompt(s), params, source_len=len(s))
        for i, s in enumerate(sources)
    ]
    run_to_completion(engine)
    eos = model.generation_config.eos_token_id
    for source, result in zip(sources, got):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([source]),
                do_sample=False,
                max_new_tokens=8,
                num_beams=num_beams,
                num_return_sequences=num_beams,
                logits_processor=LogitsProcessorList([FusedScores(lm, weight)]),
            )
        expected = [r[1:] for r in out.tolist()]
        expected = [r[: r.index(eos) + 1] if eos in r else r for r in expected]
        assert [tokens for _, tokens, _ in result.choices().values()] == expected
    assert engine.pool.num_free == engine.pool.num_blocks


def test_fuse_logits_adds_weighted_log_probs_and_bans_implausible_tokens() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -3.0], [0.0, 0.0, 0.0, 0.0]])
    lm = torch.tensor([[0.0, 3.0, 0.0, 0.0]])
    out = fuse_logits_(
        logits.clone(), torch.tensor([0]), lm, torch.tensor([[-1.0]]), torch.tensor([[0.3]])
    )
    main = logits[0].log_softmax(-1)
    expected = main - lm[0].log_softmax(-1)
    keep = main.exp() >= 0.3 * main.exp().max()
    assert keep.tolist() == [True, True, False, False]
    torch.testing.assert_close(out[0], expected.masked_fill(~keep, float("-inf")))
    assert torch.equal(out[1], logits[1])  # other rows as they were


def test_plan_rows_keeps_the_rows_tokens_and_edits() -> None:
    plan = StepPlan(
        row_ids=[10, 11, 12],
        starts=[0, 5, 3],
        num_new=[3, 1, 2],
        num_drafts=[0, 0, 0],
        samples=[False, True, True],
        tokens=[1, 2, 3, 4, 5, 6],
        table_edits=[TableEdit(0, 0, [7]), TableEdit(2, 0, [8, 9])],
        released=[4],
        copies=[(1, 2)],
    )
    part = plan_rows(plan, [0, 2])
    assert (part.row_ids, part.tokens, part.samples) == ([10, 12], [1, 2, 3, 5, 6], [False, True])
    assert part.table_edits == [TableEdit(0, 0, [7]), TableEdit(1, 0, [8, 9])]
    assert (part.released, part.copies) == ([4], [(1, 2)])

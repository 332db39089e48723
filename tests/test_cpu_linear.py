"""The CPU weight layouts (oneDNN-packed, transposed, measured per row count) compute what
nn.Linear does; the runner takes the one asked for, and under auto the one timed faster."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from server.model import cpu_linear
from server.model.cpu_linear import (
    ROW_BUCKETS,
    MeasuredLayoutLinear,
    OneDNNLinear,
    TransposedLinear,
    apply_linear_layout,
    onednn_is_faster,
    row_bucket,
    transpose_linears,
)
from server.model.int8_products import onednn_int8_works
from server.model.runner import ModelRunner
from tests.conftest import make_engine


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(3, 7), (1, 5, 7), (2, 4, 7)])
def test_transposed_linear_matches_nn_linear(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(7, 11, bias=bias)
    x = torch.randn(*shape)
    fast = TransposedLinear.from_linear(linear)
    assert fast.weight_t.shape == (7, 11) and fast.weight_t.is_contiguous()
    torch.testing.assert_close(fast(x), linear(x), atol=1e-6, rtol=1e-6)
    assert fast(x).shape == (*shape[:-1], 11)


def test_transpose_linears_replaces_every_linear_and_nothing_else() -> None:
    model = nn.Sequential(
        nn.Linear(4, 8), nn.GELU(), nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    )
    x = torch.randn(2, 4)
    expected = model(x)
    assert transpose_linears(model) == 2
    assert [type(m) for m in model.modules()].count(nn.Linear) == 0
    assert isinstance(model[1], nn.GELU) and isinstance(model[2][1], nn.LayerNorm)
    torch.testing.assert_close(model(x), expected, atol=1e-6, rtol=1e-6)


def runner_with(llama_dir: Path, layout: str, **kwargs: object) -> ModelRunner:
    return ModelRunner(
        llama_dir,
        device=torch.device("cpu"),
        dtype=kwargs.pop("dtype", torch.float32),  # type: ignore[arg-type]
        block_size=4,
        num_blocks=64,
        linear_layout=layout,
        **kwargs,  # type: ignore[arg-type]
    )


def test_cpu_runner_runs_transposed_linears_and_a_head_in_both_layouts(llama_dir: Path) -> None:
    runner = runner_with(llama_dir, "measured")
    linears = [m for m in runner.decoder.modules() if isinstance(m, nn.Linear)]
    assert linears == []
    head = runner.lm_head
    assert isinstance(head, MeasuredLayoutLinear)
    assert head.transposed_buckets <= set(ROW_BUCKETS)  # timed at start-up
    # Tied model: the native layout is the embedding table itself, the transpose a copy.
    embedding = runner.model.get_input_embeddings().weight
    assert head.weight.data_ptr() == embedding.data_ptr()
    assert head.weight_t.data_ptr() != embedding.data_ptr()
    torch.testing.assert_close(head.weight_t.t(), embedding)


@pytest.mark.parametrize("bias", [False, True])
def test_measured_layout_linear_uses_the_layout_chosen_for_each_row_count(bias: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(7, 11, bias=bias)
    head = MeasuredLayoutLinear(linear, transposed_buckets=frozenset({1, 16}))
    calls: list[str] = []
    native, transposed = head._native, head._transposed
    head._native = lambda x: calls.append("native") or native(x)  # type: ignore[method-assign]
    head._transposed = lambda x: calls.append("t") or transposed(x)  # type: ignore[method-assign]
    for rows in (1, 3, 4, 15, 16, 63, 64, 200):
        x = torch.randn(rows, 7)
        torch.testing.assert_close(head(x), linear(x), atol=1e-6, rtol=1e-6)
    # buckets: 1 -> 1, 3 -> 1, 4 -> 4, 15 -> 4, 16 -> 16, 63 -> 16, 64 -> 64, 200 -> 64
    assert calls == ["t", "t", "native", "native", "t", "t", "native", "native"]
    assert [row_bucket(r) for r in (1, 2, 4, 5, 16, 17, 64, 1000)] == [1, 1, 4, 4, 16, 16, 64, 64]
    assert head(torch.randn(2, 5, 7)).shape == (2, 5, 11)


def test_measuring_the_layouts_times_each_bucket_and_keeps_clear_wins_only() -> None:
    head = MeasuredLayoutLinear(nn.Linear(8, 16), transposed_buckets=frozenset())
    assert head.measure(margin=0.0) == frozenset()  # nothing is 0x the native time
    assert head.measure(margin=1e9) == frozenset(ROW_BUCKETS)  # everything is under 1e9x


def test_native_layout_keeps_nn_linear_and_gives_the_same_tokens(llama_dir: Path) -> None:
    from decoding import DecodingParams
    from server.engine.engine import Engine
    from server.model.runner import ModelRunner
    from tests.engine_driver import generate

    fast = make_engine(llama_dir)
    runner = ModelRunner(
        llama_dir,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=4,
        num_blocks=256,
        linear_layout="native",
    )
    assert any(isinstance(m, nn.Linear) for m in runner.decoder.modules())
    assert not any(isinstance(m, TransposedLinear) for m in runner.decoder.modules())
    native = Engine(runner, fast.tokenizer)
    prompts = [fast.tokenizer(p).input_ids for p in ("The quick brown fox", "Once upon a time")]
    params = DecodingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert [r.token_ids for r in generate(fast, prompts, params)] == [
        r.token_ids for r in generate(native, prompts, params)
    ]
    with pytest.raises(ValueError, match="linear_layout"):
        ModelRunner(
            llama_dir,
            device=torch.device("cpu"),
            dtype=torch.float32,
            block_size=4,
            num_blocks=8,
            linear_layout="sideways",
        )


def test_onednn_linear_equals_nn_linear_at_any_row_count() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    packed = OneDNNLinear.from_linear(linear)
    with torch.inference_mode():
        assert packed(torch.randn(0, 64)).shape == (0, 48)
        for shape in ((1, 64), (5, 64), (2, 7, 64)):
            x = torch.randn(*shape)
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_onednn_layout_packs_every_linear_and_gives_the_native_tokens(llama_dir: Path) -> None:
    from decoding import DecodingParams
    from server.engine.engine import Engine
    from tests.engine_driver import generate

    tokenizer = make_engine(llama_dir).tokenizer
    engines = [Engine(runner_with(llama_dir, layout), tokenizer) for layout in ("onednn", "native")]
    packed = engines[0].runner
    assert packed.linear_layout == "onednn" and isinstance(packed.lm_head, OneDNNLinear)
    assert not any(type(m) is nn.Linear for m in packed.decoder.modules())
    assert any(isinstance(m, OneDNNLinear) for m in packed.decoder.modules())
    prompts = [tokenizer(p).input_ids for p in ("The quick brown fox", "Once upon a time")]
    params = DecodingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens = [[r.token_ids for r in generate(e, prompts, params)] for e in engines]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("faster", [True, False])
def test_auto_takes_onednn_only_where_it_was_timed_faster(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, faster: bool
) -> None:
    timed: list[int] = []

    def timing(linear: nn.Linear, onednn: OneDNNLinear) -> bool:
        timed.append(linear.out_features)
        return faster

    monkeypatch.setattr(cpu_linear, "onednn_is_faster", timing)
    runner = runner_with(llama_dir, "auto")
    assert timed == [runner.vocab_size]  # timed on the LM head
    assert runner.linear_layout == ("onednn" if faster else "measured")
    head_type = OneDNNLinear if faster else MeasuredLayoutLinear
    assert isinstance(runner.lm_head, head_type)
    # compiled decoders and float16 never take oneDNN under auto; asked for, they are refused
    assert runner_with(llama_dir, "auto", compile_decode=True).linear_layout == "measured"
    assert runner_with(llama_dir, "auto", dtype=torch.float16).linear_layout == "measured"
    with pytest.raises(ValueError, match="does not compile"):
        runner_with(llama_dir, "onednn", compile_decode=True)
    with pytest.raises(ValueError, match="float16"):
        runner_with(llama_dir, "onednn", dtype=torch.float16)


def test_the_timing_compares_onednn_with_both_plain_layouts() -> None:
    linear = nn.Linear(32, 64)
    assert isinstance(onednn_is_faster(linear, OneDNNLinear.from_linear(linear)), bool)
    with pytest.raises(ValueError, match="for the CPU"):
        apply_linear_layout(nn.Sequential(), linear, "onednn", torch.device("cuda"))
    assert apply_linear_layout(nn.Sequential(), linear, "auto", torch.device("cuda")) == (
        linear,
        "native",
    )


def test_the_layout_benchmark_times_every_layout(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import linear_layouts

    table = linear_layouts.time_layouts(64, 32, [1, 4], repeats=1)
    int8 = {"int8 head, top 64 re-scored", "int8 GEMM, fbgemm", "torch._int_mm, per-token"}
    if onednn_int8_works():  # not where oneDNN's int8 sums saturate (no VNNI)
        int8.add("int8 GEMM, oneDNN")
    plain = {"MKL native (nn.Linear)", "MKL transposed", "oneDNN prepacked"}
    assert set(table) - {"oneDNN prepacked bf16"} == plain | int8
    assert all(len(t) == 2 and min(t) > 0 for t in table.values())
    assert (
        linear_layouts.main(["--out-features", "64", "--in-features", "32", "--rows", "1,2"]) == 0
    )
    assert "oneDNN speed-up" in capsys.readouterr().out

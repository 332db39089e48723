"""The CPU weight layout: transposed linears compute what nn.Linear does; the runner uses them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from server.model.cpu_linear import TransposedLinear, transpose_linears
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


def test_cpu_runner_runs_transposed_linears_with_an_untied_head(llama_dir: Path) -> None:
    engine = make_engine(llama_dir)
    runner = engine.runner
    linears = [m for m in runner.decoder.modules() if isinstance(m, nn.Linear)]
    assert linears == []
    assert isinstance(runner.lm_head, TransposedLinear)
    # Tied model: the embedding keeps its own [vocab, hidden] table, the head holds the transpose.
    embedding = runner.model.get_input_embeddings().weight
    assert runner.lm_head.weight_t.data_ptr() != embedding.data_ptr()
    torch.testing.assert_close(runner.lm_head.weight_t.t(), embedding)


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

"""Decode steps padded to bucketed shapes (what CUDA graphs replay). The graphs themselves need a
GPU; the padding is device-independent and runs here on the CPU, where it must change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decoding import DecodingParams
from server.engine.engine import Engine
from server.model.attention import DecodeStep
from server.model.runner import ModelRunner, shape_bucket
from tests.conftest import make_engine
from tests.engine_driver import generate
from tests.test_engine_correctness import PROMPTS, hf_greedy
from tests.test_torch_compile import served_config


def test_shape_buckets_are_powers_of_two_above_a_floor() -> None:
    assert [shape_bucket(n, 1) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert shape_bucket(3, 64) == 64 and shape_bucket(64, 64) == 64 and shape_bucket(65, 64) == 128


def test_padding_rows_write_only_the_scratch_block_and_see_only_their_own_slot() -> None:
    step = DecodeStep.build(
        [[7, 2], [5]],
        [6, 2],
        block_size=4,
        device=torch.device("cpu"),
        rows=4,
        width=12,
        scratch_block=9,
    )
    assert step.gather.shape == (4, 12)
    assert step.slot_mapping.tolist() == [9, 21, 36, 36]  # real rows as before; padding -> block 9
    assert step.lengths.flatten().tolist() == [6, 2, 1, 1]
    visible = step.mask(None)[:, 0, 0]
    assert visible.sum(dim=1).tolist() == [6, 2, 1, 1]
    assert step.gather[2:, 0].tolist() == [
        36,
        36,
    ]  # the one visible key of a padding row is its own
    with pytest.raises(ValueError, match="scratch block"):
        DecodeStep.build([[1]], [2], block_size=4, device=torch.device("cpu"), rows=2)


def padded_engine(model_dir: Path) -> Engine:
    runner = ModelRunner(
        model_dir,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=4,
        num_blocks=256,
        cuda_graphs=True,
    )
    return Engine(runner, make_engine(model_dir).tokenizer, max_num_batched_tokens=16)


def test_padded_decode_steps_give_hf_greedy_tokens_and_free_every_block(
    tiny_model_dirs: dict[str, Path],
) -> None:
    model_dir = tiny_model_dirs["gemma3"]  # sliding-window and full layers
    expected = [hf_greedy(model_dir, p, 20) for p in PROMPTS[:5]]
    engine = padded_engine(model_dir)
    runner = engine.runner
    assert runner.scratch_block == runner.num_blocks == engine.pool.num_blocks  # outside the pool
    assert runner.kv_cache.keys[0].shape[0] == (runner.num_blocks + 1) * 4
    shapes: list[tuple[int, int]] = []
    run_decode = runner._run_decode

    def recorded(
        input_ids: torch.Tensor, position_ids: torch.Tensor, ctx: DecodeStep
    ) -> torch.Tensor:
        shapes.append(tuple(ctx.gather.shape))
        return run_decode(input_ids, position_ids, ctx)

    runner._run_decode = recorded
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[:5]]
    params = DecodingParams(max_tokens=20, temperature=0)
    got = [r.token_ids for r in generate(engine, prompts, params)]
    assert got == expected
    assert any(
        rows == 8 for rows, _ in shapes
    )  # 5 rows padded to 8 (3 rows write the scratch block)
    # widths: a power of two of at least 4 blocks
    assert all(
        rows & (rows - 1) == 0 and width & (width - 1) == 0 and width >= 16
        for rows, width in shapes
    )
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize(("argv", "expected"), [([], True), (["--no-cuda-graphs"], False)])
def test_cuda_graphs_flag_reaches_the_config(
    argv: list[str], expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert served_config(["--torch-compile", *argv], monkeypatch).cuda_graphs is expected

"""CUDA graphs of decode steps (server/model/cuda_graphs.py): one per row bucket, captured at
start-up, replayed over static buffers. The capture needs a GPU; everything else (the buckets,
the buffers, the padding rows and their scratch block, the runner's choice of path, the tokens)
runs here on the CPU, where `EagerGraph` re-runs the captured function and the paged kernel runs
under Triton's interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from decoding import DecodingParams
from server.engine.engine import Engine
from server.engine.request import Sequence
from server.model.cuda_graphs import row_buckets
from server.model.kv_budget import KVBudget
from server.model.runner import ModelRunner
from server.work import WorkItem
from tests.conftest import TEST_DEVICE
from tests.engine_driver import generate, stub_rows
from tests.test_engine_correctness import PROMPTS, hf_greedy
from tests.test_host_syncs import ReadCounter
from tests.test_torch_compile import served_config

MAX_ROWS = 8


def test_row_buckets_double_up_to_the_largest_batch() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(5) == [1, 2, 4, 5]
    assert row_buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def graph_runner(
    model_dir: Path, cuda_graphs: bool = True, *, capture: bool = True, backend: str = "triton"
) -> ModelRunner:
    runner = ModelRunner(
        model_dir,
        device=TEST_DEVICE,
        dtype=torch.float32,
        block_size=4,
        num_blocks=128,
        kv_budget=KVBudget(max_num_seqs=MAX_ROWS, max_model_len=96),
        attention_backend=backend,
        cuda_graphs=cuda_graphs,
    )
    if capture:
        runner.warm_up()  # captures (as the engine thread does at start-up)
    return runner


def test_decode_steps_replay_the_graphs_and_give_hf_greedy_tokens(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """Gemma 3 (sliding-window and global layers, softcap): 5 rows replay the 8-row graph (3
    padding rows), prefill steps run eagerly, every block comes back."""
    model_dir = tiny_model_dirs["gemma3"]
    expected = [hf_greedy(model_dir, p, 16) for p in PROMPTS[:5]]
    runner = graph_runner(model_dir)
    graphs = runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    assert graphs.max_blocks == 96 // 4  # max_model_len / block_size: a fixed table width
    assert runner.kv_cache.keys[0].shape[0] == (runner.num_blocks + 1) * 4  # + the scratch block
    replays: list[int] = []
    for rows, (graph, _) in graphs.graphs.items():
        replay = graph.replay
        graph.replay = lambda rows=rows, replay=replay: (replays.append(rows), replay())[1]  # type: ignore[method-assign]
    engine = Engine(runner, AutoTokenizer.from_pretrained(model_dir), max_num_batched_tokens=32)
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[:5]]
    got = generate(engine, prompts, DecodingParams(max_tokens=16, temperature=0.0))
    assert [r.token_ids for r in got] == expected
    assert 8 in replays and len(replays) >= 15  # 5 rows -> the 8-row graph, every decode step
    assert engine.pool.num_free == engine.pool.num_blocks


def test_padding_rows_write_only_the_scratch_block(tiny_model_dirs: dict[str, Path]) -> None:
    runner = graph_runner(tiny_model_dirs["llama"])
    graphs = runner.graphs
    assert graphs is not None
    keys = runner.kv_cache.keys[0]
    before = keys.clone()
    tables, tokens, positions = [[3, 4], [7], [9]], [11, 12, 13], [5, 2, 0]
    with torch.inference_mode():  # as in ModelRunner.execute
        logits = graphs.run(tables, tokens, positions).clone()
    assert logits.shape == (3, runner.vocab_size)
    changed = (keys != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    scratch = runner.num_blocks * 4
    assert changed == sorted([4 * 4 + 1, 7 * 4 + 2, 9 * 4, scratch])  # 3 rows + 1 padding slot
    eager = runner._execute_packed  # the same rows through the packed kernel path
    rows = []
    for table, token, pos in zip(tables, tokens, positions):
        row = stub_rows([token] * (pos + 1)).rows[0]
        row.block_table, row.num_computed = table, pos
        rows.append(WorkItem(row, 1))
    with torch.inference_mode():
        torch.testing.assert_close(eager(rows).logits, logits)


def test_the_captured_forward_never_reads_the_device(tiny_model_dirs: dict[str, Path]) -> None:
    """A read (`.item()`, `.tolist()`, a data-dependent shape) inside a CUDA graph capture is an
    error on a GPU: the decode forward the graphs capture must have none."""
    runner = graph_runner(tiny_model_dirs["gemma3"])
    graphs = runner.graphs
    assert graphs is not None
    counter = ReadCounter()
    with counter, torch.inference_mode():
        graphs._bound(4)()
    assert not counter.reads, dict(counter.reads)


def test_steps_beyond_the_graphs_run_eagerly(tiny_model_dirs: dict[str, Path]) -> None:
    runner = graph_runner(tiny_model_dirs["llama"])
    graphs = runner.graphs
    assert graphs is not None
    rows = [stub_row(i) for i in range(MAX_ROWS + 1)]
    assert graphs.fits(rows[:MAX_ROWS]) and not graphs.fits(rows)
    wide = stub_row(0)
    wide.block_table = list(range(graphs.max_blocks + 1))
    assert not graphs.fits([wide])


def stub_row(i: int) -> Sequence:
    row = stub_rows([5, 6]).rows[0]
    row.block_table = [i]
    return row


def test_a_runner_whose_graphs_were_not_captured_runs_eagerly(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """Benchmarks and tests build runners without the engine thread's warm-up."""
    runner = graph_runner(tiny_model_dirs["llama"], capture=False)
    assert runner.graphs is not None and not runner.graphs.fits([stub_row(0)])
    engine = Engine(runner, AutoTokenizer.from_pretrained(tiny_model_dirs["llama"]))
    got = generate(engine, [[5, 6, 7]], DecodingParams(max_tokens=4, temperature=0.0))
    assert len(got[0].token_ids) == 4


def test_graphs_need_the_paged_kernel(tiny_model_dirs: dict[str, Path]) -> None:
    runner = graph_runner(tiny_model_dirs["llama"], capture=False, backend="gather")
    assert runner.graphs is None and not runner.cuda_graphs


@pytest.mark.parametrize(("argv", "expected"), [([], True), (["--no-cuda-graphs"], False)])
def test_cuda_graphs_flag_reaches_the_config(
    argv: list[str], expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert served_config(argv, monkeypatch).cuda_graphs is expected


def test_graphs_with_overlapped_outputs_give_the_same_streams(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """The CUDA defaults together (paged kernel, graphs, overlapped outputs, async scheduling:
    the graphs read their input tokens from the device), mid-generation stop strings included:
    every stream equals the plain engine's, every block comes back."""
    model_dir = tiny_model_dirs["llama"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(p).input_ids for p in PROMPTS[:4]]
    plain = Engine(graph_runner(model_dir, cuda_graphs=False), tokenizer)
    free = generate(plain, prompts, DecodingParams(max_tokens=16, temperature=0.0))
    stops = [(r.text[len(r.text) // 2 : len(r.text) // 2 + 2],) for r in free]
    runs = []
    for graphs, overlap in ((False, False), (True, True)):
        engine = Engine(
            graph_runner(model_dir, cuda_graphs=graphs),
            tokenizer,
            overlap_outputs=overlap,
            async_scheduling=overlap,
        )
        got = [
            generate(engine, [p], DecodingParams(max_tokens=16, temperature=0.0, stop=stop))[0]
            for p, stop in zip(prompts, stops)
        ]
        got += generate(engine, prompts, DecodingParams(max_tokens=12, temperature=0.0))
        runs.append([r.choices() for r in got])
        assert engine.pool.num_free == engine.pool.num_blocks
    assert runs[0] == runs[1]
    assert sum(choice[2] == "stop" for run in runs[1] for choice in run.values()) >= 2

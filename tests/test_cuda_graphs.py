"""CUDA graphs of decode steps (server/model/cuda_graphs.py): one per row bucket, captured at
start-up, replayed over static buffers. The capture needs a GPU; everything else (the buckets,
the buffers, the padding rows and their scratch block, the runner's choice of path, the tokens)
runs here on the CPU, where `EagerGraph` re-runs the captured function and the paged kernel runs
under Triton's interpreter."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from decoding import DecodingParams
from server.engine import sampling_step
from server.engine.engine import Engine
from server.model.cuda_graphs import row_buckets
from server.model.kv_budget import KVBudget
from server.model.runner import ModelRunner
from server.step_plan import StepPlan
from tests.conftest import TEST_DEVICE
from tests.engine_driver import generate, run_to_completion, submit
from tests.lora_adapters import make_adapter, merged_model
from tests.test_engine_correctness import PROMPTS, hf_greedy
from tests.test_host_syncs import CopyCounter, ReadCounter
from tests.test_torch_compile import served_config

MAX_ROWS = 8


def test_row_buckets_double_up_to_the_largest_batch() -> None:
    assert row_buckets(1) == [1]
    assert row_buckets(5) == [1, 2, 4, 5]
    assert row_buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def graph_runner(
    model_dir: Path,
    cuda_graphs: bool = True,
    *,
    capture: bool = True,
    backend: str = "triton",
    max_loras: int = 0,
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
        max_loras=max_loras,
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
    scratch = runner.num_blocks * 4
    # the capture wrote the scratch block already, with values the padding row may write again
    # bit for bit: a sentinel there makes its write visible
    keys[scratch : scratch + 4] = 123.0
    before = keys.clone()
    tables, tokens, positions = [[3, 4], [7], [9]], [11, 12, 13], [5, 2, 0]
    with torch.inference_mode():  # as in ModelRunner.execute
        logits = graphs.run(tables, tokens, positions).clone()
    assert logits.shape == (3, runner.vocab_size)
    changed = (keys != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert changed == sorted([4 * 4 + 1, 7 * 4 + 2, 9 * 4, scratch])  # 3 rows + 1 padding slot
    # the same rows through the packed kernel path
    plan = StepPlan(
        row_ids=[0, 1, 2],
        starts=positions,
        num_new=[1, 1, 1],
        num_drafts=[0, 0, 0],
        samples=[True] * 3,
        tokens=tokens,
    )
    with torch.inference_mode():
        torch.testing.assert_close(runner._execute_packed(plan, tables).logits, logits)


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
    tables = [[i] for i in range(MAX_ROWS + 1)]
    assert graphs.fits(tables[:MAX_ROWS]) and not graphs.fits(tables)
    assert not graphs.fits([list(range(graphs.max_blocks + 1))])


def test_a_runner_whose_graphs_were_not_captured_runs_eagerly(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """Benchmarks and tests build runners without the engine thread's warm-up."""
    runner = graph_runner(tiny_model_dirs["llama"], capture=False)
    assert runner.graphs is not None and not runner.graphs.fits([[0]])
    engine = Engine(runner, AutoTokenizer.from_pretrained(tiny_model_dirs["llama"]))
    got = generate(engine, [[5, 6, 7]], DecodingParams(max_tokens=4, temperature=0.0))
    assert len(got[0].token_ids) == 4


def test_graphs_need_the_paged_kernel(tiny_model_dirs: dict[str, Path]) -> None:
    runner = graph_runner(tiny_model_dirs["llama"], capture=False, backend="gather")
    assert runner.graphs is None and not runner.cuda_graphs


@pytest.mark.parametrize(("argv", "expected"), [([], True), (["--no-cuda-graphs"], False)])
def test_cuda_graphs_flag_reaches_the_config(
    argv: list[str],
    expected: bool,
    tiny_model_dirs: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A model is named: the default model's package is not installed on every machine (a GPU host).
    model = str(tiny_model_dirs["llama"])
    assert served_config([model, *argv], monkeypatch).cuda_graphs is expected


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


def tied_head_model(source: Path, target: Path, group: int = 40) -> Path:
    """`source` with its LM head (tied to the embeddings) made of groups of `group` identical
    rows: every logit ties with `group - 1` others, as bf16 logits tie, only wider."""
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.copy_(head[torch.arange(head.shape[0]) // group * group].clone())
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def test_a_late_read_processes_its_own_logits_not_a_later_replays(
    tiny_model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With async scheduling a step's tokens are read after the next step's graph replayed, and
    a replay writes its logits into the same buffer (`EagerGraph` reuses it as a CUDA graph
    does). A top-k tie wider than the room kept for ties sends that read back to the logits
    (an exact redo): it must process its own step's. Seeded top-k + top-p streams with and
    without async scheduling are the same."""
    model_dir = tied_head_model(tiny_model_dirs["llama"], tmp_path / "tied")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(p).input_ids for p in PROMPTS[:4]]
    params = DecodingParams(max_tokens=12, temperature=0.9, top_k=3, top_p=0.9, seed=7)
    redone = []
    settle = sampling_step.settle

    def spying(d, values, *args):  # type: ignore[no-untyped-def]
        redone.append(d.unsure is not None and bool(values[-1]))
        return settle(d, values, *args)

    monkeypatch.setattr(sampling_step, "settle", spying)
    runs = []
    for late in (False, True):
        engine = Engine(
            graph_runner(model_dir), tokenizer, async_scheduling=late, overlap_outputs=late
        )
        runs.append([r.choices() for r in generate(engine, prompts, params)])
        assert engine.pool.num_free == engine.pool.num_blocks
    assert redone and all(redone)  # every step had a tie past the room: every read redid it
    assert runs[0] == runs[1]


def test_a_graph_step_copies_only_the_block_table_columns_it_uses(
    tiny_model_dirs: dict[str, Path],
) -> None:
    """The graphs' table has max_model_len / block_size columns (8,192 for a 131k-context
    Llama); a step copies the columns its rows use, not the whole width."""
    runner = graph_runner(tiny_model_dirs["llama"])
    graphs = runner.graphs
    assert graphs is not None and graphs.max_blocks == 24
    graphs.tables.fill_(-1)  # stale entries past the used columns are never read
    copied = CopyCounter()
    with copied, torch.inference_mode():
        logits = graphs.run([[3, 4], [7], [9]], [11, 12, 13], [5, 2, 0]).clone()
    assert copied.elements <= 3 * 2 + 4 * 3, (
        copied.calls
    )  # table [3, 2]; tokens, positions, slots, tile_pos
    assert not copied.blocking, copied.blocking
    assert graphs.tables[:3, :2].tolist() == [[3, 4], [7, 0], [9, 0]]
    fresh = graph_runner(tiny_model_dirs["llama"])
    assert fresh.graphs is not None
    with torch.inference_mode():
        want = fresh.graphs.run([[3, 4], [7], [9]], [11, 12, 13], [5, 2, 0])
    torch.testing.assert_close(logits, want)


@pytest.mark.cpu_only  # stands in for torch.cuda, which a GPU run needs for real
def test_capture_uses_one_side_stream_and_one_memory_pool(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's capture with torch.cuda stood in for: every bucket is warmed and recorded on one
    side stream (not one per bucket), largest first, into one shared memory pool."""
    runner = graph_runner(tiny_model_dirs["llama"], capture=False)
    graphs = runner.graphs
    assert graphs is not None
    fake = FakeCuda()
    for name in ("Stream", "current_stream", "stream", "CUDAGraph", "graph", "graph_pool_handle"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    graphs.device = torch.device("cuda")  # its buffers stay on the CPU: the functions run here
    with torch.inference_mode():
        graphs.capture()
    assert list(graphs.graphs) == [8, 4, 2, 1]
    (side,) = fake.streams
    assert fake.warm_ups == [side] * 4
    assert fake.captures == [(side, "pool")] * 4


class FakeCuda:
    """What `DecodeGraphs.capture` asks of torch.cuda, recorded; the functions run on the CPU."""

    def __init__(self) -> None:
        self.streams: list[SimpleNamespace] = []
        self.warm_ups: list[object] = []  # the stream each warm-up ran on
        self.captures: list[tuple[object, object]] = []  # (stream, pool) of each capture

    def Stream(self) -> SimpleNamespace:  # noqa: N802  (torch.cuda's name)
        self.streams.append(SimpleNamespace(wait_stream=lambda other: None))
        return self.streams[-1]

    def current_stream(self) -> SimpleNamespace:
        return SimpleNamespace(wait_stream=lambda other: None)

    @contextlib.contextmanager
    def stream(self, stream: object) -> Iterator[None]:
        self.warm_ups.append(stream)
        yield

    def CUDAGraph(self) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(replay=lambda: None)

    def graph_pool_handle(self) -> str:
        return "pool"

    @contextlib.contextmanager
    def graph(self, graph: object, pool: object = None, stream: object = None) -> Iterator[None]:
        self.captures.append((stream, pool))
        yield


def test_a_lora_server_replays_base_graphs_for_base_steps_and_adapter_graphs_for_the_rest(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Every bucket has a base graph and an adapter graph, captured before any adapter is
    installed (the adapter graph with its rows' slots and masks read from static buffers): steps
    of base rows replay the first, steps with an adapter row the second, two adapters and a base
    row in one step (a padding row on no adapter); the tokens are generate()'s of the base model
    and of the merged ones."""
    model_dir = tiny_model_dirs["llama"]
    adapters = {
        "qv": make_adapter(model_dir, tmp_path / "qv", r=4, targets=["q_proj", "v_proj"], scale=30),
        "mlp": make_adapter(model_dir, tmp_path / "mlp", r=8, targets=["down_proj"], scale=30),
    }
    runner = graph_runner(model_dir, max_loras=2)
    graphs = runner.graphs
    assert graphs is not None and sorted(graphs.adapter_graphs) == sorted(graphs.graphs)
    replays: dict[str, list[int]] = {"base": [], "adapters": []}
    for kind, captured in (("base", graphs.graphs), ("adapters", graphs.adapter_graphs)):
        for rows, (graph, _) in captured.items():
            replay = graph.replay
            graph.replay = lambda kind=kind, rows=rows, replay=replay: (  # type: ignore[method-assign]
                replays[kind].append(rows),
                replay(),
            )[1]
    engine = Engine(runner, AutoTokenizer.from_pretrained(model_dir))
    for name, path in adapters.items():
        engine.load_adapter(name, str(path))
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS[:3]]
    params = DecodingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    jobs = [("a", prompts[0], "qv"), ("b", prompts[1], None), ("c", prompts[2], "mlp")]
    mixed = [submit(engine, name, ids, params, adapter) for name, ids, adapter in jobs]
    run_to_completion(engine)
    assert replays["base"] == []  # an adapter row in every decode step
    assert 4 in replays["adapters"] and len(replays["adapters"]) >= 5  # 3 rows: the 4-row graph
    alone = generate(engine, [prompts[1]], params)[0]
    assert len(replays["base"]) >= 5  # the base row's decode steps, the adapters now in slots
    assert alone.token_ids == mixed[1].token_ids == hf_greedy(model_dir, PROMPTS[1], 6)
    for (_, ids, adapter), got in zip(jobs, mixed):
        if adapter is not None:
            assert got.token_ids == merged_greedy(model_dir, adapters[adapter], ids, 6), adapter
    assert runner.lora is not None and runner.lora.state.step is None


def merged_greedy(model_dir: Path, adapter: Path, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = merged_model(model_dir, adapter).generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=1
        )
    return out[0, len(ids) :].tolist()

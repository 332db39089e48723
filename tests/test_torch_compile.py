"""The decode-step context and the torch.compile'd decode step (`--torch-compile`)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import server.runner_setup
from decoding import DecodingParams
from server.config import ServerConfig, load_config
from server.engine.engine import Engine
from server.loading import load_engine
from server.model.compile_cache import cache_key, model_identity
from server.model.compiled_decode import CompiledDecode
from server.model.runner import ModelRunner
from server.model.step_context import DecodeStep
from tests.conftest import make_engine
from tests.engine_driver import Counted, generate
from tests.test_engine_correctness import PROMPTS, hf_greedy
from tests.tiny_models import build_tiny_model


def test_decode_step_reads_each_rows_history_through_its_block_table() -> None:
    step = DecodeStep.build(
        [[7, 2], [5], [3, 9, 4]], [6, 2, 9], block_size=4, device=torch.device("cpu")
    )
    # width 9 -> 3 blocks per row; missing blocks pad with block 0, which the mask hides
    assert step.gather.tolist() == [
        [28, 29, 30, 31, 8, 9, 10, 11, 0],
        [20, 21, 22, 23, 0, 1, 2, 3, 0],
        [12, 13, 14, 15, 36, 37, 38, 39, 16],
    ]
    assert step.slot_mapping.tolist() == [9, 21, 16]  # the slot of each row's newest token
    assert step.mask(None)[:, 0, 0].int().tolist() == [
        [1, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
    ]
    assert step.mask(3)[:, 0, 0].int().tolist() == [  # the newest 3 tokens of each row
        [0, 0, 0, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 1, 1, 1],
    ]


def compiled_engine(
    model_dir: Path,
    quantization: str = "none",
    compile_decode: bool = True,
    compile_cache: Path | None = None,
) -> Engine:
    runner = ModelRunner(
        model_dir,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=4,
        num_blocks=256,
        quantization=quantization,
        compile_decode=compile_decode,
        compile_cache=compile_cache,
    )
    runner.warm_up()
    return Engine(runner, make_engine(model_dir).tokenizer, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def first_start(
    tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Engine:
    """The tiny Gemma 3 (sliding-window layers, window 6, and full layers) compiled once into an
    empty cache, for the tests of the compiled step and of its cache entry (a compile is most of
    each test's time)."""
    cache = tmp_path_factory.mktemp("compile-cache")
    return compiled_engine(tiny_model_dirs["gemma3"], compile_cache=cache)


def test_compiled_decode_gives_hf_greedy_tokens_and_never_recompiles_after_warm_up(
    tiny_model_dirs: dict[str, Path], first_start: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = tiny_model_dirs["gemma3"]
    expected = [hf_greedy(model_dir, p, 20) for p in PROMPTS]
    engine = first_start
    counted = Counted(engine.runner.decode_step.run)
    monkeypatch.setattr(engine.runner.decode_step, "run", counted)
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    params = DecodingParams(max_tokens=20, temperature=0)
    with torch._dynamo.config.patch(error_on_recompile=True):  # 1 row, then 2..8 rows, any width
        alone = generate(engine, [prompts[0]], params)[0].token_ids
        together = [r.token_ids for r in generate(engine, prompts, params)]
    assert alone == expected[0]
    assert together == expected
    assert counted.calls >= 30  # the decode steps went through the compiled function
    assert engine.pool.num_free == engine.pool.num_blocks


def test_compiled_w8a8_decode_gives_the_eager_w8a8_tokens(tiny_model_dirs: dict[str, Path]) -> None:
    """The int8 x int8 layers (per-token activation quantization fused by inductor) compile to the
    same rounding as eager: greedy tokens are identical, alone and in a batch."""
    model_dir = tiny_model_dirs["gemma3"]
    eager = compiled_engine(model_dir, "w8a8", compile_decode=False)
    compiled = compiled_engine(model_dir, "w8a8")
    prompts = [eager.tokenizer(p).input_ids for p in PROMPTS]
    params = DecodingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = [r.token_ids for r in generate(eager, prompts, params)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert [r.token_ids for r in generate(compiled, prompts, params)] == want
        assert generate(compiled, [prompts[1]], params)[0].token_ids == want[1]
    assert compiled.pool.num_free == compiled.pool.num_blocks


def served_config(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> ServerConfig:
    """The config `beamline serve *argv` would start the server with (nothing is started)."""
    import server.cli
    import server.http_server

    started: list[ServerConfig] = []
    monkeypatch.setattr(server.cli, "setup_logging", lambda *args: None)
    monkeypatch.setattr(server.http_server, "run_server", started.append)
    assert server.cli.main(["serve", *argv]) == 0
    assert len(started) == 1
    return started[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], None), (["--torch-compile"], True), (["--no-torch-compile"], False)],
)
def test_torch_compile_is_chosen_at_load_by_default_and_the_flag_reaches_the_server_config(
    argv: list[str], expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert served_config(argv, monkeypatch).torch_compile is expected


def test_torch_compile_can_be_set_in_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("torch_compile: true\n")
    assert load_config(path, {}).torch_compile is True


def test_without_a_compiler_torch_compile_stops_start_up_with_a_clear_message(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ValueError, match="needs a C/C\\+\\+ compiler on PATH"):
        ModelRunner(
            llama_dir,
            device=torch.device("cpu"),
            dtype=torch.float32,
            block_size=4,
            num_blocks=16,
            compile_decode=True,
        )


# A later start, in a process of its own: loads the two graphs (compiling is made to fail), then
# prints the greedy tokens of each prompt, one line per prompt.
LATER_START = """
import sys
from pathlib import Path
import torch
from server.model.compiled_decode import CompiledDecode
from tests.test_torch_compile import compiled_engine, later_start_tokens

def refuse(*args):
    raise AssertionError("compiled again instead of loading")

CompiledDecode._compile = refuse
torch.set_num_threads(int(sys.argv[3]))  # the first start's (part of the key)
engine = compiled_engine(Path(sys.argv[1]), compile_cache=Path(sys.argv[2]))
assert engine.runner.compiled_decode.base.source == "loaded"
for tokens in later_start_tokens(engine):
    print(tokens)
"""


def later_start_tokens(engine: Engine) -> list[list[int]]:
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    params = DecodingParams(max_tokens=20, temperature=0)
    return [r.token_ids for r in generate(engine, prompts, params)]


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def other_weights(model_dir: Path, path: Path) -> Path:
    """A copy of `model_dir` with one weight changed so that its tokens differ: the final norm's
    scale (Gemma's `1 + w`) negated. (Other random weights would not do: the tiny models, built
    for peaked distributions, mostly repeat the prompt's last token whatever their seed.)"""
    shutil.copytree(model_dir, path)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"] = -2 - weights["model.norm.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_a_later_start_of_a_fine_tune_loads_the_compiled_step_and_gives_its_own_hf_tokens(
    tiny_model_dirs: dict[str, Path], first_start: Engine, tmp_path: Path
) -> None:
    """The graphs take the weights as inputs: a later start of another model of the same
    architecture, in another folder, loads the entry and answers with its own weights."""
    model_dir = tiny_model_dirs["gemma3"]
    fine_tune = other_weights(model_dir, tmp_path / "fine-tune")
    assert first_start.runner.compiled_decode is not None
    compiled = first_start.runner.compiled_decode.base
    assert compiled.source == "compiled"
    assert compiled.directory is not None
    names = sorted(p.name for p in compiled.directory.iterdir())
    assert names == ["decode-1.bin", "decode-2.bin", "identity.txt"]
    about = (compiled.directory / "identity.txt").read_text().splitlines()
    assert f"model_dir={model_dir.resolve()}" in about and "block_size=4" in about
    assert any(line.startswith("torch=") for line in about)  # what the key digests, in full
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            LATER_START,
            str(fine_tune),
            str(compiled.directory.parent),
            str(torch.get_num_threads()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "running it eagerly" not in done.stderr  # every step went through the loaded graphs
    expected = [hf_greedy(fine_tune, p, 20) for p in PROMPTS]
    assert expected != [hf_greedy(model_dir, p, 20) for p in PROMPTS]  # not the first's weights
    assert [json.loads(line) for line in done.stdout.splitlines()] == expected


def test_an_unreadable_cache_entry_is_compiled_again_and_replaced(
    tiny_model_dirs: dict[str, Path],
    first_start: Engine,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    model_dir = tiny_model_dirs["gemma3"]
    assert first_start.runner.compiled_decode is not None
    compiled = first_start.runner.compiled_decode.base
    assert compiled.directory is not None
    entry = tmp_path / compiled.directory.name  # a copy of the first start's entry, truncated
    shutil.copytree(compiled.directory, entry)
    (entry / "decode-2.bin").write_bytes(b"truncated")
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="server.model.compiled_decode"):
        again = compiled_engine(model_dir, compile_cache=tmp_path)
    # a compile says so before it starts, and shows a bar with one step per graph
    assert "compiling the decode step (2 graphs" in caplog.text
    bar = capsys.readouterr().err
    assert "Compiling decode step" in bar and "2/2" in bar
    assert again.runner.compiled_decode is not None
    assert again.runner.compiled_decode.base.source == "compiled"
    assert again.runner.compiled_decode.base.directory == entry
    assert (entry / "decode-2.bin").stat().st_size > 1000
    assert later_start_tokens(again) == [hf_greedy(model_dir, p, 20) for p in PROMPTS]


def test_a_step_that_cannot_be_saved_serves_anyway_and_leaves_no_partial_entry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Saving fails with errors of torch's own (not OSErrors) on some releases: start-up goes
    on with the graphs in memory, warns, and leaves no half-written entry behind."""

    class Unsaveable:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def save_compiled_function(self, path: str) -> None:
            if self.fails:
                raise RuntimeError("cannot serialise this graph")
            Path(path).write_bytes(b"a graph")

    step = CompiledDecode(torch.nn.Identity(), tmp_path / "entry")
    step.graphs = [Unsaveable(False), Unsaveable(True)]
    step._save()
    assert "not saved" in caplog.text and "cannot serialise" in caplog.text
    assert not list((tmp_path / "entry").iterdir())


def test_a_start_waits_while_another_process_compiles_the_same_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The entry's lock file, held elsewhere (another open file: flock locks are per open file,
    as between processes), keeps `prepare` waiting; released, it goes on and loads or compiles."""
    entry = tmp_path / "compiled" / "0123456789abcdef"
    step = CompiledDecode(torch.nn.Identity(), entry)
    prepared = threading.Event()
    monkeypatch.setattr(step, "_prepare", lambda example: prepared.set() or "loaded")
    entry.parent.mkdir(parents=True)
    with (tmp_path / "compiled" / "0123456789abcdef.lock").open("a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        with caplog.at_level(logging.INFO, logger="server.model.compile_cache"):
            waiting = threading.Thread(target=step.prepare, args=(None,))
            waiting.start()
            assert not prepared.wait(0.5)  # blocked behind the other holder
            assert "another process is compiling" in caplog.text
            fcntl.flock(other, fcntl.LOCK_UN)
    assert prepared.wait(10)
    waiting.join(10)
    step.prepare(None)  # and a later start takes the free lock at once


def test_the_cache_key_changes_with_model_flags_and_software(
    tiny_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    identity = {"model": model_identity(tiny_model_dirs["gemma3"]), "quantization": "none"}
    key = cache_key(identity)
    assert cache_key(dict(identity)) == key
    assert cache_key({**identity, "quantization": "w8a8"}) != key
    assert cache_key({**identity, "model": model_identity(tiny_model_dirs["llama"])}) != key
    # not the folder nor the weights' values: the same architecture elsewhere keys the same
    elsewhere = other_weights(tiny_model_dirs["gemma3"], tmp_path / "other")
    assert model_identity(elsewhere) == identity["model"]
    wider = build_tiny_model(tmp_path / "wider", "gemma3", max_position_embeddings=1024)
    assert model_identity(wider) != identity["model"]  # the config is part of it
    with torch_threads(torch.get_num_threads() + 1):
        assert cache_key(identity) != key
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cache_key(identity) != key


@pytest.mark.parametrize(
    ("overrides", "flags", "path", "said", "quantization", "compiled"),
    [
        # the CPU default on a CPU with int8 dot products: w8a8, compiled when a compiler is there
        ({}, {"avx512_vnni"}, None, "w8a8 (int8 GEMMs", "w8a8", True),
        ({}, {"avx512_vnni"}, "/nonexistent", "needs a C++ compiler on PATH", "w8a8", False),
        ({}, {"avx2"}, None, "fp32, exact", "none", False),  # no int8 dot products
        ({"dtype": "float32"}, {"avx512_vnni"}, None, "fp32, exact", "none", False),  # exact mode
        ({"quantization": "w8a8"}, {"avx512_vnni"}, None, None, "w8a8", False),  # as chosen
    ],
)
def test_the_cpu_default_says_what_it_chose_at_start_up(
    llama_dir: Path,
    tmp_path: Path,
    overrides: dict[str, str],
    flags: set[str],
    path: str | None,
    said: str | None,
    quantization: str,
    compiled: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from server.model import devices

    monkeypatch.setattr(devices, "cpu_flags", lambda: frozenset(flags))
    if path is not None:
        monkeypatch.setenv("PATH", path)
        monkeypatch.delenv("CXX", raising=False)
    compiling: list[bool] = []
    # the compile itself is tested above; here only whether the runner was asked for it
    real_runner = server.runner_setup.ModelRunner

    def runner(*args: object, compile_decode: bool, **kwargs: object) -> object:
        compiling.append(compile_decode)
        return real_runner(*args, compile_decode=False, **kwargs)

    monkeypatch.setattr(server.runner_setup, "ModelRunner", runner)
    config = ServerConfig(model=str(llama_dir), cache_dir=tmp_path, num_kv_blocks=16, **overrides)
    with caplog.at_level(logging.INFO, logger="server.runner_setup"):
        loaded = load_engine(config)
    lines = [r.getMessage() for r in caplog.records if "CPU default" in r.getMessage()]
    if said is None:
        assert lines == []
    else:
        assert len(lines) == 1 and said in lines[0], lines
    assert compiling == [compiled]
    assert loaded.runner.quantization == quantization

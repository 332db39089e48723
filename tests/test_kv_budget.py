"""Sizing the KV pool: fixed sizes, "auto" (1 GiB on the CPU, measured on CUDA), the worst-case
profile step, and the CUDA batch defaults. CPU only: device memory is faked where CUDA is meant."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from decoding import DecodingParams
from server.config import ConfigError, ServerConfig, load_config
from server.device_defaults import CUDA_DEFAULTS, with_device_defaults
from server.model import kv_budget
from server.model.kv_budget import (
    DeviceMemory,
    GiB,
    KVBudget,
    auto_num_blocks,
    measure_peak,
    plan_num_blocks,
    profile_lengths,
    sampler_workload,
    worst_case_plan,
)
from server.model.runner import ModelRunner
from tests.conftest import make_engine
from tests.engine_driver import generate

CUDA = torch.device("cuda")  # only a label here: nothing below touches a GPU
MiB = 2**20


def fake_gpu(free: int, total: int) -> kv_budget.MemInfo:
    return lambda device: (free, total)


def no_profile() -> int:
    raise AssertionError("a fixed size must not run the profile step")


def plan(budget: KVBudget, **kwargs: object) -> int:
    args: dict = dict(
        num_blocks=None,
        bytes_per_block=MiB,
        block_size=16,
        device=CUDA,
        max_model_len=1024,
        profile=lambda: 2 * GiB,
        mem_info=fake_gpu(free=70 * GiB, total=80 * GiB),
    )
    return plan_num_blocks(budget, **{**args, **kwargs})  # type: ignore[arg-type]


# ---- the arithmetic --------------------------------------------------------------------------


def test_auto_on_cuda_is_utilization_of_total_less_used_less_peak() -> None:
    # 0.9 x 80 GiB - 10 GiB in use - 2 GiB peak = 60 GiB of 1 MiB blocks
    assert plan(KVBudget()) == 60 * 1024
    assert plan(KVBudget(gpu_memory_utilization=0.5)) == (40 - 10 - 2) * 1024
    assert plan(KVBudget(), bytes_per_block=3 * MiB) == 60 * 1024 // 3  # rounded down
    memory = DeviceMemory(total=80 * GiB, used=10 * GiB, peak_activation=2 * GiB)
    assert auto_num_blocks(memory, 0.1, MiB) == 0  # less than nothing left: no blocks


def test_the_profile_runs_before_free_memory_is_read() -> None:
    """Free memory is read after the profile step (CUDA context and kernels loaded by then)."""
    calls: list[str] = []

    def profile() -> int:
        calls.append("profile")
        return 0

    def mem_info(device: torch.device) -> tuple[int, int]:
        calls.append("mem_info")
        return 70 * GiB, 80 * GiB

    plan(KVBudget(), profile=profile, mem_info=mem_info)
    assert calls == ["profile", "mem_info"]


def test_fixed_sizes_and_block_counts_never_profile() -> None:
    assert plan(KVBudget(kv_cache_bytes=8 * GiB), profile=no_profile) == 8 * 1024
    assert plan(KVBudget(), num_blocks=7, profile=no_profile) == 7
    assert plan(KVBudget(kv_cache_bytes=GiB), num_blocks=7, profile=no_profile) == 7
    with pytest.raises(ValueError, match="one block needs"):
        plan(KVBudget(kv_cache_bytes=MiB - 1), profile=no_profile)


def test_auto_on_the_cpu_is_one_gib_worth_of_blocks() -> None:
    cpu = torch.device("cpu")
    assert plan(KVBudget(), device=cpu, profile=no_profile) == 1024
    assert plan(KVBudget(), device=cpu, profile=no_profile, bytes_per_block=24576) == GiB // 24576


@pytest.mark.parametrize(
    ("utilization", "max_model_len"),
    [(0.1, 1024), (0.9, 60 * 1024 * 16 + 1)],  # nothing left; less than one longest sequence
)
def test_a_pool_that_cannot_hold_one_sequence_stops_start_up(
    utilization: float, max_model_len: int
) -> None:
    budget = KVBudget(gpu_memory_utilization=utilization, max_num_seqs=256)
    with pytest.raises(ValueError) as info:
        plan(budget, max_model_len=max_model_len)
    message = str(info.value)
    for needle in (
        f"gpu_memory_utilization {utilization}",
        "80.00 GiB total",
        "10.00 GiB in use",
        "2.00 GiB peak activation",
        "max_num_seqs 256",
        f"max_model_len {max_model_len}",
        "Lower max_num_batched_tokens / max_num_seqs, raise gpu_memory_utilization",
        "set kv_cache_memory",
    ):
        assert needle in message


def test_auto_sizing_logs_its_numbers(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="server.model.kv_budget"):
        plan(KVBudget())
    text = caplog.text
    assert "80.00 GiB total" in text and "10.00 GiB in use" in text
    assert "2.00 GiB peak activation" in text and "60.00 GiB: 61440 blocks" in text


# ---- the worst-case step ---------------------------------------------------------------------


def test_the_worst_step_fills_the_token_budget_over_as_many_rows_as_allowed() -> None:
    assert profile_lengths(512, 64, 32768) == [449] + [1] * 63
    assert profile_lengths(10, 64, 512) == [1] * 10  # rows need a token each
    assert profile_lengths(100, 4, 30) == [30, 30, 30, 10]  # prompts end at max_model_len
    assert profile_lengths(200, 4, 30) == [30] * 4  # the engine could not schedule more either
    plan, blocks = worst_case_plan(KVBudget(max_num_seqs=3, max_num_batched_tokens=20), 512, 4)
    assert plan.num_new == [18, 1, 1] and plan.starts == [0, 0, 0]
    assert all(plan.samples) and plan.num_tokens == 20
    assert [edit.blocks for edit in plan.table_edits] == [[0, 1, 2, 3, 4], [5], [6]]
    assert blocks == 7


def test_sampler_workload_runs_and_leaves_the_rng_alone() -> None:
    logits = torch.randn(6, 300)
    state = torch.get_rng_state()
    sampler_workload(logits)
    assert torch.equal(state, torch.get_rng_state())


def test_measure_peak_runs_the_step_and_measures_nothing_on_the_cpu() -> None:
    ran: list[bool] = []
    assert measure_peak(torch.device("cpu"), lambda: ran.append(True)) == 0
    assert ran == [True]


def test_the_profile_step_runs_on_a_tiny_model_and_leaves_the_runner_serving(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(llama_dir, enable_prefix_caching=False)
    reference = make_engine(llama_dir, enable_prefix_caching=False)
    runner = engine.runner
    seen: list[tuple[int, int, tuple[int, ...]]] = []
    packed = runner._execute_packed

    def spy(plan, tables):  # type: ignore[no-untyped-def]
        out = packed(plan, tables)
        seen.append((plan.num_tokens, len(plan), tuple(out.logits.shape)))
        return out

    monkeypatch.setattr(runner, "_execute_packed", spy)
    # default limits: 512 tokens over 64 rows, one prompt as long as the model allows
    assert runner.profile_worst_step() == 0  # nothing to measure on the CPU
    assert seen == [(512, 64, (64, runner.vocab_size))]
    monkeypatch.undo()
    params = DecodingParams(max_tokens=8, temperature=0.0)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    got = [r.token_ids for r in generate(engine, prompts, params)]
    assert got == [r.token_ids for r in generate(reference, prompts, params)]


@pytest.mark.parametrize("backend", ["gather", "triton"])
def test_the_profile_step_runs_on_both_attention_paths(
    tiny_model_dirs: dict[str, Path], backend: str
) -> None:
    """Gemma 3 (sliding-window layers); triton runs under its interpreter on the CPU."""
    runner = ModelRunner(
        tiny_model_dirs["gemma3"],
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=4,
        num_blocks=8,
        attention_backend=backend,
        kv_budget=KVBudget(max_num_seqs=3, max_num_batched_tokens=40, max_model_len=32),
    )
    assert runner.profile_worst_step() == 0
    assert runner.attention.cache is runner.kv_cache  # the real pool is bound again


def test_auto_on_a_faked_gpu_profiles_the_real_runner(llama_dir: Path) -> None:
    """The CUDA branch end to end on the CPU: the runner's profile step, faked free memory."""
    runner = ModelRunner(
        llama_dir,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=4,
        num_blocks=8,
        kv_budget=KVBudget(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128),
    )
    per_block = runner.kv_layout.bytes_per_block
    blocks = plan_num_blocks(
        runner.kv_budget,
        num_blocks=None,
        bytes_per_block=per_block,
        block_size=4,
        device=CUDA,
        max_model_len=128,
        profile=runner.profile_worst_step,
        mem_info=fake_gpu(free=900 * MiB, total=1000 * MiB),
    )
    assert blocks == (int(0.9 * 1000 * MiB) - 100 * MiB) // per_block


def test_the_runner_profiles_while_it_is_built_as_on_cuda(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA an auto-sized pool runs the profile step inside the runner's constructor, before
    the pool exists: the step must need nothing set after it (it once read an attribute set
    later, and every CUDA server failed to start)."""
    profiled: list[int] = []

    def profile_then_plan(budget: KVBudget, **kwargs: object) -> int:
        profiled.append(kwargs["profile"]())  # type: ignore[operator]
        return 16

    monkeypatch.setattr("server.model.runner.plan_num_blocks", profile_then_plan)
    runner = ModelRunner(
        llama_dir,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=4,
        kv_budget=KVBudget(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
    )
    assert profiled == [0] and runner.num_blocks == 16


def test_the_runner_sizes_auto_on_the_cpu_without_profiling(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_budget, "CPU_AUTO_KV_BYTES", MiB)  # 1 GiB of zeros is too much here
    monkeypatch.setattr(ModelRunner, "profile_worst_step", no_profile)
    runner = ModelRunner(llama_dir, device=torch.device("cpu"), dtype=torch.float32, block_size=4)
    assert runner.num_blocks == MiB // runner.kv_layout.bytes_per_block
    assert runner.kv_cache.keys[0].shape[0] == runner.num_blocks * 4


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("auto", "auto"), ("AUTO", "auto"), ("8GiB", 8 * GiB), (4096, 4096), ("512MiB", 512 * MiB)],
)
def test_kv_cache_memory_is_a_size_or_auto(value: object, parsed: object) -> None:
    assert load_config(None, {"kv_cache_memory": value}, environ={}).kv_cache_memory == parsed
    env = {"BEAMLINE_KV_CACHE_MEMORY": str(value)}
    assert load_config(None, {}, environ=env).kv_cache_memory == parsed


def test_auto_and_ninety_percent_are_the_defaults() -> None:
    cfg = ServerConfig()
    assert (cfg.kv_cache_memory, cfg.gpu_memory_utilization) == ("auto", 0.9)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("kv_cache_memory", "lots"),
        ("kv_cache_memory", "0"),
        ("kv_cache_memory", 0),
        ("kv_cache_memory", -5),
        ("kv_cache_memory", 1.5),
        ("kv_cache_memory", True),
        ("gpu_memory_utilization", 0),
        ("gpu_memory_utilization", 1.01),
        ("gpu_memory_utilization", "most"),
    ],
)
def test_bad_values_are_config_errors_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"invalid configuration: {key}"):
        load_config(None, {key: value}, environ={})


# ---- CUDA batch defaults ---------------------------------------------------------------------


def test_cuda_raises_the_batch_limits_left_unset(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="server.device_defaults"):
        cfg = with_device_defaults(ServerConfig(), "cuda")
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (256, 2048)
    assert CUDA_DEFAULTS == {"max_num_seqs": 256, "max_num_batched_tokens": 2048}
    assert "max_num_seqs 256" in caplog.text and "max_num_batched_tokens 2048" in caplog.text
    assert with_device_defaults(cfg, "cuda") is cfg  # applied once (the CLI, then bootstrap)


def test_cuda_defaults_keep_what_the_user_set(tmp_path: Path) -> None:
    cfg = with_device_defaults(ServerConfig(max_num_seqs=32), "cuda")
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (32, 2048)
    path = tmp_path / "c.yaml"
    path.write_text("max_num_batched_tokens: 512\n")  # the CPU default, but given explicitly
    cfg = with_device_defaults(load_config(path, {}, environ={}), "cuda")
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (256, 512)
    env = {"BEAMLINE_MAX_NUM_SEQS": "48"}
    cfg = with_device_defaults(load_config(None, {}, environ=env), "cuda")
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (48, 2048)


def test_other_devices_keep_the_cpu_defaults() -> None:
    base = ServerConfig()
    assert with_device_defaults(base, "cpu") is base
    assert (base.max_num_seqs, base.max_num_batched_tokens) == (64, 512)


def test_copied_blocks_take_their_sources_content_as_it_was_before_the_copy() -> None:
    """Copy-on-write of beam forks: every slot of each destination block in every layer gets
    its source's, and a block copied from in the same call gives what it held before."""
    from server.model.kv_cache import PagedKVCache

    cache = PagedKVCache(2, 6, 4, 3, 5, torch.float32, torch.device("cpu"))
    for pool in (*cache.keys, *cache.values):
        pool.copy_(torch.randn_like(pool))
    before = [pool.clone() for pool in (*cache.keys, *cache.values)]
    cache.copy_blocks([(1, 4), (4, 5), (0, 2)])  # 4 is a destination and a source
    for old, pool in zip(before, (*cache.keys, *cache.values)):
        blocks, was = pool.view(6, 4, 3, 5), old.view(6, 4, 3, 5)
        for src, dst in ((1, 4), (4, 5), (0, 2)):
            assert torch.equal(blocks[dst], was[src])
        for kept in (0, 1, 3):
            assert torch.equal(blocks[kept], was[kept])

"""LoRA adapters in the engine: token-exact against `generate()` of the base with the adapter
merged (fp32), for greedy, beam search, n, speculation; adapters and the base mixed in one busy
batch equal their solo runs; slots, the host cache, prefix caching and preemption keep every
adapter's meaning; KV blocks all return; hostile adapter files are refused with a clear reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from decoding import DecodingParams
from server.engine.adapters import AdapterRegistry
from server.engine.engine import Engine
from server.model.loader import default_cache_dir
from server.model.lora import modules as lora
from server.model.lora.files import AdapterError, read_adapter
from server.model.lora.modules import LoRALinear, LoRAStep
from server.model.runner import ModelRunner
from tests.conftest import TEST_DEVICE, hf_reference, make_engine
from tests.engine_driver import Collected, run_to_completion, submit
from tests.lora_adapters import ALL_TARGETS, edit_config, make_adapter, merged_model

PROMPTS = ["Hello world! How are you", "The quick brown fox", "Once upon a time there was"]
# name -> (rank, targets, extra LoraConfig fields)
ADAPTERS = {
    "qv8": (8, ["q_proj", "v_proj"], {}),
    "mlp16": (16, ["gate_proj", "up_proj", "down_proj"], {"lora_alpha": 8}),
    "all8": (8, ALL_TARGETS, {"use_rslora": True}),
}


@pytest.fixture(scope="module")
def adapter_dirs(
    tiny_model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], Path]:
    """(architecture, adapter name) -> its peft directory, for llama and gemma3."""
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for arch in ("llama", "gemma3"):
        for seed, (name, (rank, targets, extra)) in enumerate(ADAPTERS.items()):
            made[arch, name] = make_adapter(
                tiny_model_dirs[arch],
                root / arch / name,
                r=rank,
                targets=targets,
                seed=seed,
                scale=30.0,
                **extra,
            )
    return made


def lora_engine(model_dir: Path, adapters: dict[str, Path], **kwargs: object) -> Engine:
    kwargs.setdefault("max_loras", 2)
    engine = make_engine(model_dir, **kwargs)  # type: ignore[arg-type]
    for name, path in adapters.items():
        engine.load_adapter(name, str(path))
    return engine


def hf_greedy(model: torch.nn.Module, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=1
        )
    return out[0, len(ids) :].tolist()


def run(
    engine: Engine, jobs: list[tuple[list[int], str | None]], params: DecodingParams
) -> list[Collected]:
    got = [submit(engine, str(i), ids, params, adapter) for i, (ids, adapter) in enumerate(jobs)]
    run_to_completion(engine)
    assert all(g.finished for g in got)
    return got


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_greedy_with_an_adapter_equals_generate_of_the_merged_model(
    tiny_model_dirs: dict[str, Path],
    adapter_dirs: dict[tuple[str, str], Path],
    arch: str,
    adapter: str,
) -> None:
    model_dir = tiny_model_dirs[arch]
    path = adapter_dirs[arch, adapter]
    engine = lora_engine(model_dir, {adapter: path})
    tok = engine.tokenizer
    prompts = [tok(p).input_ids for p in PROMPTS]
    params = DecodingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=5)
    got = run(engine, [(ids, adapter) for ids in prompts] + [(prompts[0], None)], params)
    merged = merged_model(model_dir, path)
    base = hf_reference(model_dir)[0]
    for ids, result in zip(prompts, got):
        assert result.token_ids == hf_greedy(merged, ids, 10)
    assert got[-1].token_ids == hf_greedy(base, prompts[0], 10)
    # the adapter's first logprob is the merged model's, not the base's (the tiny Gemma's greedy
    # tokens often do not change under an adapter; its probabilities do)
    first = got[0].outputs[0].logprobs
    assert first is not None
    with torch.no_grad():
        x = torch.tensor([prompts[0]])
        want = merged(x).logits[0, -1].log_softmax(-1)
        base_lp = base(x).logits[0, -1].log_softmax(-1)
    top = dict(first[0].top)
    assert top == pytest.approx({t: want[t].item() for t in top}, abs=1e-4)
    assert max(abs(want[t] - base_lp[t]).item() for t in top) > 1e-2
    assert engine.pool.num_free == engine.pool.num_blocks


def test_beam_search_with_an_adapter_equals_generate_of_the_merged_model(
    llama_dir: Path, adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    path = adapter_dirs["llama", "all8"]
    engine = lora_engine(llama_dir, {"all8": path})
    tok = engine.tokenizer
    params = DecodingParams(max_tokens=8, temperature=0, num_beams=4, n=2, length_penalty=1.0)
    prompts = [tok(p).input_ids for p in PROMPTS]
    got = run(engine, [(ids, "all8") for ids in prompts], params)
    merged = merged_model(llama_dir, path)
    for ids, result in zip(prompts, got):
        with torch.no_grad():
            out = merged.generate(
                torch.tensor([ids]),
                max_new_tokens=8,
                num_beams=4,
                num_return_sequences=2,
                do_sample=False,
                length_penalty=1.0,
            )
        expected = [[t for t in o[len(ids) :].tolist() if t != tok.pad_token_id] for o in out]
        assert [c[1] for c in result.choices().values()] == expected
    assert engine.pool.num_free == engine.pool.num_blocks


def test_adapters_and_the_base_mixed_in_one_batch_equal_their_solo_runs(
    llama_dir: Path, adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    """Three adapters and the base, interleaved, with two slots (adapters wait for a slot and
    take turns), n = 2 sampled choices and beams among them: each request's output equals its
    run alone in a fresh engine."""
    adapters = {name: adapter_dirs["llama", name] for name in ADAPTERS}
    tok_engine = lora_engine(llama_dir, adapters)
    prompts = [tok_engine.tokenizer(p).input_ids for p in PROMPTS]
    names: list[str | None] = [*ADAPTERS, None]
    jobs = [(prompts[i % 3], names[i % 4]) for i in range(12)]
    strategies = [
        DecodingParams(max_tokens=9, temperature=0, ignore_eos=True),
        DecodingParams(max_tokens=7, temperature=0.8, seed=5, n=2, ignore_eos=True),
        DecodingParams(max_tokens=6, temperature=0, num_beams=3, n=2),
    ]
    engine = lora_engine(llama_dir, adapters)
    mixed = [
        submit(engine, str(i), ids, strategies[i % 3], adapter)
        for i, (ids, adapter) in enumerate(jobs)
    ]
    running_adapters = set()
    for _ in range(10_000):
        if not engine.step():
            break
        held = {r.model_name for r in engine.scheduler.running if r.model_name}
        assert len(held) <= 2  # never more adapters running than slots
        running_adapters |= held
    assert running_adapters == set(ADAPTERS)
    for i, (ids, adapter) in enumerate(jobs):
        solo = lora_engine(llama_dir, adapters)
        alone = run(solo, [(ids, adapter)], strategies[i % 3])[0]
        assert mixed[i].choices() == alone.choices(), (i, adapter)
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.stats.max_seqs_in_step > 4  # they did share steps


def test_n_choices_and_speculation_keep_the_adapter(
    llama_dir: Path, adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    path = adapter_dirs["llama", "qv8"]
    engine = lora_engine(llama_dir, {"qv8": path}, speculative_tokens=4)
    tok = engine.tokenizer
    ids = tok("the the the the the the the the").input_ids
    params = DecodingParams(max_tokens=16, temperature=0, n=3, ignore_eos=True)
    (got,) = run(engine, [(ids, "qv8")], params)
    expected = hf_greedy(merged_model(llama_dir, path), ids, 16)
    assert [c[1] for c in got.choices().values()] == [expected] * 3
    assert engine.pool.num_free == engine.pool.num_blocks


def test_prefix_cache_blocks_are_never_shared_across_adapters(
    llama_dir: Path, adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    engine = lora_engine(llama_dir, {"qv8": adapter_dirs["llama", "qv8"]})
    ids = engine.tokenizer(" ".join(["The quick brown fox jumps over the lazy dog."] * 3)).input_ids
    params = DecodingParams(max_tokens=2, temperature=0)
    run(engine, [(ids, "qv8")], params)
    assert engine.stats.prefix_cache_hits == 0
    base = run(engine, [(ids, None)], params)[0]  # same prompt, the base: no reuse
    assert engine.stats.prefix_cache_hits == 0
    run(engine, [(ids, "qv8")], params)  # the adapter's own blocks: reused
    hits = engine.stats.prefix_cache_hits
    assert hits >= len(ids) - 4
    fresh = make_engine(llama_dir)
    assert run(fresh, [(ids, None)], params)[0].token_ids == base.token_ids
    # unloaded and loaded again (other weights, same name): its old blocks are not reused
    engine.unload_adapter("qv8")
    engine.load_adapter("qv8", str(adapter_dirs["llama", "all8"]))
    run(engine, [(ids, "qv8")], params)
    assert engine.stats.prefix_cache_hits == hits


def test_preemption_and_aborts_free_every_block_and_slot(
    llama_dir: Path, adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    adapters = {name: adapter_dirs["llama", name] for name in ("qv8", "mlp16")}
    engine = lora_engine(llama_dir, adapters, num_blocks=24, block_size=4)
    tok = engine.tokenizer
    params = DecodingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [tok(p).input_ids for p in PROMPTS]
    jobs = [(prompts[i % 3], ["qv8", "mlp16", None][i % 3]) for i in range(6)]
    got = [submit(engine, str(i), ids, params, a) for i, (ids, a) in enumerate(jobs)]
    aborted = submit(engine, "x", prompts[0], params, "mlp16")
    for _ in range(3):
        engine.step()
    engine.abort("x")
    run_to_completion(engine)
    assert engine.stats.preemptions > 0
    assert aborted.finish_reason == "abort"
    for (ids, adapter), result in zip(jobs, got):
        solo = lora_engine(llama_dir, adapters)
        assert result.token_ids == run(solo, [(ids, adapter)], params)[0].token_ids
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.lora is not None and engine.lora.slots.running_names() == []


def test_unloaded_adapter_refuses_new_requests_and_running_ones_finish(
    llama_dir: Path, adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    path = adapter_dirs["llama", "qv8"]
    engine = lora_engine(llama_dir, {"qv8": path})
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    params = DecodingParams(max_tokens=12, temperature=0, ignore_eos=True)
    running = submit(engine, "a", ids, params, "qv8")
    engine.step()
    queued = submit(engine, "b", ids, params, "qv8")  # submitted before the unload: runs
    engine.unload_adapter("qv8")
    assert "qv8" not in engine.adapter_names()
    late = submit(engine, "c", ids, params, "qv8")
    run_to_completion(engine)
    expected = hf_greedy(merged_model(llama_dir, path), ids, 12)
    assert running.token_ids == expected and queued.token_ids == expected
    assert late.finish_reason == "error" and "not loaded" in (late.outputs[-1].error or "")
    assert engine.pool.num_free == engine.pool.num_blocks


def test_host_cache_keeps_at_most_max_cpu_loras_and_reads_evicted_ones_again(
    llama_dir: Path, adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    reads: list[str] = []
    targets = {"model.layers.0.self_attn.q_proj": (64, 64)}

    def read(name: str, source: str) -> object:
        reads.append(name)
        return type("Weights", (), {"name": name, "rank": 8, "nbytes": 1})()

    registry = AdapterRegistry(read, max_cpu_loras=2)  # type: ignore[arg-type]
    for name in ("a", "b", "c"):
        registry.add(name, f"/adapters/{name}")
    assert reads == ["a", "b", "c"]
    registry.resolve("c")
    registry.resolve("b")
    assert reads == ["a", "b", "c"]  # the two most recent are in memory
    registry.resolve("a")  # evicted: read again
    assert reads[-1] == "a"
    with pytest.raises(ValueError, match="already loaded"):
        registry.add("a", "/elsewhere")
    assert targets  # (shapes are the reader's business)


def test_lora_step_masks_each_token_to_its_own_slots_columns() -> None:
    cpu = torch.device("cpu")
    build = dict(num_slots=2, max_rank=2, device=cpu, dtype=torch.float32, masked=True)
    step = LoRAStep.build([(0, 2), (-1, 1), (1, 1)], **build)  # type: ignore[arg-type]
    assert step is not None and step.mask is not None
    assert step.slots.tolist() == [0, 0, -1, 1]
    assert step.mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 1]]
    assert LoRAStep.build([(-1, 4)], **build) is None  # type: ignore[arg-type]


# ---- hostile adapters -------------------------------------------------------------------------
def _targets(engine: Engine) -> dict[str, tuple[int, int]]:
    assert engine.runner.lora is not None
    return engine.runner.lora.targets


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize(
    ("break_it", "reason"),
    [
        ("no_config", "no adapter_config.json"),
        ("bad_json", "unreadable adapter_config.json"),
        ("no_weights", "neither adapter_model.safetensors"),
        ("garbage_weights", "unreadable weights"),
        ("wrong_shape", "was not trained on this model"),
        ("missing_module", "has no module"),
        ("embedding_target", "not a LoRA A / B matrix"),
        ("rank_too_high", "above max_lora_rank"),
        ("dora", "DoRA"),
        ("bias", "trains biases"),
        ("prefix_tuning", "only LoRA is served"),
        ("missing_b", "lacks its lora_A or lora_B"),
    ],
)
def test_hostile_adapters_are_refused_with_a_clear_reason(
    llama_dir: Path,
    adapter_dirs: dict[tuple[str, str], Path],
    tmp_path: Path,
    break_it: str,
    reason: str,
) -> None:
    engine = lora_engine(llama_dir, {"qv8": adapter_dirs["llama", "qv8"]}, max_lora_rank=8)
    bad = _copy(adapter_dirs["llama", "qv8"], tmp_path / "bad")
    weights_file = bad / "adapter_model.safetensors"
    weights = load_file(weights_file)
    a_key = next(k for k in weights if "lora_A" in k)
    if break_it == "no_config":
        (bad / "adapter_config.json").unlink()
    elif break_it == "bad_json":
        (bad / "adapter_config.json").write_text("{not json")
    elif break_it == "no_weights":
        weights_file.unlink()
    elif break_it == "garbage_weights":
        weights_file.write_bytes(b"\x00\x01garbage" * 10)
    elif break_it == "wrong_shape":
        weights[a_key] = torch.randn(8, 32)
        save_file(weights, weights_file)
    elif break_it == "missing_module":
        weights[a_key.replace("layers.0.", "layers.99.")] = weights.pop(a_key)
        b_key = a_key.replace("lora_A", "lora_B")
        weights[b_key.replace("layers.0.", "layers.99.")] = weights.pop(b_key)
        save_file(weights, weights_file)
    elif break_it == "embedding_target":
        weights["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(8, 10)
        save_file(weights, weights_file)
    elif break_it == "rank_too_high":
        bad16 = adapter_dirs["llama", "mlp16"]
        for f in bad16.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
    elif break_it == "dora":
        edit_config(bad, use_dora=True)
    elif break_it == "bias":
        edit_config(bad, bias="all")
    elif break_it == "prefix_tuning":
        edit_config(bad, peft_type="PREFIX_TUNING")
    elif break_it == "missing_b":
        del weights[a_key.replace("lora_A", "lora_B")]
        save_file(weights, weights_file)
    with pytest.raises(AdapterError, match=reason):
        read_adapter("bad", bad, _targets(engine), max_rank=8)
    with pytest.raises(AdapterError, match=reason):
        engine.load_adapter("bad", str(bad))
    assert "bad" not in engine.adapter_names()
    # the server keeps serving its other adapter
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    got = run(engine, [(ids, "qv8")], DecodingParams(max_tokens=4, temperature=0))
    assert len(got[0].token_ids) >= 1


def test_an_adapter_directory_that_does_not_exist_and_not_a_hub_id_is_refused(
    llama_dir: Path, tmp_path: Path
) -> None:
    engine = lora_engine(llama_dir, {})
    with pytest.raises(AdapterError, match="neither a local directory nor a hub id"):
        engine.load_adapter("x", str(tmp_path / "nope" / "deeper" / "still"))
    with pytest.raises(ValueError, match="not enabled"):
        make_engine(llama_dir).load_adapter("x", str(tmp_path))


@pytest.mark.cpu_only  # the Triton kernel under its interpreter, on CPU tensors
def test_the_triton_kernel_path_serves_the_same_tokens(
    llama_dir: Path, adapter_dirs: dict[tuple[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA path's kernel (triton_lora.py, run by Triton's interpreter) in place of the
    masked GEMMs, through the whole engine: adapters and the base mixed, token-exact."""
    monkeypatch.setattr(lora, "uses_kernel", lambda device: True)
    adapters = {name: adapter_dirs["llama", name] for name in ("qv8", "all8")}
    engine = lora_engine(llama_dir, adapters)
    wrapped = [m for m in engine.runner.model.modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 7 * engine.runner.config.num_hidden_layers  # every projection
    assert all(module.fused for module in wrapped)
    tok = engine.tokenizer
    jobs = [(tok(p).input_ids, a) for p, a in zip(PROMPTS, ["qv8", "all8", None])]
    params = DecodingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = run(engine, jobs, params)
    for (ids, adapter), result in zip(jobs, got):
        reference = merged_model(llama_dir, adapters[adapter]) if adapter else None
        expected = hf_greedy(reference or hf_reference(llama_dir)[0], ids, 6)
        assert result.token_ids == expected, adapter


def test_a_lora_server_runs_base_and_adapter_steps_through_their_compiled_graphs(
    llama_dir: Path, adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    """LoRA keeps torch.compile: the base decode step is traced before any adapter is installed,
    the adapter step with a step's LoRA masks set (every row's slot a graph input, the deltas
    inside the graph). Steps of base rows run the first (as fast as a server without LoRA), steps
    with an adapter row the second, rows of two adapters and the base mixed; the tokens are
    generate()'s of the base and the merged models. The graphs come from the compile cache
    that serving uses (compiled on a first run, loaded after)."""
    paths = {name: adapter_dirs["llama", name] for name in ("qv8", "mlp16")}
    runner = ModelRunner(
        llama_dir,
        device=TEST_DEVICE,
        dtype=torch.float32,
        block_size=4,
        num_blocks=256,
        max_loras=2,
        compile_decode=True,
        compile_cache=default_cache_dir() / "compiled",
    )
    runner.warm_up()
    steps = runner.compiled_decode
    assert steps is not None and steps.adapters is not None
    graphs = {"base": steps.base, "adapters": steps.adapters}
    # a torch without `aot_compile` (the GPU image's 2.11) compiles each start: plain torch.compile
    cached = hasattr(torch.compile(lambda: None), "aot_compile")
    expected = ("compiled", "loaded") if cached else ("jit",)
    assert all(g.source in expected for g in graphs.values())
    assert runner.lora is not None and runner.lora.state.step is None  # the warm-up's is gone
    engine = Engine(runner, AutoTokenizer.from_pretrained(llama_dir))
    for name, path in paths.items():
        engine.load_adapter(name, str(path))
    rows: dict[str, list[int]] = {"base": [], "adapters": []}

    def counted(kind: str, compiled: Any) -> Any:
        def run(input_ids, position_ids, ctx):  # type: ignore[no-untyped-def]
            rows[kind].append(input_ids.shape[1])
            return compiled(input_ids, position_ids, ctx)

        return run

    steps.base = counted("base", steps.base)
    steps.adapters = counted("adapters", steps.adapters)
    prompts = [engine.tokenizer(p).input_ids for p in PROMPTS]
    params = DecodingParams(max_tokens=8, temperature=0, ignore_eos=True)
    base_only = run(engine, [(ids, None) for ids in prompts], params)
    assert len(rows["base"]) >= 7 and not rows["adapters"]  # every decode step of base rows
    before = len(rows["base"])
    jobs = [(prompts[0], "qv8"), (prompts[1], None), (prompts[2], "mlp16")]
    mixed = run(engine, jobs, params)
    assert len(rows["base"]) == before  # an adapter row in every step: the adapter graph
    assert len(rows["adapters"]) >= 7 and 3 in rows["adapters"]
    again = run(engine, [(ids, None) for ids in prompts], params)  # the adapters now in slots
    assert len(rows["base"]) >= before + 7  # the base graph still fits
    assert all(g.fallbacks == 0 for g in graphs.values())  # their guards held every step
    base = hf_reference(llama_dir)[0]
    assert [g.token_ids for g in base_only] == [hf_greedy(base, ids, 8) for ids in prompts]
    assert [g.token_ids for g in again] == [g.token_ids for g in base_only]
    for (ids, adapter), result in zip(jobs, mixed):
        reference = merged_model(llama_dir, paths[adapter]) if adapter else base
        assert result.token_ids == hf_greedy(reference, ids, 8), adapter
    assert engine.pool.num_free == engine.pool.num_blocks


def test_an_adapter_whose_first_step_failed_is_installed_with_the_next_plan(
    llama_dir: Path, adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    """A step that fails before its plan reached the model fails its requests; the adapters that
    plan was to put in their slots go with the next plan, so the next request on the adapter
    gets the adapter's tokens, not whatever the slot held."""
    path = adapter_dirs["llama", "qv8"]
    engine = lora_engine(llama_dir, {"qv8": path})
    real = engine.runner.execute
    installs: list[int] = []

    def failing_once(plan):  # type: ignore[no-untyped-def]
        installs.append(len(plan.installs))
        if len(installs) == 1:
            raise RuntimeError("simulated device error")
        return real(plan)

    engine.runner.execute = failing_once  # type: ignore[method-assign]
    ids = engine.tokenizer(PROMPTS[0]).input_ids
    params = DecodingParams(max_tokens=6, temperature=0, ignore_eos=True)
    failed = submit(engine, "lost", ids, params, "qv8")
    run_to_completion(engine)
    assert failed.outputs[-1].finish_reason == "error"
    got = run(engine, [(ids, "qv8")], params)[0]
    assert installs[:2] == [1, 1]  # the failed plan's install, sent again
    assert got.token_ids == hf_greedy(merged_model(llama_dir, path), ids, 6)


def test_a_prompt_scored_with_an_adapter_under_w8a8_is_the_merged_models(
    tiny_model_dirs: dict[str, Path], adapter_dirs: dict[tuple[str, str], Path]
) -> None:
    """Prompt scoring runs through the int8 layers' floating-point weights
    (server/model/exact_weights.py), which the adapters wrap: an adapter's scored prompt is the
    merged floating-point model's, the base model's beside it the base's."""
    model_dir, path = tiny_model_dirs["gemma3"], adapter_dirs["gemma3", "all8"]
    engine = lora_engine(model_dir, {"all8": path}, quantization="w8a8")
    assert len(engine.runner.exact) > 0
    ids = engine.tokenizer(PROMPTS[2]).input_ids
    params = DecodingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    with_adapter, base = run(engine, [(ids, "all8"), (ids, None)], params)
    for result, model in ((with_adapter, merged_model(model_dir, path)), (base, None)):
        reference = model if model is not None else hf_reference(model_dir)[0]
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0].log_softmax(-1)
        (scored,) = [o.prompt_logprobs for o in result.outputs if o.prompt_logprobs]
        got = [entry.logprob for entry in scored[1:] if entry is not None]
        expected = [want[j - 1, ids[j]].item() for j in range(1, len(ids))]
        assert got == pytest.approx(expected, abs=1e-4)

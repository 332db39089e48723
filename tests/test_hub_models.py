"""Models named by hub id, served from a Hugging Face cache built on disk (tests/hub_cache.py) and
never from the network: offline (HF_HUB_OFFLINE) the cache alone answers; "online", the hub's
calls (hub.remote_listing, hub.download_file, hub.download_files) are replaced by a fake hub that
writes into the cache as huggingface_hub would, or raises huggingface_hub's own exceptions."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import httpx2
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

from server.api.app import create_app
from server.bootstrap import build_serving_context, prepare_model
from server.config import ServerConfig
from server.model import hub
from server.model.hub import ModelNotFound
from server.model.loader import default_gguf_path, locate_model, resolve_model_dir
from tests.conftest import TEST_DEVICE_NAME
from tests.hub_cache import (
    GGUF_QUANTS,
    GGUF_REPO,
    commit_of,
    model_files,
    write_gguf_repo,
    write_snapshot,
)

REPO = "tiny-org/tiny-llama"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache of this test's own, offline. huggingface_hub reads HF_HUB_CACHE and
    HF_HUB_OFFLINE from the environment when it is imported: set here as the env would set them."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture
def tiny_repo(hub_cache: Path, llama_dir: Path) -> Path:
    """REPO in the cache: the tiny llama as main, its snapshot returned."""
    return write_snapshot(hub_cache, REPO, model_files(llama_dir), commit_of("a"), refs=("main",))


def response(status: int) -> httpx2.Response:
    return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/x"))


class FakeHub:
    """The hub's calls, answered from `files` (the repository) into the cache; no network."""

    def __init__(self, cache: Path, files: dict[str, Path], error: Exception | None = None):
        self.cache, self.files, self.error = cache, files, error
        self.commit = commit_of("remote")
        self.listed: list[str] = []
        self.downloaded: list[str] = []

    def remote_listing(self, repo_id: str, revision: str) -> tuple[str, dict[str, int | None]]:
        self.listed.append(repo_id)
        if isinstance(self.error, (RepositoryNotFoundError, RevisionNotFoundError, OSError)):
            raise self.error
        return self.commit, {name: path.stat().st_size for name, path in self.files.items()}

    def download_file(self, repo_id: str, commit: str, name: str) -> Path:
        return write_snapshot(self.cache, repo_id, {name: self.files[name]}, commit) / name

    def download_files(self, repo_id: str, revision: str, files: list[str]) -> Path:
        if self.error is not None:
            raise self.error
        self.downloaded = files
        chosen = {name: self.files[name] for name in files}
        return write_snapshot(self.cache, repo_id, chosen, self.commit, refs=(revision,))


@pytest.fixture
def online(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def use_hub(monkeypatch: pytest.MonkeyPatch, fake: FakeHub) -> FakeHub:
    monkeypatch.setattr(hub, "remote_listing", fake.remote_listing)
    monkeypatch.setattr(hub, "download_file", fake.download_file)
    monkeypatch.setattr(hub, "download_files", fake.download_files)
    return fake


def serve_config(model: str, **extra: object) -> ServerConfig:
    fields: dict = {
        "model": model,
        "device": TEST_DEVICE_NAME,
        "num_kv_blocks": 64,
        "block_size": 4,
    }
    return ServerConfig(**{**fields, **extra})


async def test_a_hub_id_loads_from_the_cache_offline_and_answers_under_its_id(
    tiny_repo: Path,
) -> None:
    config = prepare_model(serve_config(REPO))
    assert (Path(config.model or ""), config.served_model_name) == (tiny_repo, REPO)
    ctx = build_serving_context(config)
    try:
        transport = httpx.ASGITransport(app=create_app(ctx=ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"model": REPO, "prompt": "Hello", "max_tokens": 3, "temperature": 0}
            r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == REPO and r.json()["usage"]["completion_tokens"] == 3
    finally:
        ctx.engine.shutdown()


def test_revision_picks_a_snapshot_by_branch_tag_or_commit(
    hub_cache: Path, tiny_repo: Path, tiny_model_dirs: dict[str, Path]
) -> None:
    other = write_snapshot(
        hub_cache, REPO, model_files(tiny_model_dirs["qwen2"]), commit_of("b"), refs=("v2",)
    )
    assert locate_model(REPO).path == tiny_repo  # main
    assert locate_model(REPO, revision="v2").path == other
    assert locate_model(REPO, revision=commit_of("b")).path == other
    assert locate_model(REPO, revision=commit_of("a")).path == tiny_repo
    with pytest.raises(ModelNotFound, match="revision v3.*not in the local Hugging Face cache"):
        locate_model(REPO, revision="v3")


def test_a_gguf_repo_resolves_its_quant_selector_to_that_file(hub_cache: Path) -> None:
    snapshot = write_gguf_repo(hub_cache, default_gguf_path())
    assert locate_model(f"{GGUF_REPO}:Q4_K_M").path == snapshot / GGUF_QUANTS[0]
    assert locate_model(f"{GGUF_REPO}:q8_0").path == snapshot / GGUF_QUANTS[1]  # any case
    assert locate_model(f"{GGUF_REPO}:{GGUF_QUANTS[1]}").path == snapshot / GGUF_QUANTS[1]
    assert locate_model(f"{GGUF_REPO}:Q4_K_M").name == f"{GGUF_REPO}:Q4_K_M"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (f"{GGUF_REPO}:Q5_K_M", "no .gguf file of .* matches 'Q5_K_M' \\(its .gguf files: "),
        (f"{GGUF_REPO}:Q4_K", "no .gguf file of .* matches 'Q4_K'"),  # not a prefix of Q4_K_M
        (f"{GGUF_REPO}:gemma-3-270m", "2 .gguf files of .* match 'gemma-3-270m'"),
        (GGUF_REPO, "holds 2 .gguf files .*: name one as .*:QUANT"),
    ],
)
def test_a_quant_that_matches_no_file_or_several_says_which_there_are(
    hub_cache: Path, model: str, message: str
) -> None:
    write_gguf_repo(hub_cache, default_gguf_path())
    with pytest.raises(ModelNotFound, match=message) as failed:
        locate_model(model)
    assert "\n" not in str(failed.value) and "HF_HUB_OFFLINE" in str(failed.value)


def test_offline_a_model_not_in_the_cache_says_where_it_looked(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFound) as failed:
        locate_model("nobody/nothing")
    message = str(failed.value)
    assert "not in the local Hugging Face cache" in message and str(hub_cache) in message
    assert "HF_HUB_OFFLINE is set" in message and "\n" not in message


def test_offline_an_incomplete_snapshot_names_the_missing_shard(
    hub_cache: Path, tmp_path: Path
) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}')
    config, shard = tmp_path / "config.json", tmp_path / "model-1.safetensors"
    config.write_text("{}")
    shard.write_bytes(b"0")
    files = {"config.json": config, index.name: index, shard.name: shard}
    write_snapshot(hub_cache, REPO, files, commit_of("c"), refs=("main",))
    with pytest.raises(ModelNotFound, match="incomplete .* lacks model-2.safetensors"):
        locate_model(REPO)


def test_a_cached_model_starts_without_asking_the_hub(
    hub_cache: Path, tiny_repo: Path, online: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = use_hub(monkeypatch, FakeHub(hub_cache, {}))
    assert locate_model(REPO).path == tiny_repo and fake.listed == []


def test_online_only_the_files_serving_needs_are_downloaded(
    hub_cache: Path, online: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "repo"
    names = [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "chat_template.jinja", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "pytorch_model.bin", "consolidated.safetensors",
        "README.md", ".gitattributes", "onnx/model.onnx", "original/consolidated.00.pth",
    ]  # fmt: skip
    for name in names:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("{}")
    shards = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": shards}))
    fake = use_hub(monkeypatch, FakeHub(hub_cache, model_files(repo)))
    located = locate_model(REPO)
    assert sorted(fake.downloaded) == sorted(names[:8])  # no .bin, no other format, no README
    assert located.path == hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / fake.commit
    assert (hub_cache / "models--tiny-org--tiny-llama" / "refs" / "main").read_text() == fake.commit


def test_pickle_weights_only_with_the_flag(
    hub_cache: Path, online: None, llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {
        "config.json": llama_dir / "config.json",
        "pytorch_model.bin": llama_dir / "config.json",
    }
    fake = use_hub(monkeypatch, FakeHub(hub_cache, files))
    with pytest.raises(
        ModelNotFound,
        match="no safetensors weights, only PyTorch .bin pickles: pass --allow-pickle-weights",
    ):
        locate_model(REPO)
    assert fake.downloaded == []
    locate_model(REPO, allow_pickle_weights=True)
    assert fake.downloaded == ["config.json", "pytorch_model.bin"]


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            RepositoryNotFoundError("404", response=response(404)),
            "no such model on the Hugging Face hub .if it is private, set HF_TOKEN or run `hf "
            "auth login`.",
        ),
        (
            GatedRepoError("403", response=response(403)),
            "is gated: accept its terms on https://huggingface.co/tiny-org/tiny-llama and set "
            "HF_TOKEN",
        ),
        (RevisionNotFoundError("404", response=response(404)), "has no revision 'main'"),
        (
            OSError("[Errno 101] Network is unreachable"),
            "fetching it from the hub failed: OSError: .Errno 101. Network is unreachable",
        ),
    ],
)
def test_each_hub_failure_is_one_line_that_says_what_to_do(
    hub_cache: Path,
    online: None,
    llama_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
    message: str,
) -> None:
    use_hub(monkeypatch, FakeHub(hub_cache, model_files(llama_dir), error))
    with pytest.raises(ModelNotFound, match=message) as failed:
        locate_model(REPO)
    assert "\n" not in str(failed.value)


def test_revision_is_refused_for_a_local_path(llama_dir: Path) -> None:
    with pytest.raises(ModelNotFound, match="revision 'v2' applies to hub ids"):
        locate_model(str(llama_dir), revision="v2")


def test_a_path_that_is_no_hub_id_says_both(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFound, match="no such directory or .gguf file, and not a Hugging"):
        locate_model("/nonexistent/model")


@pytest.mark.default_model
async def test_a_gguf_quant_from_the_cache_is_converted_and_served(hub_cache: Path) -> None:
    """The same bytes as the default model, so the conversion the default model's tests made is
    found again (the converted copy is keyed by the file's real path)."""
    write_gguf_repo(hub_cache, default_gguf_path())
    # the default block size: the compiled decode step of the default model's other tests fits
    # (its cache key names the block size), so it is loaded, not compiled again
    config = prepare_model(serve_config(f"{GGUF_REPO}:Q4_K_M", num_threads=2, block_size=16))
    assert resolve_model_dir(config.model) == resolve_model_dir(None)
    ctx = build_serving_context(config)
    try:
        transport = httpx.ASGITransport(app=create_app(ctx=ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
            r = await client.post("/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == f"{GGUF_REPO}:Q4_K_M"
        assert r.json()["choices"][0]["text"] == " the capital of the"  # the base model, greedy
    finally:
        ctx.engine.shutdown()


# ---- LoRA adapters by hub id ------------------------------------------------------------------
ADAPTER_REPO = "tiny-org/tiny-llama-lora"


@pytest.fixture(scope="module")
def adapter_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.lora_adapters import make_adapter

    return make_adapter(llama_dir, tmp_path_factory.mktemp("hub_adapter") / "a", r=4, scale=30.0)


def adapter_files(adapter_dir: Path) -> dict[str, Path]:
    return {p.name: p for p in adapter_dir.iterdir() if p.name in hub.ADAPTER_FILES}


def _greedy(engine: object, name: str) -> list[int]:
    from decoding import DecodingParams
    from tests.engine_driver import run_to_completion, submit

    params = DecodingParams(max_tokens=6, temperature=0, ignore_eos=True)
    got = submit(engine, name, [5, 9, 13, 17], params, name)  # type: ignore[arg-type]
    run_to_completion(engine)  # type: ignore[arg-type]
    return got.token_ids


def test_an_adapter_hub_id_loads_from_the_cache_offline(
    hub_cache: Path, llama_dir: Path, adapter_dir: Path
) -> None:
    from server.bootstrap import locate_adapters
    from tests.conftest import make_engine

    snapshot = write_snapshot(
        hub_cache, ADAPTER_REPO, adapter_files(adapter_dir), commit_of("lora"), refs=("main",)
    )
    assert locate_adapters({"a": ADAPTER_REPO}, "tiny") == {"a": str(snapshot)}
    engine = make_engine(llama_dir, max_loras=2)
    engine.load_adapter("by-id", ADAPTER_REPO)
    engine.load_adapter("by-dir", str(adapter_dir))
    assert engine.adapter_names() == {"by-id": ADAPTER_REPO, "by-dir": str(adapter_dir)}
    assert _greedy(engine, "by-id") == _greedy(engine, "by-dir")


def test_an_adapter_hub_id_offline_and_not_cached_says_so(hub_cache: Path, llama_dir: Path) -> None:
    from server.bootstrap import locate_adapters
    from server.model.lora.files import AdapterError
    from tests.conftest import make_engine

    engine = make_engine(llama_dir, max_loras=1)
    with pytest.raises(AdapterError, match="HF_HUB_OFFLINE is set"):
        engine.load_adapter("x", ADAPTER_REPO)
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache"):
        locate_adapters({"x": ADAPTER_REPO}, "tiny")
    with pytest.raises(ModelNotFound, match="the served model's name"):
        locate_adapters({"tiny": "/adapters/x"}, "tiny")


def test_an_adapter_hub_id_is_downloaded_when_online(
    hub_cache: Path,
    online: None,
    llama_dir: Path,
    adapter_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.conftest import make_engine

    fake = use_hub(monkeypatch, FakeHub(hub_cache, adapter_files(adapter_dir)))
    engine = make_engine(llama_dir, max_loras=1)
    engine.load_adapter("remote", ADAPTER_REPO)
    assert sorted(fake.downloaded) == sorted(hub.ADAPTER_FILES)
    assert len(_greedy(engine, "remote")) == 6

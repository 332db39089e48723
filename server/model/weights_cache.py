"""A quantized model's int8 layers kept on disk between starts (`<cache_dir>/weights/`): each
layer's int8 weight and scales, so that a later start does not quantize again, its input scales
where it has them (smoothing.py: a later start does not measure them again either), and its
floating-point weight, which prompt scoring reads (exact_weights.py).

An entry is loaded memory-mapped: its pages are the file's, read when first touched. The int8
weights are touched at every step; the floating-point ones only by a step that scores a prompt, so
a server that never scores never reads them, and the OS may drop them again after one that did.
A first start writes the entry as soon as it has quantized, then maps it in place of its own
floating-point copies.

An entry's key is the model's weight files (where they are, their names, sizes and modification
times), the number format, the dtype the weights were loaded in, the tensor-parallel rank, and
the versions of PyTorch and of beamline's quantization code. An entry that cannot be read is
written again, with a warning; one that cannot be written leaves the floating-point weights in
memory, with a warning too.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path

import torch

from server.model.compile_cache import WEIGHT_SUFFIXES, entry_lock, write_aside
from server.model.int8_products import quantize_per_channel

log = logging.getLogger(__name__)
# name -> (int8 weight, per-output-channel scales, floating-point weight or None, the input
# scales' divisor or None)
Layers = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]


def weights_entry(directory: Path, model_dir: Path, identity: dict[str, str]) -> Path:
    """Where in `directory` the int8 layers of `model_dir`, in the form `identity` names, are
    kept."""
    digest = hashlib.sha256()
    resolved = model_dir.resolve()
    digest.update(str(resolved).encode())
    for path in sorted(resolved.iterdir()):
        if path.suffix in WEIGHT_SUFFIXES:
            stat = path.stat()
            digest.update(f"\n{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    parts = {**identity, "torch": torch.__version__}
    code = Path(__file__).parent
    sources = ("quantization.py", "int8_products.py", "smoothing.py", "calibration_text.txt")
    for name in (*sources, "weights_cache.py"):
        parts[name] = hashlib.sha256(code.joinpath(name).read_bytes()).hexdigest()
    for key, value in sorted(parts.items()):
        digest.update(f"\n{key}={value}".encode())
    return directory / f"{resolved.name}-{digest.hexdigest()[:16]}.pt"


def load_layers(entry: Path) -> Layers | None:
    """The entry's layers, memory-mapped; None when there is none or it cannot be read."""
    if not entry.is_file():
        return None
    try:
        return _mapped(entry)
    except Exception as error:  # a truncated or foreign file: quantize again, and rewrite it
        log.warning("cannot read the cached int8 weights %s (%s): quantizing again", entry, error)
        return None


def _mapped(entry: Path) -> Layers:
    loaded = torch.load(entry, mmap=True, weights_only=True)
    return {name: (q, s, exact, divisor) for name, (q, s, exact, divisor) in loaded.items()}


def save_layers(entry: Path, layers: Layers) -> Layers | None:
    """Write `layers` as `entry` and map it back (so the caller can let its own copies go);
    None when it cannot be written."""
    with entry_lock(entry):
        with contextlib.suppress(Exception):  # another process wrote it meanwhile (no warning:
            return _mapped(entry)  # an unreadable entry was reported already, and is replaced)
        kept = {name: list(tensors) for name, tensors in layers.items()}
        try:
            write_aside(entry, lambda file: torch.save(kept, file))
        except OSError as error:
            log.warning("cannot keep the int8 weights in %s (%s)", entry, error)
            return None
    log.info("int8 weights kept for later starts: %s", entry)
    return load_layers(entry)


class Quantizer:
    """`quantize_per_channel` by layer: a layer the entry holds is taken from it (`loaded`),
    any other is quantized and kept (`made`). `names`: each layer's name by its float weight's
    id; `divisors`: the input scales measured for this start (smoothing.py), by name."""

    def __init__(
        self,
        names: dict[int, str],
        stored: Layers | None,
        divisors: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.names, self.stored, self.divisors = names, stored or {}, divisors or {}
        self.made: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self.loaded = 0

    def divisor(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The input scales of the layer of `weight`: the entry's, or this start's."""
        name = self.names.get(id(weight))
        if name is not None and name in self.stored:
            return self.stored[name][3]
        return self.divisors.get(name) if name is not None else None

    def __call__(
        self, weight: torch.Tensor, divisor: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        name = self.names.get(id(weight))
        if name is not None and name in self.stored:
            self.loaded += 1
            q, scales, _, _ = self.stored[name]
            return q, scales
        q, scales = quantize_per_channel(weight, divisor)
        if name is not None:
            self.made[name] = (q, scales, divisor)
        return q, scales

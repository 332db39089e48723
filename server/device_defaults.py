"""The defaults that depend on the device a server runs on (chosen at start-up)."""

from __future__ import annotations

import logging

from server.config import ServerConfig

log = logging.getLogger(__name__)
# On CUDA a step of 256 rows costs little more than one of 64 (the GPU is far from busy), so the
# batch limits a user leaves unset are raised there; the CPU defaults keep a 2-core step short.
CUDA_DEFAULTS: dict[str, int] = {"max_num_seqs": 256, "max_num_batched_tokens": 2048}


def with_device_defaults(config: ServerConfig, device_type: str) -> ServerConfig:
    """`config` with the CUDA batch limits (CUDA_DEFAULTS) for the keys the user did not set (in
    a file, env var or flag); unchanged on other devices. Applying it twice changes nothing."""
    if device_type != "cuda":
        return config
    unset = {k: v for k, v in CUDA_DEFAULTS.items() if k not in config.model_fields_set}
    if not unset:
        return config
    log.info(
        "CUDA defaults: %s (set them to override)", ", ".join(f"{k} {v}" for k, v in unset.items())
    )
    return config.model_copy(update=unset)  # the keys count as set from now on

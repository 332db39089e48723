"""The machine a benchmark ran on: versions, CPUs, load at the start, the host CPU's identity."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": _loadavg(),
        "cpu": cpu_identity(),
    }
    for mod in ("torch", "transformers", "llama_cpp", "ctranslate2", "httpx"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    info["gpu"] = gpu_name()
    return info


def gpu_name() -> str | None:
    """The first CUDA device's name (GPU figures differ by card: an H100 and an H200 differ in
    memory bandwidth), None without one."""
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        return None


def cpu_identity() -> str:
    """Vendor, family/model and vector extensions of the host CPU. These VMs land on different
    hosts from day to day (an Intel Xeon with AMX one day, an AMD EPYC Zen 4 another), and the
    GEMM paths, so beamline's and HF's speeds, differ by host: a ratio holds for its run's host."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("vendor_id", "model name", "cpu family", "model", "flags"):
                fields.setdefault(key, value.strip())
    except OSError:
        return platform.processor() or "unknown"
    flags = set(fields.get("flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    vector = [f for f in wanted if f in flags]
    return (
        f"{fields.get('vendor_id', '?')} {fields.get('model name', '?')} "
        f"(family {fields.get('cpu family', '?')} model {fields.get('model', '?')}; "
        f"{' '.join(vector) or 'no AVX2'})"
    )


def _loadavg() -> float | None:
    """1-minute load average: other work on the machine shows up here (numbers are then noisy)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None

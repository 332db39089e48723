"""Tests that hold on the CPU only carry `cpu_only` and skip on another device, so the GPU kit's
test step (BEAMLINE_TEST_DEVICE=cuda) reports what CUDA breaks, not what never ran there."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from benchmarks.kit.plans import KIT_TESTS

REPO = Path(__file__).resolve().parents[1]
FAST_FORMATS = "tests.test_engine_correctness::test_fast_weight_formats_run_and_stay_close_to_fp32"
KNOWN = {
    "tests.test_triton_attention::test_backend_choice",  # TRITON_INTERPRET
    f"{FAST_FORMATS}[dtype1-int8]",  # int8 kernels: CPU GEMMs
    f"{FAST_FORMATS}[dtype2-int8-weights]",
    f"{FAST_FORMATS}[dtype3-w8a8]",
    # torch.cuda stood in for
    "tests.test_cuda_graphs::test_capture_uses_one_side_stream_and_one_memory_pool",
    "tests.test_seq2seq_engine::test_an_int8_head_rescores_what_beam_steps_rank",  # int8 head
}


def test_cpu_only_tests_of_the_kit_skip_on_another_device(tmp_path: Path) -> None:
    """Collected under a device that is not the CPU (meta: nothing runs on it), the kit's marked
    tests are all skipped with the reason, and the known CPU-only cases are among them."""
    xml = tmp_path / "marked.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cpu_only"]
    cmd += [f"--junitxml={xml}", *KIT_TESTS]
    env = {**os.environ, "BEAMLINE_TEST_DEVICE": "meta"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cases = ET.parse(xml).getroot().iter("testcase")
    skipped = {}
    for case in cases:
        reason = case.find("skipped")
        node = f"{case.get('classname')}::{case.get('name')}"
        skipped[node] = "" if reason is None else reason.get("message", "")
    assert KNOWN <= set(skipped), sorted(KNOWN - set(skipped))
    assert all("cpu_only: not on BEAMLINE_TEST_DEVICE=meta" in why for why in skipped.values()), (
        skipped
    )

"""The model's process keeps freed host memory: a CPU step's big tensors land on touched pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server.host_memory import glibc

STEPS = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from server.host_memory import keep_freed_memory
    assert keep_freed_memory()

def step():  # three 16 MiB tensors alive at once, as logits, log-probs and candidate scores
    a = torch.ones(4 << 20)
    b = a + 1
    return float((b + 1)[-1])

for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(60):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(glibc() is None, reason="the settings are glibc's (Linux)")
def test_steps_after_the_first_touch_no_new_pages() -> None:
    kept, default = page_faults("keep"), page_faults("default")
    # glibc's defaults hand the blocks back and map them again at every step (600-800 new
    # pages a step here, 60 steps); kept, the first steps' pages are reused (a 16 MiB block's
    # 4096 pages come new only when the heap's top moves: one to three times in a run)
    assert default > 60 * 400
    assert kept <= 4 * 4096 < default

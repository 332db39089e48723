"""The front-end cost report: the table of every mode, the CPU split in cores, the verdict against
the 20% bar, and the counters the server does not expose."""

from __future__ import annotations

import os
from collections.abc import Sequence

from benchmarks.frontend.cpu import ENGINE, EVENT_LOOP, OTHER, WORKERS
from benchmarks.frontend.results import ModeResult

THRESHOLD = 0.20  # the issue's bar: above it, the engine gets its own process

# What the server does not expose, and what is derived instead (see frontend_cost.py's docstring).
MISSING_COUNTERS = [
    "no counter of the time spent inside engine steps (e.g. a step-seconds sum beside `steps`): "
    "over HTTP, ms per step is wall time / steps (idle gaps included) and the engine-alone time "
    "is modelled from timed in-process steps (StepModel); with that counter the share would be "
    "measured in the server itself",
    "the rows-per-step histogram (EngineStats.step_seqs_histogram) is not in /v1/engine/stats: "
    "rows per step over HTTP = tokens generated / steps (exact for decode-only steps); the "
    "tokens-per-step histogram of /metrics (beamline:iteration_tokens, powers of 2) gives the "
    "shape",
    "no GIL wait counter: the engine thread's off-CPU time (wall - on CPU - run-queue wait, from "
    "/proc/<pid>/task/<tid>/schedstat) bounds it from above (it also holds idle waits for work)",
]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(modes: Sequence[ModeResult]) -> str:
    head = (
        f"{'mode':<24} {'out tok/s':>9} {'steps/s':>8} {'rows/step':>9} {'ms/step':>8} "
        f"{'timed ms':>8} {'alone ms':>8} {'FE share':>8} {'CPU low-high':>12} "
        f"{'rows ratio':>10} {'in flight':>9} {'in steps':>8}"
    )
    lines = [head, "-" * len(head)]
    for m in modes:
        lines.append(
            f"{m.label:<24} {m.out_tok_s:>9.0f} {m.steps_per_s:>8.1f} {m.rows_per_step:>9.1f} "
            f"{m.ms_per_step:>8.2f} {_fmt(m.step_ms_mean, '>8.2f')} "
            f"{_fmt(m.engine_alone_ms_per_step, '>8.2f')} "
            f"{_fmt(m.frontend_share, '>8.0%')} "
            f"{_fmt(m.cpu_share_low, '>5.0%')} - {_fmt(m.cpu_share_high, '<4.0%')} "
            f"{_fmt(m.rows_ratio, '>10.2f')} {_fmt(m.in_flight_mean, '>9.0f')} "
            f"{_fmt(m.in_steps, '>8.0%')}"
        )
    lines += [
        "",
        f"CPU in cores (CPU seconds / wall seconds; the machine has {os.cpu_count()}): the "
        "engine's process and its threads, the client, every other process of the machine; "
        "then the engine thread's wall time: on a CPU, waiting for one, off CPU (GIL, idle)",
    ]
    head = (
        f"{'mode':<24} {'process':>7} {'loop':>5} {'engine':>6} {'torch':>5} {'other':>5} "
        f"{'client':>6} {'others':>6} | {'on CPU':>6} {'runq':>5} {'off CPU':>7}"
    )
    lines += [head, "-" * len(head)]
    for m in modes:
        cpu = m.server_cpu
        wall = cpu.get("wall_s") or 1.0
        g = {k: v / wall for k, v in cpu.get("groups_cpu_s", {}).items()}
        et = cpu.get("engine_thread_time") or {}
        lines.append(
            f"{m.label:<24} {cpu.get('process_cores', 0.0):>7.2f} {g.get(EVENT_LOOP, 0):>5.2f} "
            f"{g.get(ENGINE, 0):>6.2f} {g.get(WORKERS, 0):>5.2f} {g.get(OTHER, 0):>5.2f} "
            f"{_fmt(m.client_cores, '>6.2f')} {_fmt(m.others_cores, '>6.2f')} | "
            f"{_fmt(et.get('on_cpu'), '>6.0%')} {_fmt(et.get('runqueue'), '>5.0%')} "
            f"{_fmt(et.get('off_cpu'), '>7.0%')}"
        )
    return "\n".join(lines)


def verdict(modes: Sequence[ModeResult]) -> str:
    """One line per HTTP mode: the three front-end shares against the issue's 20% bar."""
    lines = []
    for m in modes:
        if m.mode == "in-process" or m.frontend_share is None:
            continue
        low, high = m.cpu_share_low, m.cpu_share_high
        bounds = "-" if low is None or high is None else f"{low:.0%}-{high:.0%}"
        over = [x for x in (m.frontend_share, low) if x is not None and x > THRESHOLD]
        side = "above" if len(over) == 2 else "not clearly above"
        lines.append(
            f"{m.label}: front-end share {m.frontend_share:.0%} of the engine's steps "
            f"(wall time), {bounds} from CPU time: {side} the {THRESHOLD:.0%} bar"
        )
    return "\n".join(lines) or "no HTTP mode was compared"

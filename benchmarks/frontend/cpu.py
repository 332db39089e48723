"""CPU time per process and per thread, from Linux's /proc: what the client, the server's event
loop, its engine thread and torch's workers each used during a run, and where the engine thread's
wall time went (on a CPU, waiting for one, off CPU)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")

# Thread groups of the CPU split.
EVENT_LOOP = "event loop (main thread)"
ENGINE = "engine thread"
WORKERS = "torch workers (native threads of the engine thread)"
OTHER = "other threads"


@dataclass(frozen=True)
class ThreadSample:
    """Cumulative times of one thread: CPU (user + sys, clock ticks), and from schedstat the time
    on a CPU and the time runnable but waiting for one (ns), when the kernel has them."""

    comm: str
    cpu_s: float
    run_s: float | None
    runqueue_s: float | None


def _stat_cpu_s(stat: str) -> float:
    """utime + stime of a /proc stat line (fields 14 and 15; comm may hold spaces)."""
    fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a whole process (every thread, exited ones included)."""
    return _stat_cpu_s(Path(f"/proc/{pid}/stat").read_text())


def system_busy_s() -> float:
    """CPU seconds every core of the machine spent busy since boot (/proc/stat, all processes):
    minus our processes' own, what other processes took during a run (noise, on a shared box)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK  # guest time is already in user


def thread_samples(pid: int) -> dict[int, ThreadSample]:
    samples: dict[int, ThreadSample] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            cpu = _stat_cpu_s((task / "stat").read_text())
            run: float | None = None
            wait: float | None = None
            with contextlib.suppress(OSError, ValueError):
                run_ns, wait_ns, _ = (task / "schedstat").read_text().split()
                run, wait = int(run_ns) / 1e9, int(wait_ns) / 1e9
        except OSError:  # the thread exited while we read it
            continue
        samples[int(task.name)] = ThreadSample(comm, cpu, run, wait)
    return samples


@dataclass
class ThreadCPU:
    tid: int
    name: str
    group: str
    cpu_s: float
    run_s: float | None
    runqueue_s: float | None


def engine_processes(pid: int) -> list[int]:
    """The server's engine process (`--engine-process on`, server/process/) if it has one: a
    spawned child, told apart from multiprocessing's resource tracker by its command line."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                with contextlib.suppress(OSError):
                    if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                        found.append(int(child))
    return found


def server_threads(pids: Sequence[int]) -> tuple[dict[int, ThreadSample], float]:
    """Every thread of the server's processes, and their CPU seconds in all."""
    samples: dict[int, ThreadSample] = {}
    for pid in pids:
        samples.update(thread_samples(pid))
    return samples, sum(process_cpu_s(pid) for pid in pids)


def cpu_split(
    before: dict[int, ThreadSample],
    after: dict[int, ThreadSample],
    process_cpu: float,
    wall_s: float,
    classify: Callable[[int, str], tuple[str, str]],
) -> dict[str, Any]:
    """Per-thread and per-group CPU of one run window, and where the engine thread's wall time
    went: on a CPU, waiting for a CPU (other processes, the client), or off CPU (GIL, idle)."""
    threads = []
    for tid, a in after.items():
        b = before.get(tid)
        name, group = classify(tid, a.comm)

        def delta(x: float | None, y: float | None) -> float | None:
            return None if x is None else x - (y or 0.0)

        threads.append(
            ThreadCPU(
                tid,
                name,
                group,
                a.cpu_s - (b.cpu_s if b else 0.0),
                delta(a.run_s, b.run_s if b else None),
                delta(a.runqueue_s, b.runqueue_s if b else None),
            )
        )
    groups: dict[str, float] = {g: 0.0 for g in (EVENT_LOOP, ENGINE, WORKERS, OTHER)}
    for t in threads:
        groups[t.group] += t.cpu_s
    engine = [t for t in threads if t.group == ENGINE]
    engine_time: dict[str, float] | None = None
    if engine and wall_s > 0:
        e = engine[0]
        on = e.run_s if e.run_s is not None else e.cpu_s
        queued = e.runqueue_s or 0.0
        engine_time = {
            "on_cpu": on / wall_s,
            "runqueue": queued / wall_s,
            "off_cpu": max(0.0, wall_s - on - queued) / wall_s,
        }
    busy = [t for t in threads if t.cpu_s > 0 or (t.run_s or 0) > 1e-3]
    return {
        "wall_s": wall_s,
        "process_cpu_s": process_cpu,
        "process_cores": process_cpu / wall_s if wall_s else 0.0,
        "groups_cpu_s": groups,
        "engine_thread_time": engine_time,
        "threads": [asdict(t) for t in sorted(busy, key=lambda t: -t.cpu_s)],
    }

"""The follower ranks of a tensor-parallel engine: processes the engine's process starts (spawned,
one per device) and supervises.

Each follower loads its share of the model and then runs the driver's plans (plan_broadcast.py)
until the driver says stop. Termination signals are left to the front end, which drains first and
then ends the engine (which stops its followers). A follower whose driver is gone (its lifeline pipe
closes) exits; a follower that dies ends its driver's process at once: a collective would wait for
it (NCCL) or fail mid-step, and the front end, seeing the engine process gone, answers 503 and
fails `/health` (a supervisor such as Kubernetes then restarts the server).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

from tqdm import tqdm

from server.config import ServerConfig
from server.logs import setup_logging
from server.model.devices import pick_device
from server.model.loader import resolve_model_dir
from server.parallel.group import Rendezvous, TPGroup, rank_device
from server.parallel.plan_broadcast import StepFollower
from server.runner_setup import build_runner, set_threads

log = logging.getLogger(__name__)


def _end_this_process(reason: str) -> None:
    log.error("%s: ending the engine (its front end answers 503 from now on)", reason)
    logging.shutdown()
    os._exit(1)


class TPWorkers:
    """Ranks `ranks` of a group of `size`, as child processes, watched from a thread."""

    def __init__(
        self,
        config: ServerConfig,
        ranks: range,
        size: int,
        rendezvous: Rendezvous,
        on_death: Callable[[str], None] = _end_this_process,
        headless: bool = False,
    ) -> None:
        context = mp.get_context("spawn")
        self.on_death = on_death
        self.headless = headless  # a node past the first: the ranks end when the driver says
        self.stopping = False
        self.lifelines: list[Connection] = []
        self.processes = []
        self._child_ends: list[Connection] = []
        for rank in ranks:
            # the child reads its end until this process, the only writer, is gone
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=run_follower,
                args=(config, rank, size, rendezvous, reader),
                name=f"beamline-tp-rank-{rank}",
                daemon=True,
            )
            self.processes.append(process)
            self.lifelines.append(writer)
            self._child_ends.append(reader)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.processes]

    def start(self) -> None:
        # The engine process is a daemon of the front end's, and multiprocessing refuses
        # children to daemons (they end without cleaning up after them). These children end
        # with it all the same: each exits when its lifeline from this process closes.
        mp.current_process().daemon = False
        for process in self.processes:
            process.start()
        for end in self._child_ends:
            end.close()
        threading.Thread(target=self._watch, name="beamline-tp-supervisor", daemon=True).start()

    def _watch(self) -> None:
        """Report the first follower that ends before it was told to (on a headless node, the
        driver's stop ends them all with code 0: only a failure is reported)."""
        sentinels = {p.sentinel: p for p in self.processes}
        while sentinels:
            for sentinel in wait(list(sentinels)):
                process = sentinels.pop(sentinel)  # type: ignore[arg-type]
                process.join(1)
                if self.stopping or (self.headless and process.exitcode == 0):
                    continue
                self.on_death(
                    f"tensor-parallel {process.name} (pid {process.pid}) exited with code "
                    f"{process.exitcode}"
                )
                return

    def join(self, timeout: float = 30.0) -> None:
        """After the driver said stop: wait for every follower, killing what does not end."""
        self.stopping = True
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join(5)


def _exit_with_driver(lifeline: Connection) -> None:
    """A follower's thread: the driver's end of the pipe closes when its process ends."""
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def run_follower(
    config: ServerConfig, rank: int, size: int, rendezvous: Rendezvous, lifeline: Connection
) -> None:
    """A follower's process: join the group, load this rank's share, warm up, follow."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end drains, then ends the engine
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    tqdm.set_lock(threading.RLock())  # no multiprocessing semaphore left to the tracker
    setup_logging(config.log_level, config.log_format)
    threading.Thread(target=_exit_with_driver, args=(lifeline,), daemon=True).start()
    per_node = config.ranks_per_node
    set_threads(config, per_node)
    device = rank_device(pick_device(config.device), rank, per_node)
    group = TPGroup.join(rendezvous, rank, size, device)
    runner = build_runner(config, resolve_model_dir(config.model, config.cache_dir), device, group)
    runner.warm_up()
    StepFollower(group, runner.execute, runner.lora.targets if runner.lora else {}).run()
    group.leave()
    logging.shutdown()
    os._exit(0)


def serve_node(config: ServerConfig) -> int:
    """A node past the first of a multi-node group (`node_rank` > 0): its share of the ranks,
    no HTTP; ends when the driver stops them (0) or when one fails (1, the others killed)."""
    per_node = config.ranks_per_node
    first = config.node_rank * per_node
    resolve_model_dir(config.model, config.cache_dir)  # a GGUF converted once, not per rank
    failed = threading.Event()

    def on_death(reason: str) -> None:
        log.error("%s: ending this node's ranks", reason)
        failed.set()

    rendezvous = Rendezvous.from_env(required=True)
    workers = TPWorkers(
        config,
        range(first, first + per_node),
        config.tensor_parallel_size,
        rendezvous,
        on_death=on_death,
        headless=True,
    )
    workers.start()
    log.info(
        "node %d of %d: ranks %d-%d (pids %s) meet the driver at %s",
        config.node_rank,
        config.nnodes,
        first,
        first + per_node - 1,
        workers.pids,
        rendezvous.url,
    )
    while any(p.is_alive() for p in workers.processes) and not failed.wait(0.5):
        pass
    workers.join(timeout=0 if failed.is_set() else 30)
    return 1 if failed.is_set() else 0

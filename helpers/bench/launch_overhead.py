"""Launch overhead: seconds from a call to results for a trivial worker, ``helpers.engine.launch`` (with
its fork server running, and the first launch that starts it) against
``torch.multiprocessing.spawn`` (the tutorials' way, written out here on purpose as the
baseline) and warm ranks (``helpers.engine.warm_ranks``).

Units: seconds (s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from helpers.engine import free_port, launch
from helpers.engine.internal import stop_fork_server


def trivial_worker(rank: int, world_size: int) -> int:
    """The cheapest worker: returns its rank (for launch-overhead measurements)."""
    return rank


def _spawn_entry(local_rank: int, fn, world_size: int, port: int, queue, backend: str) -> None:
    """What each ``torch.multiprocessing.spawn`` process runs: the hand-written setup that
    ``helpers.engine.launch`` does for you (environment, process group, result back to the caller)."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(local_rank),
                       "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size)})
    dist.init_process_group(backend)
    try:
        queue.put((local_rank, fn(local_rank, world_size)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_launch(fn, world_size: int, backend: str = "gloo") -> list:
    """Run ``fn(rank, world_size)`` with ``torch.multiprocessing.spawn`` (the tutorials' way),
    with a process group, and collect the return values in rank order through a queue.

    For comparison with :func:`helpers.engine.launch` only: no output relay, no timeout, and a
    port picked by binding port 0 first (another process may take it in between).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_spawn_entry, args=(fn, world_size, free_port(), queue, backend), nprocs=world_size, join=True)
    results = dict(queue.get() for _ in range(world_size))
    return [results[r] for r in range(world_size)]


def import_torch_seconds() -> float:
    """Seconds for a fresh Python interpreter to ``import torch`` and exit (a floor for any
    launcher that starts new processes)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


#: Method name of the launches that start the fork server first (:func:`bench_launch_overhead`).
LAUNCH_FIRST = "helpers.engine.launch, first in a kernel (starts the fork server)"


def bench_launch_overhead(world_sizes: Sequence[int] = (2, 4), repeats: int = 3) -> list[dict[str, Any]]:
    """Seconds from the call to the results for :func:`trivial_worker`, per method and world size.

    Methods: ``"helpers.engine.launch"`` (:func:`helpers.engine.launch` with its fork server running:
    torch's elastic agent, ranks forked from a server that imported torch, output relay, error
    handling), :data:`LAUNCH_FIRST` (the same after :func:`helpers.engine.internal.stop_fork_server`:
    what the first launch in a kernel pays, the server's ``import torch`` included),
    ``"torch.multiprocessing.spawn"`` (:func:`spawn_launch`: every rank a fresh interpreter),
    ``"python -c 'import torch'"`` (one fresh interpreter; ``world_size`` 1) and, when 2 is in
    ``world_sizes``, warm ranks (:func:`bench_warm_ranks`: start-up once, then warm calls).
    Where :func:`helpers.engine.fork_server.start_method` is ``"spawn"`` the two launch rows measure the
    same thing.

    Returns:
        one row per measurement: ``method``, ``world_size``, ``repeat``, ``seconds``.
    """
    rows = []
    for rep in range(repeats):
        rows.append({"method": "python -c 'import torch'", "world_size": 1, "repeat": rep,
                     "seconds": import_torch_seconds()})
        for ws in world_sizes:
            for method in (LAUNCH_FIRST, "helpers.engine.launch"):
                if method == LAUNCH_FIRST:
                    stop_fork_server()
                t0 = time.perf_counter()
                got = launch(trivial_worker, ws)
                rows.append({"method": method, "world_size": ws, "repeat": rep,
                             "seconds": time.perf_counter() - t0})
                assert got == list(range(ws)), got
            t0 = time.perf_counter()
            got = spawn_launch(trivial_worker, ws)
            rows.append({"method": "torch.multiprocessing.spawn", "world_size": ws, "repeat": rep,
                         "seconds": time.perf_counter() - t0})
            assert got == list(range(ws)), got
    if 2 in world_sizes:  # side by side with the cold launches of 2 ranks above
        rows += bench_warm_ranks(2, repeats=max(10, repeats))
    return rows


#: Method names of the warm-rank rows (:func:`bench_warm_ranks`).
WARM_START = "helpers.engine start_ranks (engines, torch, group)"
WARM_RUN = "helpers.engine WarmRanks.run (warm)"
#: The same start with ``env=`` set: the engines are fresh interpreters that import torch themselves
#: (:mod:`helpers.engine.warm_ranks_forked` forks them from the fork server otherwise).
WARM_START_FRESH = "helpers.engine start_ranks(env=...) (fresh engines, each imports torch)"


def bench_warm_ranks(world_size: int = 2, repeats: int = 10) -> list[dict[str, Any]]:
    """Seconds to start warm ranks (:func:`helpers.engine.start_ranks`: ipyparallel engines, each
    importing torch, and the process group) and for :func:`trivial_worker` through
    ``WarmRanks.run`` once they are warm (after one untimed call), then one more start with ``env``
    set (:data:`WARM_START_FRESH`), side by side. Same rows as :func:`bench_launch_overhead`."""
    # imported here, not at the top: helpers.engine.warm_ranks imports ipyparallel (about 1 s, measured with
    # python -X importtime), and every rank of every benchmark imports this package
    from helpers.engine import start_ranks

    t0 = time.perf_counter()
    ranks = start_ranks(world_size, activate=False)
    rows = [{"method": WARM_START, "world_size": world_size, "repeat": 0, "seconds": time.perf_counter() - t0}]
    try:
        ranks.run(trivial_worker)
        for rep in range(repeats):
            t0 = time.perf_counter()
            got = ranks.run(trivial_worker)
            rows.append({"method": WARM_RUN, "world_size": world_size, "repeat": rep,
                         "seconds": time.perf_counter() - t0})
            assert got == list(range(world_size)), got
    finally:
        ranks.stop()
    t0 = time.perf_counter()
    fresh = start_ranks(world_size, env={"DDP_LAB_BENCH_FRESH_ENGINES": "1"}, activate=False)
    rows.append({"method": WARM_START_FRESH, "world_size": world_size, "repeat": 0,
                 "seconds": time.perf_counter() - t0})
    try:
        assert fresh.run(trivial_worker) == list(range(world_size))
    finally:
        fresh.stop()
    return rows


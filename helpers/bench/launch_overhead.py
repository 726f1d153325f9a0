"""Launch overhead, seconds from a call to results for a trivial worker: ``helpers.engine.launch``
(fork server running, or started by the call) against ``torch.multiprocessing.spawn`` (the
tutorials' way, written out here as the baseline) and warm ranks. Units: seconds (s).
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


def _timed(method: str, world_size: int, repeat: int, fn, *args, **kwargs) -> tuple[dict[str, Any], Any]:
    """``(row, fn(*args, **kwargs))``: the row holds the seconds the call took."""
    t0 = time.perf_counter()
    got = fn(*args, **kwargs)
    return {"method": method, "world_size": world_size, "repeat": repeat,
            "seconds": time.perf_counter() - t0}, got


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
    for rep in range(repeats):  # a fresh interpreter's import torch: the floor of a cold start
        rows.append(_timed("python -c 'import torch'", 1, rep, subprocess.run,
                           [sys.executable, "-c", "import torch"], check=True)[0])
        for ws in world_sizes:
            stop_fork_server()  # the first launch in a kernel starts it
            for method, fn in ((LAUNCH_FIRST, launch), ("helpers.engine.launch", launch),
                               ("torch.multiprocessing.spawn", spawn_launch)):
                row, got = _timed(method, ws, rep, fn, trivial_worker, ws)
                assert got == list(range(ws)), got
                rows.append(row)
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

    row, ranks = _timed(WARM_START, world_size, 0, start_ranks, world_size, activate=False)
    rows = [row]
    try:
        ranks.run(trivial_worker)
        for rep in range(repeats):
            row, got = _timed(WARM_RUN, world_size, rep, ranks.run, trivial_worker)
            assert got == list(range(world_size)), got
            rows.append(row)
    finally:
        ranks.stop()
    row, fresh = _timed(WARM_START_FRESH, world_size, 0, start_ranks, world_size,
                        env={"DDP_LAB_BENCH_FRESH_ENGINES": "1"}, activate=False)
    rows.append(row)
    try:
        assert fresh.run(trivial_worker) == list(range(world_size))
    finally:
        fresh.stop()
    return rows

"""What the general checks of :mod:`helpers.checks` cost beside the runs they compare, on simulated
ranks (``python -m helpers.bench checks``): :func:`~helpers.checks.against_one_process` on lesson 09's
MLP against its two runs alone, and :func:`~helpers.checks.data_coverage` on one epoch of a
``DataLoader`` with a ``DistributedSampler`` against that epoch alone. Modes take turns.

Units: seconds (s); ``ratio``: the check's seconds over its runs' (medians), against :data:`TARGET`
for ``against_one_process``. Nothing is asserted about the times.
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

#: against_one_process should take at most this many times the two runs alone.
TARGET = 3.0


def loader_epoch(rank: int, world_size: int, items: int = 6400, batch: int = 4) -> None:
    """One epoch of a ``DataLoader`` over ``items`` MNIST-sized images, sharded by ``DistributedSampler``."""
    data = TensorDataset(torch.zeros(items, 1, 28, 28), torch.zeros(items, dtype=torch.int64))
    for _ in DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, world_size, rank)):
        pass


def bench_checks(world_size: int = 64, steps: int = 10, global_batch: int = 256, items: int = 6400,
                 rounds: int = 3, warmup: int = 1) -> list[dict]:
    """Rows ``check, world_size, check_s, runs_s`` (medians over ``rounds``, with min and max),
    ``ratio``, ``target`` and ``largest_difference`` (the one-process comparison's; both ``None`` for
    data_coverage)."""
    from helpers.at_scale import global_batch_steps
    from helpers.bench.common import median, run_interleaved
    from helpers.checks import against_one_process, data_coverage
    from helpers.engine import simulate

    def timed(call):
        def run(n=None):
            t0 = time.perf_counter()
            call()
            return [time.perf_counter() - t0]
        return run

    reports = []
    blocks = {"runs": timed(lambda: (simulate(global_batch_steps, world_size, steps, global_batch),
                                     simulate(global_batch_steps, 1, steps, global_batch))),
              "against_one_process": timed(lambda: reports.append(against_one_process(
                  global_batch_steps, world_size, steps, global_batch))),
              "run": timed(lambda: simulate(loader_epoch, world_size, items)),
              "data_coverage": timed(lambda: data_coverage(loader_epoch, world_size, items))}
    times, _ = run_interleaved(blocks, rounds, warmup=warmup)
    rows = []
    for check, runs, what, target in [("against_one_process", "runs", f"lesson 09's MLP, {steps} steps", TARGET),
                                      ("data_coverage", "run", f"one epoch of {items} items", None)]:
        c, r = times[check], times[runs]
        rows.append({"check": check, "compares": what, "world_size": world_size,
                     "check_s": median(c), "check_min_s": min(c), "check_max_s": max(c),
                     "runs_s": median(r), "runs_min_s": min(r), "runs_max_s": max(r),
                     "ratio": median(c) / median(r), "target": target,
                     "largest_difference": reports[-1].largest if target else None})
    return rows

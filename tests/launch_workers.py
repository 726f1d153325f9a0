"""Worker functions for tests/engine/test_launch.py (importable, so spawned workers can run them).

Run directly under torchrun to check that a launch() worker runs unchanged there::

    torchrun --standalone --nproc-per-node=2 tests/launch_workers.py
"""

import os
import sys

import torch
import torch.distributed as dist

from helpers.engine import main_from_env, worker_device


def report(rank, world_size, offset=0.0):
    """All-reduce rank + offset; return what this rank saw."""
    print(f"hello from rank {rank} of {world_size}")
    print(f"warning-ish line from rank {rank}", file=sys.stderr)
    t = torch.tensor([rank + offset])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world_size": world_size,
        "sum": t.item(),
        "env_rank": int(os.environ["RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "master_port": int(os.environ["MASTER_PORT"]),
        "backend": dist.get_backend(),
        "device": str(worker_device()),
        "threads": torch.get_num_threads(),
    }



def draws(rank, *rest, seed=None):
    """What a rank's random generators give: torch's initial seed and a few draws of torch, numpy
    and Python's ``random`` (after seeding all three with ``seed``, if given). test_fresh_state."""
    import random

    import numpy

    if seed is not None:
        torch.manual_seed(seed)
        numpy.random.seed(seed)
        random.seed(seed)
    return {"initial_seed": torch.initial_seed(), "torch": torch.rand(3).tolist(),
            "numpy": numpy.random.rand(3).tolist(), "random": [random.random() for _ in range(3)]}


def draws_to_file(rank, folder, seed=None):
    """:func:`draws` written to ``folder/<rank>.json`` (plain ``torch.multiprocessing.spawn``
    returns nothing)."""
    import json

    with open(os.path.join(folder, f"{rank}.json"), "w") as f:
        json.dump(draws(rank, seed=seed), f)


def eval_counts_odd(rank, world_size, n_items):
    """helpers.sampler.distributed_eval_counts where item i is right when i is odd (test_sampler)."""
    from helpers.sampler import distributed_eval_counts

    return distributed_eval_counts(lambda idx: sum(i % 2 for i in idx), n_items, rank, world_size)


if __name__ == "__main__":
    result = main_from_env(report, 0.5)
    print(f"TORCHRUN_RESULT {result['rank']} {result['world_size']} {result['sum']}")

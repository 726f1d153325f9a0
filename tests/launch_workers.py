"""Worker functions for tests/test_launch.py (importable, so spawned workers can run them).

Run directly under torchrun to check that a launch() worker runs unchanged there::

    torchrun --standalone --nproc-per-node=2 tests/launch_workers.py
"""

import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from helpers.launch import main_from_env, worker_device


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


def _collective():
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def raise_on(rank, world_size, bad_rank=1):
    """Rank ``bad_rank`` raises before the collective the others wait in."""
    if rank == bad_rank:
        raise ZeroDivisionError(f"deliberate failure on rank {rank}")
    return _collective()


def skip_collective(rank, world_size):
    """Rank 0 returns at once; the others wait forever in an all_reduce."""
    if rank == 0:
        return 0
    return _collective()


def exit_without_result(rank, world_size):
    if rank == 1:
        os._exit(0)
    return _collective()


def sys_exit_3(rank, world_size):
    if rank == 1:
        sys.exit(3)
    return _collective()


def sigkill_self(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _collective()


def unpicklable_result(rank, world_size):
    return threading.Lock() if rank == 1 else rank


if __name__ == "__main__":
    result = main_from_env(report, 0.5)
    print(f"TORCHRUN_RESULT {result['rank']} {result['world_size']} {result['sum']}")

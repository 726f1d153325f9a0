"""Worker functions for tests/engine/test_launch.py and others (importable, so spawned workers can run
them; their frames count as the learner's own code in a timeout's report).

Run directly under torchrun to check that a launch() worker runs unchanged there::

    torchrun --standalone --nproc-per-node=2 tests/launch_workers.py
"""

import os
import sys
import time

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


def accuracy_odd(rank, world_size, n_items):
    """helpers.mnist_train.distributed_accuracy where item i is right when i is odd (test_mnist_train)."""
    from helpers.mnist_train import distributed_accuracy

    model = torch.nn.Linear(1, 2)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([0.0, 1.0]))  # always predicts class 1
    labels = torch.arange(n_items) % 2
    return distributed_accuracy(model, torch.zeros(n_items, 1), labels, rank, world_size, batch_size=2)


def slow_rank(rank, world_size, sleepy_rank=0, seconds=600.0):
    """Rank ``sleepy_rank`` sleeps ``seconds`` in its own code (a slow computation) before an all_reduce
    the others already wait in; returns the sum (float)."""
    t = torch.ones(1)
    if rank == sleepy_rank:
        time.sleep(seconds)  # the sleepy rank is here
    dist.all_reduce(t)  # the other ranks wait here
    return t.item()


def mismatched_collectives(rank, world_size):
    """Rank 0 all-reduces while the others wait in a barrier: neither call completes (a hang)."""
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 0 waits here
    else:
        dist.barrier()  # the others wait here
    return rank


def uneven_ddp(rank, world_size):
    """DDP where rank r has 1 + r batches: rank 1's second step waits in DDP's all-reduce for rank 0,
    which has returned (the uneven-inputs hang)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(2, 1))
    for _ in range(1 + rank):
        model(torch.ones(1, 2)).sum().backward()  # rank 1's second step waits here
    return rank


def leave_children(rank, world_size, folder, fail=False):
    """Start a ``sleep 600`` subprocess and a forked child that sleeps, write their pids to
    ``folder/children.<rank>``, then return them (or raise ``ValueError`` if ``fail``)."""
    import subprocess

    kids = [subprocess.Popen(["sleep", "600"]).pid]
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    kids.append(pid)
    with open(os.path.join(folder, f"children.{rank}"), "w") as f:
        f.write(" ".join(map(str, kids)))
    if fail:
        raise ValueError("injected failure after starting children")
    return kids


def print_lines(rank, world_size, n):
    """Rank 0 prints ``0`` to ``n - 1``, one a line."""
    if rank == 0:
        sys.stdout.write("".join(f"{i}\n" for i in range(n)))


if __name__ == "__main__":
    result = main_from_env(report, 0.5)
    print(f"TORCHRUN_RESULT {result['rank']} {result['world_size']} {result['sum']}")


def fill_folder(rank, world_size, folder):
    """Every rank fills ``folder`` (a small file system) until it is full, then prints: what a checkpoint
    that fills TMPDIR does to the ranks' own output there."""
    try:
        with open(os.path.join(folder, f"fill-{rank}"), "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    except OSError:
        pass
    for i in range(1000):
        print("line", i, "x" * 100)
    return rank


def stops_itself(rank, world_size, bad_rank=1):
    """Rank ``bad_rank`` stops itself (SIGSTOP: state T, as Ctrl-Z does) while the others wait in an all_reduce."""
    if rank == bad_rank:
        time.sleep(0.5)
        os.kill(os.getpid(), __import__("signal").SIGSTOP)
    dist.all_reduce(torch.ones(1))
    return rank


def own_group_of_one(rank, world_size):
    """What a framework told ``devices=1`` does: the ranks' group replaced by one of its own, of 1 rank."""
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def accelerate_state(rank, world_size, cpu=False):
    """accelerate's view of this rank: (distributed type, number of processes)."""
    from accelerate import Accelerator  # requirements.txt

    accelerator = Accelerator(cpu=True) if cpu else Accelerator()
    return accelerator.state.distributed_type.value, accelerator.num_processes

"""What :func:`helpers.replicas.assert_in_sync` costs next to one DDP training step (forward,
backward, optimizer step) of a small MLP, measured side by side in the same ranks: the every-call
check (replicas in sync: one small all-gather) and the full comparison that runs when they differ.

    python -m helpers.bench replicas               # 2 ranks, gloo (nccl with 2 GPUs)
    python -m helpers.bench.replicas_cost          # the same, one line

Each is timed after a barrier: without it, the wait for a rank still in its step would count in
the check, a wait the next step's all-reduce has anyway without the check.

Units: seconds (s); ``check_per_step`` and ``full_per_step`` are ratios; the target for the
every-call check is :data:`TARGET` of a step. Nothing is asserted about the times.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

#: What the every-call check aims to cost, as a fraction of the benchmark's step.
TARGET = 0.1


def _mlp(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def cost_worker(rank: int, world_size: int, width: int = 256, depth: int = 4, batch: int = 64,
                repeats: int = 20) -> dict:
    """Per rank: median seconds of a DDP step, of ``assert_in_sync(ddp)`` (in sync: the every-call
    check) and of the full comparison it runs when the replicas differ, alternated.

    Returns:
        dict: ``world_size``, ``parameters`` (count of elements), ``step_s``, ``check_s``,
        ``check_per_step`` (``check_s / step_s``), ``full_s``, ``full_per_step``, ``target``.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers.bench.common import sync_device
    from helpers.engine import worker_device
    from helpers.replicas import _check, assert_in_sync

    device = worker_device()
    torch.manual_seed(0)
    ddp = DDP(_mlp(width, depth).to(device))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank)).to(device)

    def step():
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()

    def full():
        _check(ddp, False, False, None, 0.0, quick=False)

    step()
    assert_in_sync(ddp)  # warm-up of all three
    full()
    steps, checks, fulls = [], [], []
    for _ in range(repeats):
        for run, times in ((step, steps), (lambda: assert_in_sync(ddp), checks), (full, fulls)):
            dist.barrier()  # a rank still in its step would count in the other's check
            sync_device(device)
            t0 = time.perf_counter()
            run()
            sync_device(device)
            times.append(time.perf_counter() - t0)
    step_s, check_s, full_s = statistics.median(steps), statistics.median(checks), statistics.median(fulls)
    return {"world_size": world_size, "parameters": sum(p.numel() for p in ddp.parameters()),
            "step_s": step_s, "check_s": check_s, "check_per_step": check_s / step_s,
            "full_s": full_s, "full_per_step": full_s / step_s, "target": TARGET}


def bench_replicas_cost(world_size: int = 2, **kwargs) -> dict:
    """:func:`cost_worker` in ``world_size`` fresh ranks (:func:`helpers.engine.launch`); rank 0's row."""
    from helpers.engine import launch

    return launch(cost_worker, world_size, **kwargs)[0]


def summary(row: dict) -> str:
    """One line: the step, the every-call check and the full comparison, each as a ratio."""
    return (f"{row['world_size']} ranks, MLP of {row['parameters']:,} parameters: "
            f"step {row['step_s'] * 1e3:.2f} ms, assert_in_sync {row['check_s'] * 1e3:.3f} ms "
            f"({row['check_per_step']:.3f} x a step; target {row['target']:.2f}), full comparison "
            f"{row['full_s'] * 1e3:.2f} ms ({row['full_per_step']:.2f} x)")


if __name__ == "__main__":
    print(summary(bench_replicas_cost()))

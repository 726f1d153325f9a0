"""What :func:`helpers.replicas.assert_in_sync` costs next to one DDP training step (forward,
backward, optimizer step) of a small MLP, measured side by side in the same ranks.

    python -m helpers.bench.replicas_cost          # 2 ranks, gloo (nccl with 2 GPUs)

Units: seconds (s); ``check_per_step`` is a ratio. Nothing is asserted about the times.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


def _mlp(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def cost_worker(rank: int, world_size: int, width: int = 256, depth: int = 4, batch: int = 64,
                repeats: int = 20) -> dict:
    """Per rank: median seconds of a DDP step and of ``assert_in_sync(ddp)``, alternated.

    Returns:
        dict: ``world_size``, ``parameters`` (count of elements), ``step_s``, ``check_s``,
        ``check_per_step`` (``check_s / step_s``).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from helpers.engine import worker_device
    from helpers.replicas import assert_in_sync

    device = worker_device()
    torch.manual_seed(0)
    ddp = DDP(_mlp(width, depth).to(device))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank)).to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step():
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()

    step()
    assert_in_sync(ddp)  # warm-up of both
    steps, checks = [], []
    for _ in range(repeats):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        t1 = time.perf_counter()
        assert_in_sync(ddp)
        sync()
        checks.append(time.perf_counter() - t1)
        steps.append(t1 - t0)
    step_s, check_s = statistics.median(steps), statistics.median(checks)
    return {"world_size": world_size, "parameters": sum(p.numel() for p in ddp.parameters()),
            "step_s": step_s, "check_s": check_s, "check_per_step": check_s / step_s}


def bench_replicas_cost(world_size: int = 2, **kwargs) -> dict:
    """:func:`cost_worker` in ``world_size`` fresh ranks (:func:`helpers.engine.launch`); rank 0's row."""
    from helpers.engine import launch

    return launch(cost_worker, world_size, **kwargs)[0]


if __name__ == "__main__":
    row = bench_replicas_cost()
    print(f"{row['world_size']} ranks, MLP of {row['parameters']:,} parameters: "
          f"step {row['step_s'] * 1e3:.2f} ms, assert_in_sync {row['check_s'] * 1e3:.2f} ms "
          f"({row['check_per_step']:.2f} x a step)")

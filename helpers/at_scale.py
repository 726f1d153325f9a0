"""Lesson 09's model and DDP worker, shared with the ``simulated`` benchmark (:mod:`helpers.bench.simulated`).

The model is an MNIST-sized MLP, ``784 -> 64 -> 10`` (:data:`MLP_PARAMS` parameters). The worker
runs on real ranks (:func:`helpers.engine.launch`) or simulated ones (:func:`helpers.engine.simulate`)
unchanged.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["HIDDEN", "MLP_PARAMS", "ddp_steps", "global_batch_steps", "mlp", "rank_batch"]

HIDDEN = 64
#: Parameters of :func:`mlp`: 784 * 64 + 64 + 64 * 10 + 10.
MLP_PARAMS = 784 * HIDDEN + HIDDEN + HIDDEN * 10 + 10


def mlp(seed: int = 0) -> nn.Module:
    """``Flatten, Linear(784, 64), ReLU, Linear(64, 10)``, its weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


def rank_batch(rank: int, batch: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch for ``step``: ``batch`` images ``(1, 28, 28)`` and labels, the same on any launcher
    (a generator of their own, seeded from rank and step)."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)


def ddp_steps(rank: int, world_size: int, steps: int = 1, batch: int = 32, lr: float = 0.1) -> dict:
    """DDP on :func:`mlp` for ``steps`` SGD steps, each on :func:`rank_batch`.

    Returns:
        ``grads``: the first step's gradients (after DDP's all-reduce), ``weights``: the parameters after
        the last step, ``step_s``: wall seconds per step after the first (``None`` with one step).
    """
    model = mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    grads, start = None, None
    for step in range(steps):
        if step == 1:
            start = time.perf_counter()
        x, y = rank_batch(rank, batch, step)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        grads = grads or [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
    step_s = None if start is None else (time.perf_counter() - start) / (steps - 1)
    return {"grads": grads, "weights": [p.detach().clone() for p in model.parameters()], "step_s": step_s}


def global_batch_steps(rank: int, world_size: int, steps: int = 10, global_batch: int = 256, lr: float = 0.1) -> None:
    """DDP on :func:`mlp` for ``steps`` SGD steps on one global batch each: step ``s``'s batch is
    :func:`rank_batch` ``(0, global_batch, s)``, and rank ``rank`` trains on its rows
    ``rank::world_size``, so that one process on the whole batch trains the same model (the
    convention of :func:`helpers.checks.against_one_process`)."""
    model = nn.parallel.DistributedDataParallel(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = rank_batch(0, global_batch, step)
        opt.zero_grad()
        F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()
        opt.step()

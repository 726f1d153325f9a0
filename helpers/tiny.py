"""The one-weight model of lessons 06d and 06e, whose every value is worked by hand.

``one()`` is ``Linear(1, 1, bias=False)`` with weight 1: its output is ``w x``, and with the
output itself as the loss the gradient is ``x``. ``x_of(rank)`` is 1 on rank 0 and 3 on rank 1,
so DDP's averaged gradient at 2 ranks is ``(1 + 3) / 2 = 2``. ``checked(model)`` runs the replica
checker and returns its message instead of raising, so that a lesson can show it. Workers that use
them run in launch ranks, which import this module by name.
"""

from __future__ import annotations

import torch
from torch import nn

from helpers.replicas import ReplicasDiverged, assert_in_sync

__all__ = ["one", "x_of", "checked"]


def one(w: float = 1.0) -> nn.Linear:
    """``Linear(1, 1, bias=False)`` with weight ``w`` (float32)."""
    lin = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(w)
    return lin


def x_of(rank: int) -> torch.Tensor:
    """The rank's input, shape (1, 1), float32: 1 on rank 0, 3 on every other rank."""
    return torch.tensor([[1.0 if rank == 0 else 3.0]])


def checked(model: nn.Module, **kwargs) -> str:
    """:func:`helpers.replicas.assert_in_sync`'s message, or ``"ok"`` when every rank holds the same
    model. A collective: every rank calls it. ``kwargs`` go to ``assert_in_sync``."""
    try:
        assert_in_sync(model, **kwargs)
    except ReplicasDiverged as e:
        return str(e)
    return "ok"

"""DDP communication hooks: the byte-count formulas notebook 07b checks its measured counts against.

Notebook 07b writes the hooks, the counting of bytes and the DDP training that measures them in
its cells. What stays here is the arithmetic, independent of that code:

- :class:`HookSpec`: which built-in hook (``torch.distributed.algorithms.ddp_comm_hooks``):
  ``allreduce`` (``default_hooks.allreduce_hook``, documented to behave like DDP without a
  hook; 4 bytes per gradient element), ``fp16`` / ``bf16`` (``fp16_compress_hook`` /
  ``bf16_compress_hook``: 2 bytes per element) or ``powersgd`` (``powerSGD_hook.powerSGD_hook``,
  Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
  Optimization", NeurIPS 2019, https://arxiv.org/abs/1905.13727: an ``n x m`` gradient is
  replaced by ``P`` (``n x r``) and ``Q`` (``m x r``); matrices where that does not save
  ``min_compression_rate`` times, and 1-D tensors, are sent uncompressed; the first
  ``start_powerSGD_iter`` steps use the plain all-reduce);
- :func:`powersgd_compresses` and :func:`expected_bytes_per_step`: the bytes each rank hands to
  ``all_reduce`` per step, by formula.

Reference: https://pytorch.org/docs/stable/ddp_comm_hooks.html. Used by notebook 07b.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["HOOKS", "HookSpec", "powersgd_compresses", "expected_bytes_per_step"]

#: Hook names :class:`HookSpec` accepts.
HOOKS = ("allreduce", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class HookSpec:
    """One communication hook configuration.

    Attributes:
        name: one of :data:`HOOKS`.
        rank: PowerSGD's ``matrix_approximation_rank`` (only for ``"powersgd"``, >= 1).
        start_iter: PowerSGD's ``start_powerSGD_iter``: steps of plain all-reduce first (>= 2,
            torch's minimum with error feedback).
        min_compression_rate: PowerSGD compresses an ``n x m`` matrix only if
            ``(n + m) * rank * min_compression_rate < n * m``.

    Raises:
        ValueError: unknown name, or a PowerSGD rank < 1 or start_iter < 2.
    """

    name: str
    rank: int = 0
    start_iter: int = 10
    min_compression_rate: float = 2.0

    def __post_init__(self) -> None:
        if self.name not in HOOKS:
            raise ValueError(f"unknown hook {self.name!r}; use one of {HOOKS}")
        if self.name == "powersgd":
            if not isinstance(self.rank, int) or self.rank < 1:
                raise ValueError(f"PowerSGD needs rank >= 1, got {self.rank!r}")
            if not isinstance(self.start_iter, int) or self.start_iter < 2:
                raise ValueError(f"PowerSGD start_iter must be an int >= 2 (torch requires it with error "
                                 f"feedback), got {self.start_iter!r}")

    @property
    def label(self) -> str:
        return {"allreduce": "fp32 all-reduce (no compression)", "fp16": "fp16 compression",
                "bf16": "bf16 compression"}.get(self.name, f"PowerSGD rank {self.rank}")


def powersgd_compresses(shape: Sequence[int], rank: int, min_compression_rate: float = 2.0) -> bool:
    """Whether ``powerSGD_hook`` compresses a gradient of this shape: it views it as
    ``n x m`` with ``n = shape[0]``, uses rank ``r = min(n, m, rank)`` and compresses when
    ``(n + m) * r * min_compression_rate < n * m`` (``torch``'s ``_should_compress``)."""
    n = shape[0] if shape else 1
    m = math.prod(shape[1:]) if len(shape) > 1 else 1
    r = min(n, m, rank)
    return (n + m) * r * min_compression_rate < n * m


def expected_bytes_per_step(shapes: Sequence[Sequence[int]], spec: HookSpec, step: int,
                            element_size: int = 4) -> int:
    """Bytes each rank hands to ``all_reduce`` in training step ``step`` (1-based), by formula.

    - ``allreduce``: ``element_size * sum(numel)`` (fp32: 4 bytes per gradient element);
    - ``fp16`` / ``bf16``: ``2 * sum(numel)``, exactly half of fp32;
    - ``powersgd``: the plain all-reduce for steps ``<= start_iter``; afterwards, for each
      gradient viewed as ``n x m`` with ``r = min(n, m, rank)``: ``element_size * (n + m) * r``
      if it is compressed (P and Q), else ``element_size * n * m``.

    Assumes all gradients fit one DDP bucket or that buckets split along tensors (DDP never
    splits a tensor across buckets), which holds for any model.
    """
    numel = [math.prod(s) for s in shapes]
    if spec.name == "allreduce" or (spec.name == "powersgd" and step <= spec.start_iter):
        return element_size * sum(numel)
    if spec.name in ("fp16", "bf16"):
        return 2 * sum(numel)
    total = 0
    for s, k in zip(shapes, numel):
        if powersgd_compresses(s, spec.rank, spec.min_compression_rate):
            n, m = s[0], k // s[0]
            total += (n + m) * min(n, m, spec.rank)
        else:
            total += k
    return element_size * total

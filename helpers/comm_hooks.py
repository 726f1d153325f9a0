"""DDP communication hooks, measured: fp16 / bf16 compression and PowerSGD (notebook 07).

A communication hook replaces DDP's gradient all-reduce: DDP hands each gradient bucket (a flat
``float32`` buffer) to the hook, and the hook returns a future holding the averaged gradients.
The built-in hooks this module compares (``torch.distributed.algorithms.ddp_comm_hooks``):

- ``allreduce``: ``default_hooks.allreduce_hook``, the plain all-reduce, documented to behave
  exactly like DDP without a hook; the baseline (4 bytes per gradient element);
- ``fp16`` / ``bf16``: ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook`` cast the
  bucket to 16 bits, all-reduce, cast back (2 bytes per element);
- ``powersgd``: ``powerSGD_hook.powerSGD_hook`` (Vogels, Karimireddy, Jaggi, "PowerSGD:
  Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019,
  https://arxiv.org/abs/1905.13727): each gradient viewed as an ``n x m`` matrix ``M`` is
  replaced by a rank-``r`` approximation ``P Q^T``; the ranks all-reduce ``P`` (``n x r``) and
  ``Q`` (``m x r``), i.e. ``(n + m) * r`` numbers instead of ``n * m``. Matrices where that does
  not save at least ``min_compression_rate`` times, and all 1-D tensors such as biases, are
  all-reduced uncompressed. The first ``start_powerSGD_iter`` steps use the plain all-reduce;
  error feedback carries what compression dropped into the next step.

How bytes are counted (:class:`AllReduceCounter`): inside a worker, ``torch.distributed.all_reduce``
is wrapped while the training steps run, and every tensor a hook hands to it adds
``numel * element_size`` bytes. That is the payload each rank contributes per step (a ring
all-reduce then sends about ``2 (W-1)/W`` times that per rank over the wire), so by construction
fp16 counts exactly half of fp32, and PowerSGD counts ``4 * ((n + m) * r)`` per compressed matrix
plus ``4 * numel`` for the uncompressed tensors: :func:`expected_bytes_per_step` is that formula.

Reference: https://pytorch.org/docs/stable/ddp_comm_hooks.html

Introduced in notebook 07. Entry point: ``launch(hooks_worker, world_size, config, specs)``.
"""

from __future__ import annotations

import gc
import math
import statistics
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = [
    "HOOKS",
    "HookSpec",
    "DEFAULT_SPECS",
    "AllReduceCounter",
    "register_hook",
    "gradient_shapes",
    "powersgd_compresses",
    "expected_bytes_per_step",
    "hooks_worker",
]

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


#: The comparison of notebook 07: no compression, fp16, bf16, PowerSGD rank 1 and 4.
DEFAULT_SPECS = (HookSpec("allreduce"), HookSpec("fp16"), HookSpec("bf16"),
                 HookSpec("powersgd", rank=1), HookSpec("powersgd", rank=4))


def register_hook(ddp, spec: HookSpec):
    """Register ``spec``'s hook on the DDP model ``ddp`` (before its first backward).

    Returns the hook state (a ``PowerSGDState`` for PowerSGD, else ``None``: the default
    process group).
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if spec.name == "powersgd":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=spec.rank,
                                   start_powerSGD_iter=spec.start_iter,
                                   min_compression_rate=spec.min_compression_rate,
                                   use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return state
    hook = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook}[spec.name]
    ddp.register_comm_hook(None, hook)
    return None


def gradient_shapes(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """Shapes of the gradients DDP communicates (parameters with ``requires_grad``)."""
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad]


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


class AllReduceCounter:
    """Count the bytes handed to ``torch.distributed.all_reduce`` while active (thread-safe).

    Use in a worker process: ``with AllReduceCounter() as counter: ...; counter.bytes``. The
    built-in hooks call ``dist.all_reduce`` (PowerSGD also from future callbacks on another
    thread); while active, that name points at a wrapper that adds ``numel * element_size``
    of the tensor (bytes) and counts the call, then calls the real function. DDP without a
    hook all-reduces from C++ and is *not* seen: register ``allreduce`` instead.

    Attributes:
        bytes: total bytes so far; calls: number of calls so far.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self._lock = threading.Lock()
        self._original = None

    def __enter__(self) -> "AllReduceCounter":
        original = dist.all_reduce
        self._original = original

        def counting_all_reduce(tensor, *args, **kwargs):
            with self._lock:
                self.bytes += tensor.numel() * tensor.element_size()
                self.calls += 1
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        return self

    def __exit__(self, *exc) -> bool:
        dist.all_reduce = self._original
        return False


@contextmanager
def _quiet_powersgd_logs() -> Iterator[None]:
    import logging

    lg = logging.getLogger("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    level = lg.level
    lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        lg.setLevel(level)


def _train_with_hook(spec: HookSpec, rank: int, world_size: int, config, data, device) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler, TensorDataset

    from helpers.mnist_train import build_model, distributed_accuracy

    xtr, ytr, xte, yte = data
    b = config.batch_per_rank(world_size)
    plain = build_model(config.model, config.seed).to(device)
    shapes = gradient_shapes(plain)
    ddp = DDP(plain, device_ids=[device.index] if device.type == "cuda" else None)
    error = None
    try:
        register_hook(ddp, spec)
    except Exception as e:  # noqa: BLE001 - reported as "not available on this backend"
        error = f"{type(e).__name__}: {e}"
    row: dict[str, Any] = {"hook": spec.name, "label": spec.label, "spec": asdict(spec), "rank": rank,
                           "world_size": world_size, "backend": dist.get_backend(), "device": str(device),
                           "error": error, "shapes": shapes}
    if error is not None:
        return row
    sampler = DistributedSampler(TensorDataset(xtr, ytr), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=config.seed)
    total = config.total_steps(xtr.shape[0], world_size)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr)
    losses, step_bytes, step_calls, step_ms = [], [], [], []
    step = 0
    try:
        with AllReduceCounter() as counter:
            for epoch in range(config.epochs):
                if step >= total:
                    break
                sampler.set_epoch(epoch)
                for batch in torch.tensor(list(sampler), dtype=torch.int64).split(b):
                    if step >= total:
                        break
                    batch = batch.to(device)
                    bytes0, calls0 = counter.bytes, counter.calls
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    optimizer.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(ddp(xtr[batch]), ytr[batch])
                    loss.backward()  # the hook runs here, once per bucket
                    optimizer.step()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    step_ms.append(1e3 * (time.perf_counter() - t0))
                    step_bytes.append(counter.bytes - bytes0)
                    step_calls.append(counter.calls - calls0)
                    losses.append(loss.detach())
                    step += 1
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"
        return row
    global_losses = torch.stack(losses).float()
    dist.all_reduce(global_losses)  # outside the counter: one collective for the whole curve
    global_losses /= world_size
    accuracy = distributed_accuracy(ddp.module, xte, yte, rank, world_size, config.eval_batch_size)
    expected = [expected_bytes_per_step(shapes, spec, s + 1) for s in range(step)]
    row.update({
        "steps": step,
        "losses": global_losses.cpu().tolist(),
        "bytes_per_step": step_bytes,
        "calls_per_step": step_calls,
        "expected_bytes_per_step": expected,
        "step_ms": step_ms,
        "median_step_ms": statistics.median(step_ms[1:] or step_ms),
        "test_accuracy": accuracy,
    })
    return row


def hooks_worker(rank: int, world_size: int, config, specs: Sequence[HookSpec] = DEFAULT_SPECS) -> list[dict[str, Any]]:
    """Train notebook 04's MNIST recipe once per hook in ``specs``, in one set of processes.

    Run with ``helpers.launch.launch(hooks_worker, world_size, config, specs)``. For every spec
    the worker builds the model from ``config.seed``, wraps it in DDP, registers the hook and
    trains ``config.total_steps`` steps on the same data order as
    :func:`helpers.mnist_train.ddp_train_worker` (a ``DistributedSampler`` with
    ``seed=config.seed``), with :class:`AllReduceCounter` active around the steps only.

    Args:
        config: :class:`helpers.mnist_train.TrainConfig` (``global_batch_size``, ``lr``,
            ``epochs``, ``max_steps``, ``model``, ``seed``).
        specs: the hooks to compare.

    Returns:
        one dict per spec, in order: ``hook``, ``label``, ``spec`` (dict), ``backend``,
        ``device``, ``error`` (``None``, or why the hook could not run here, e.g. not
        supported by this backend), ``shapes`` (gradient shapes) and, when it ran: ``steps``,
        ``losses`` (global per-step mean cross-entropy, nats), ``bytes_per_step`` (counted,
        this rank), ``calls_per_step`` (all_reduce calls), ``expected_bytes_per_step``
        (:func:`expected_bytes_per_step`), ``step_ms`` (wall time per step, ms),
        ``median_step_ms`` (excluding the first step), ``test_accuracy`` (in [0, 1], all 10,000
        test images).
    """
    from helpers.data import load_mnist
    from helpers.launch import worker_device

    device = worker_device()
    xtr, ytr = load_mnist(train=True, root=config.data_root)
    xte, yte = load_mnist(train=False, root=config.data_root)
    data = (xtr.to(device), ytr.to(device), xte.to(device), yte.to(device))
    rows = []
    with _quiet_powersgd_logs():
        for spec in specs:
            rows.append(_train_with_hook(spec, rank, world_size, config, data, device))
            gc.collect()  # free this DDP model (and its hook state) before the next one
    dist.barrier()
    return rows

"""One model, many processes: how DDP keeps the replicas identical (notebook 02).

Introduced in ``notebooks/02_one_model_many_processes.ipynb``. The toy is the seed's
``Linear(5, 5)``: each rank builds its own copy from ``torch.manual_seed(base_seed + rank)``,
so the copies start **different**; ``DistributedDataParallel(model)`` broadcasts rank 0's
parameters and buffers to every rank at construction; one forward on different data per rank,
an MSE loss, backward (DDP all-reduces and averages the gradients) and one SGD step leave the
replicas identical again, equal to one process stepping with the mean of the ranks' gradients.

:class:`TaggedLinear` adds two pieces of state that show what DDP does **not** synchronise:
a registered buffer (broadcast, like the parameters) and a plain tensor attribute (not part of
``state_dict``, never broadcast: it keeps each rank's own value).

The worker :func:`replicas_worker` is module-level so :func:`helpers.launch.launch` can start it
in fresh processes; it returns CPU tensors and plain Python only.

References: ``torch.nn.parallel.DistributedDataParallel`` docs
(https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html:
"the module's parameters and buffers are broadcast from rank 0 at construction";
``broadcast_buffers=True`` also re-broadcasts buffers at every forward), and the DDP design
note https://pytorch.org/docs/stable/notes/ddp.html.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = [
    "IN_FEATURES",
    "OUT_FEATURES",
    "STAGES",
    "TaggedLinear",
    "make_replica",
    "snapshot",
    "local_gradient",
    "max_cross_rank_diff",
    "all_gather_max_diff",
    "replicas_worker",
]

#: The seed's ``Linear(5, 5)``.
IN_FEATURES = 5
OUT_FEATURES = 5

#: The three moments at which the parameters are recorded, in order.
STAGES = ("before DDP", "after DDP(...)", "after one SGD step")


class TaggedLinear(nn.Linear):
    """``nn.Linear(in_features, out_features)`` that also carries the rank it was built on.

    Extra state (both ``(2,) float32``, filled with ``100 + rank``: 100, not 0, on rank 0, so
    that "rank 0's value" is not mistaken for "reset to zero"):

    * ``rank_buffer``: a **registered buffer** (``register_buffer``): in ``state_dict``, and
      broadcast from rank 0 by DDP at construction (and, with ``broadcast_buffers=True``, before
      every forward);
    * ``rank_attribute``: a **plain tensor attribute**: not a parameter, not a buffer, invisible
      to DDP, so it keeps each rank's own value.

    Parameters ``weight`` ``(out_features, in_features)`` and ``bias`` ``(out_features,)`` are
    initialised exactly like ``nn.Linear`` (from the global RNG).
    """

    def __init__(self, in_features: int, out_features: int, rank: int):
        super().__init__(in_features, out_features)
        self.register_buffer("rank_buffer", torch.full((2,), 100.0 + rank))
        self.rank_attribute = torch.full((2,), 100.0 + rank)


def make_replica(rank: int, base_seed: int = 0, batch_size: int = 4,
                 in_features: int = IN_FEATURES, out_features: int = OUT_FEATURES):
    """Rank ``rank``'s model and data, reproducibly, in any process.

    Seeds the global RNG with ``base_seed + rank`` (``torch.manual_seed``), then draws, in this
    order, the :class:`TaggedLinear` parameters, the inputs ``x`` and the random labels ``y``.
    Calling it in the notebook process rebuilds exactly what rank ``rank`` built in its worker.

    Returns:
        ``(model, x, y)``: ``model`` a :class:`TaggedLinear`; ``x`` ``(batch_size, in_features)``
        and ``y`` ``(batch_size, out_features)``, both ``float32`` (standard normal).

    Raises:
        ValueError: if ``rank < 0`` or ``batch_size < 1``.
    """
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    torch.manual_seed(base_seed + rank)
    model = TaggedLinear(in_features, out_features, rank)
    x = torch.randn(batch_size, in_features)
    y = torch.randn(batch_size, out_features)
    return model, x, y


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of ``weight``, ``bias``, ``rank_buffer`` and ``rank_attribute``.

    ``model`` is a :class:`TaggedLinear` (pass ``ddp_model.module`` for a DDP-wrapped one).
    """
    return {
        "weight": model.weight.detach().cpu().clone(),
        "bias": model.bias.detach().cpu().clone(),
        "rank_buffer": model.rank_buffer.detach().cpu().clone(),
        "rank_attribute": model.rank_attribute.detach().cpu().clone(),
    }


def local_gradient(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """Gradient of ``MSELoss()(x @ weight.T + bias, y)`` (mean reduction) at the given parameters.

    A plain single-process computation, no DDP: the gradient one rank computes on its own data.

    Args:
        weight: ``(out, in) float32``; bias: ``(out,) float32``; x: ``(batch, in)``; y: ``(batch, out)``.

    Returns:
        ``{"weight": (out, in), "bias": (out,)}`` float32 tensors.
    """
    w = weight.detach().clone().requires_grad_(True)
    b = bias.detach().clone().requires_grad_(True)
    loss = nn.functional.mse_loss(x @ w.T + b, y)
    gw, gb = torch.autograd.grad(loss, (w, b))
    return {"weight": gw, "bias": gb}


def max_cross_rank_diff(tensors) -> float:
    """``max_r max |tensors[r] - tensors[0]|`` over a list of same-shaped tensors (one per rank).

    0.0 means bitwise identical on every rank. Raises ``ValueError`` on an empty list.
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("need at least one tensor")
    return max(float((t - tensors[0]).abs().max()) for t in tensors)


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def all_gather_max_diff(model: nn.Module) -> float:
    """Inside a worker: all-gather every rank's flattened parameters and return
    :func:`max_cross_rank_diff` of them (the same number on every rank).

    A collective: every rank of the default process group must call it. With no process group
    (a single process) it returns 0.0.
    """
    flat = _flat_params(model)
    if not (dist.is_available() and dist.is_initialized()):
        return 0.0
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return max_cross_rank_diff(gathered)


def _row(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:+.4f}" for v in t.tolist()) + "]"


def replicas_worker(rank: int, world_size: int, base_seed: int = 0, lr: float = 0.01,
                    batch_size: int = 4) -> dict:
    """The seed's experiment on one rank (run it with ``launch(replicas_worker, world_size, ...)``).

    1. :func:`make_replica` (seed ``base_seed + rank``): its own ``Linear(5, 5)``, ``x``, ``y``;
    2. wrap in ``DistributedDataParallel`` (CPU module, no ``device_ids``; gloo);
    3. one forward on this rank's ``x``, ``MSELoss`` against ``y``, backward (all-reduce of the
       gradients, averaged over ``world_size``), one ``SGD(lr)`` step.

    At each of :data:`STAGES` it records a :func:`snapshot` and, through ``all_gather``, the
    maximum parameter difference across ranks. Prints one line per stage (relayed as
    ``[rank r] ...``).

    Returns:
        dict with ``rank``; ``stages``: ``{stage: snapshot}``; ``all_gather_max_diff``:
        ``{stage: float}``; ``x``, ``y`` (this rank's data); ``loss`` (float, this rank's own
        MSE); ``grad``: ``{"weight", "bias"}`` after DDP's backward (the all-reduced average).
    """
    model, x, y = make_replica(rank, base_seed, batch_size)
    stages, diffs = {}, {}

    def record(stage: str, m: nn.Module) -> None:
        stages[stage] = snapshot(m)
        diffs[stage] = all_gather_max_diff(m)
        print(f"{stage:>20}: weight[0] = {_row(m.weight[0])}  max cross-rank diff = {diffs[stage]:.4g}",
              flush=True)

    record(STAGES[0], model)
    ddp_model = DDP(model)  # broadcasts rank 0's parameters and buffers to every rank
    record(STAGES[1], ddp_model.module)

    opt = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    opt.zero_grad()
    loss = nn.functional.mse_loss(ddp_model(x), y)
    loss.backward()  # DDP: all-reduce (sum) of the gradients, divided by world_size
    grad = {"weight": model.weight.grad.detach().clone(), "bias": model.bias.grad.detach().clone()}
    opt.step()
    print(f"{'loss on my data':>20}: {loss.item():.4f}", flush=True)
    record(STAGES[2], ddp_model.module)
    return {
        "rank": rank,
        "stages": stages,
        "all_gather_max_diff": diffs,
        "x": x,
        "y": y,
        "loss": float(loss.item()),
        "grad": grad,
    }

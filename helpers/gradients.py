"""Gradients under DataParallel (DP) and DistributedDataParallel (DDP) on tiny toys.

Introduced in ``notebooks/01_gradients_dp_vs_ddp.ipynb``. Everything here is small enough to
check by hand:

* the **Linear toy**: ``Linear(2, world_size + 1)``, loss ``(model(x) * labels).sum()``, one
  sample per rank, ``labels`` one-hot on the rank index. The weight gradient of sample ``r``
  is non-zero only in row ``r`` (it equals ``x[r]``), so every row shows which sample it came
  from and what DP (sum over the batch) or DDP (average over ranks) did to it;
* the **scalar toy**: ``y = w * x`` with one weight ``w = 1``, target 0, loss
  ``sum((w x)^2)`` or ``mean((w x)^2)``, one SGD step; it shows what sum versus mean
  reduction does under DDP's gradient averaging.

DDP workers (``ddp_*_worker``) are module-level so that :func:`helpers.launch.launch` can start
them by reference in fresh processes, and torchrun can run them too. Each is
called as ``fn(rank, world_size, ...)`` with the default process group already initialised and
returns CPU tensors / plain Python only.

On CPU, ``torch.nn.DataParallel`` has ``device_ids == []`` and simply calls the wrapped module,
so :class:`EmulatedDataParallel` reproduces, on CPU and clearly labelled as an emulation, what
real DP does on GPUs (scatter, replicate, parallel forward, gather, gradients summed into the
original parameters).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

__all__ = [
    "SCALAR_X",
    "linear_toy_model",
    "linear_toy_batch",
    "linear_toy_loss",
    "single_device_grads",
    "EmulatedDataParallel",
    "scalar_toy_model",
    "scalar_sgd_step",
    "ddp_linear_worker",
    "ddp_scalar_worker",
    "ddp_notebook01_worker",
]

#: The scalar toy's global batch (four samples), from the issue: loss ``sum((w x)^2)`` at
#: ``w = 1`` has gradient ``2 * sum(x^2) = 60``.
SCALAR_X = (-1.0, 2.0, -3.0, 4.0)


# --------------------------------------------------------------------------------------------
# The Linear toy
# --------------------------------------------------------------------------------------------
def linear_toy_model(world_size: int, seed: int = 0, in_features: int = 2) -> nn.Linear:
    """``Linear(in_features, world_size + 1)`` with weights drawn from ``torch.manual_seed(seed)``.

    The extra output row (index ``world_size``) matches no rank's label, so its gradient stays
    zero: a control row. Every call with the same arguments returns identical parameters, on
    every rank. Parameters are ``float32`` on CPU.

    Raises:
        ValueError: if ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    torch.manual_seed(seed)
    return nn.Linear(in_features, world_size + 1)


def linear_toy_batch(
    world_size: int, seed: int = 0, in_features: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of the Linear toy: one sample per rank.

    Returns:
        ``(x, labels)``: ``x`` is ``(world_size, in_features) float32``, small integers in
        ``[-4, 4]`` (readable in a heatmap, exact in float32); ``labels`` is
        ``(world_size, world_size + 1) float32`` with ``labels[r]`` one-hot on index ``r``.
        Sample ``r`` is the one rank ``r`` sees under DDP.

    Raises:
        ValueError: if ``world_size < 1``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randint(-4, 5, (world_size, in_features), generator=gen).float()
    # avoid an all-zero sample: its gradient row would be indistinguishable from the control row
    x[x.abs().sum(dim=1) == 0, 0] = 1.0
    labels = torch.eye(world_size, world_size + 1)
    return x, labels


def linear_toy_loss(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The issue's loss ``(output * labels).sum()``: a 0-dim tensor.

    ``output`` and ``labels`` are ``(batch, out_features)``. Because the loss is a sum over
    samples, its gradient is the sum of the per-sample gradients.
    """
    return (output * labels).sum()


def single_device_grads(
    model: nn.Module, x: torch.Tensor, labels: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Gradient of ``linear_toy_loss(model(x), labels)`` over the whole batch, on one device.

    ``model`` is left untouched (its ``.grad`` fields are restored); returns
    ``{parameter name: gradient}``, detached CPU tensors with the parameters' shapes.
    """
    saved = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    linear_toy_loss(model(x), labels).backward()
    # "+ 0.0" turns the -0.0 entries (0 * negative input) into 0.0 for display
    grads = {n: p.grad.detach().cpu() + 0.0 for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = saved[n]
    return grads


# --------------------------------------------------------------------------------------------
# DataParallel, emulated on CPU
# --------------------------------------------------------------------------------------------
class EmulatedDataParallel(nn.Module):
    """A CPU emulation of ``torch.nn.DataParallel``'s forward/backward data flow (an EMULATION).

    Real ``DataParallel`` (``torch/nn/parallel/data_parallel.py``, ``DataParallel.forward``;
    docs: https://pytorch.org/docs/stable/generated/torch.nn.DataParallel.html) does, per
    forward call, on GPUs ``device_ids``:

    1. **scatter** the inputs along ``dim`` (``scatter_kwargs`` -> ``comm.scatter``, i.e.
       ``tensor.chunk(len(device_ids), dim)``: chunks of ``ceil(batch / n)``, possibly fewer
       chunks than devices);
    2. **replicate** the module onto the first ``len(chunks)`` devices
       (``torch.nn.parallel.replicate``); each replica's parameters are outputs of the
       autograd function ``Broadcast``, i.e. *differentiable copies* of the originals;
    3. **parallel_apply**: run each replica on its chunk (one thread per GPU);
    4. **gather** the outputs onto ``output_device`` (``torch.cat`` along ``dim``).

    The loss is computed by the caller on the gathered output. In ``backward``,
    ``Broadcast.backward`` (``ReduceAddCoalesced``) *sums* the replicas' parameter gradients
    into the original parameters, so the result is the single-device gradient of the
    full-batch loss.

    This emulation keeps exactly that data flow on CPU: chunks come from ``x.chunk``, replica
    parameters are ``p.clone()`` (differentiable; autograd accumulates, i.e. sums, the
    replicas' gradients into ``p``, like ``ReduceAddCoalesced``), replicas run
    **sequentially** through ``torch.func.functional_call`` (so: no speed-up), outputs are
    concatenated. ``torch.nn.parallel.replicate`` itself refuses CPU devices ("Expected a non
    cpu device"), hence the clones. As in real DP with one device, ``num_replicas == 1`` calls
    the module directly.

    After a forward, :attr:`last_chunks` holds the input chunks and :attr:`last_replica_params`
    one ``{name: tensor}`` dict per replica; their ``.grad`` is kept (``retain_grad``) after
    ``backward`` so each replica's contribution can be inspected; they sum to the original
    parameters' ``.grad``.

    Args:
        module: the model; its parameters stay the single source of truth.
        num_replicas: number of emulated devices, ``>= 1``.
        dim: the batch dimension to scatter along and gather on.

    Inputs/outputs: ``forward(x)`` with ``x`` of shape ``(batch, ...)`` returns what
    ``module(x)`` returns for the full batch, ``(batch, ...)``; only a single tensor input and a
    single tensor output are supported (enough for the toys; real DP also scatters
    tuples/dicts of tensors).

    Raises:
        ValueError: if ``num_replicas < 1``, or ``x`` is not a tensor with a non-empty ``dim``.
    """

    def __init__(self, module: nn.Module, num_replicas: int = 2, dim: int = 0) -> None:
        super().__init__()
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.module = module
        self.num_replicas = num_replicas
        self.dim = dim
        self.last_chunks: list[torch.Tensor] = []
        self.last_replica_params: list[dict[str, torch.Tensor]] = []

    def scatter(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Step 1: split ``x`` into ``<= num_replicas`` chunks along ``dim`` (DP's chunking)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.size(self.dim) == 0:
            raise ValueError("EmulatedDataParallel needs one tensor input with a non-empty batch dim")
        return list(x.chunk(self.num_replicas, dim=self.dim))

    def replicate(self, n: int) -> list[dict[str, torch.Tensor]]:
        """Step 2: ``n`` differentiable copies of the parameters (and copies of the buffers)."""
        replicas = []
        for _ in range(n):
            params = {}
            for name, p in self.module.named_parameters():
                copy = p.clone() if torch.is_grad_enabled() else p.detach().clone()
                if copy.requires_grad:
                    copy.retain_grad()
                params[name] = copy
            for name, b in self.module.named_buffers():
                params[name] = b.detach().clone()
            replicas.append(params)
        return replicas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = self.scatter(x)
        self.last_chunks = chunks
        if self.num_replicas == 1:  # real DP: one device -> call the module directly
            self.last_replica_params = [dict(self.module.named_parameters())]
            return self.module(chunks[0])
        replicas = self.replicate(len(chunks))
        self.last_replica_params = replicas
        # Step 3: "parallel" apply, here one replica after the other.
        outputs = [functional_call(self.module, params, (chunk,)) for params, chunk in zip(replicas, chunks)]
        # Step 4: gather.
        return torch.cat(outputs, dim=self.dim)


# --------------------------------------------------------------------------------------------
# The scalar toy (sum versus mean)
# --------------------------------------------------------------------------------------------
def scalar_toy_model(w0: float = 1.0, device: str | torch.device = "cpu") -> nn.Linear:
    """The scalar model ``y = w * x``: ``Linear(1, 1, bias=False)``, ``float64``, ``w = w0``.

    ``float64`` so that printed values read as the hand-computed ones (0.94, not 0.9399999).
    """
    model = nn.Linear(1, 1, bias=False, dtype=torch.float64, device=device)
    with torch.no_grad():
        model.weight.fill_(w0)
    return model


def _scalar_loss(out: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return (out**2).sum()
    if reduction == "mean":
        return (out**2).mean()
    raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")


def scalar_sgd_step(
    x=SCALAR_X,
    reduction: str = "sum",
    lr: float = 1e-3,
    w0: float = 1.0,
    *,
    wrap=None,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """One real ``torch.optim.SGD`` step of the scalar toy in this process.

    Args:
        x: the batch, a sequence of floats or a ``(batch,)`` tensor (made ``(batch, 1) float64``).
        reduction: ``"sum"`` (loss ``sum((w x)^2)``) or ``"mean"`` (loss ``mean((w x)^2)``);
            the target is 0.
        lr: SGD learning rate.
        w0: initial weight.
        wrap: optional ``callable(model) -> module`` whose forward is used instead of the
            model's, e.g. ``torch.nn.DataParallel`` or
            ``lambda m: EmulatedDataParallel(m, 2)``; gradients always land on ``model``.
        device: where the model and batch live (``"cuda"`` for the real-DP branch).

    Returns:
        ``{"grad": dL/dw before the step, "w": w after the step, "loss": loss before the step}``,
        plain floats.

    Raises:
        ValueError: for an unknown ``reduction``.
    """
    model = scalar_toy_model(w0, device)
    fwd = model if wrap is None else wrap(model)
    xt = torch.as_tensor(x, dtype=torch.float64).reshape(-1, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.zero_grad()
    loss = _scalar_loss(fwd(xt), reduction)
    loss.backward()
    grad = model.weight.grad.item()
    opt.step()
    return {"grad": grad, "w": model.weight.item(), "loss": loss.item()}


# --------------------------------------------------------------------------------------------
# DDP workers (run by helpers.launch.launch in world_size processes)
# --------------------------------------------------------------------------------------------
def _device():
    from helpers.launch import worker_device  # imported lazily: only workers need it

    return worker_device()


def ddp_linear_worker(rank: int, world_size: int, x: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> dict:
    """DDP worker: local versus all-reduced gradient of the Linear toy on this rank's sample.

    Rank ``rank`` takes sample ``x[rank]`` / ``labels[rank]`` of the global batch, builds
    ``linear_toy_model(world_size, seed)`` (identical on every rank; DDP would broadcast rank
    0's parameters anyway), computes the gradient of ``linear_toy_loss`` **without DDP** (the
    local gradient), then wraps a fresh copy in ``DistributedDataParallel`` and computes it
    again: DDP's backward all-reduces (sums) the gradients across ranks and divides by
    ``world_size``.

    Args:
        x: ``(world_size, in_features) float32``, the global batch (CPU).
        labels: ``(world_size, world_size + 1) float32``, one-hot rows.
        seed: model initialisation seed.

    Returns:
        dict of CPU ``float32`` tensors: ``"x"`` ``(in_features,)`` (this rank's sample),
        ``"local_weight_grad"`` / ``"ddp_weight_grad"`` ``(world_size + 1, in_features)``,
        ``"local_bias_grad"`` / ``"ddp_bias_grad"`` ``(world_size + 1,)``, and ``"weight"``
        ``(world_size + 1, in_features)`` (the model's parameters before any step).
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if x.shape[0] != world_size:
        raise ValueError(f"x must hold one sample per rank: {x.shape[0]} samples, world_size {world_size}")
    device = _device()
    xr = x[rank : rank + 1].to(device)  # (1, in_features): this rank's shard of the global batch
    lr_ = labels[rank : rank + 1].to(device)

    local = linear_toy_model(world_size, seed, x.shape[1]).to(device)
    grads = single_device_grads(local, xr, lr_)

    model = linear_toy_model(world_size, seed, x.shape[1]).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    linear_toy_loss(ddp(xr), lr_).backward()  # backward triggers the all-reduce of gradients

    print(f"x_r = {xr[0].tolist()}, local grad row {rank} = {grads['weight'][rank].tolist()}, "
          f"after all-reduce = {model.weight.grad[rank].tolist()}")
    return {
        "x": xr[0].cpu(),
        "weight": model.weight.detach().cpu().clone(),
        "local_weight_grad": grads["weight"],
        "local_bias_grad": grads["bias"],
        "ddp_weight_grad": model.weight.grad.detach().cpu().clone(),
        "ddp_bias_grad": model.bias.grad.detach().cpu().clone(),
    }


def ddp_scalar_worker(
    rank: int,
    world_size: int,
    x=SCALAR_X,
    lr: float = 1e-3,
    w0: float = 1.0,
) -> dict[str, dict[str, float]]:
    """DDP worker: one real SGD step of the scalar toy per (loss reduction, loss scaling) case.

    The global batch ``x`` (``len(x)`` samples) is split into ``world_size`` contiguous shards
    of ``len(x) // world_size``; rank ``r`` takes shard ``r``. For each case a fresh
    ``scalar_toy_model(w0)`` (``float64``) is wrapped in ``DistributedDataParallel``, the
    rank's loss is computed on its shard, optionally multiplied by ``world_size`` (the
    "undo DDP's averaging" habit), backpropagated (gradients all-reduced and averaged), and
    one ``torch.optim.SGD(lr)`` step is taken.

    Returns:
        ``{case: {"grad": float, "w": float, "local_loss": float}}`` with cases
        ``"sum"``, ``"mean"``, ``"sum_x_world"``, ``"mean_x_world"``; ``grad`` is the
        all-reduced gradient this rank holds before the step, ``w`` the weight after it.

    Raises:
        ValueError: if ``len(x)`` is not divisible by ``world_size``.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = torch.as_tensor(x, dtype=torch.float64).reshape(-1, 1)
    if x.shape[0] % world_size:
        raise ValueError(f"global batch of {x.shape[0]} samples is not divisible by world_size {world_size}")
    per_rank = x.shape[0] // world_size
    device = _device()
    shard = x[rank * per_rank : (rank + 1) * per_rank].to(device)

    out = {}
    for reduction in ("sum", "mean"):
        for scale_name, scale in (("", 1), ("_x_world", world_size)):
            model = scalar_toy_model(w0, device)
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
            opt = torch.optim.SGD(ddp.parameters(), lr=lr)
            opt.zero_grad()
            loss = _scalar_loss(ddp(shard), reduction) * scale
            loss.backward()
            grad = model.weight.grad.item()
            opt.step()
            out[reduction + scale_name] = {"grad": grad, "w": model.weight.item(), "local_loss": loss.item()}
    print(f"shard {shard.flatten().tolist()}: " + ", ".join(f"{k} grad {v['grad']:g}" for k, v in out.items()))
    return out


def ddp_notebook01_worker(
    rank: int,
    world_size: int,
    x: torch.Tensor,
    labels: torch.Tensor,
    seed: int = 0,
    scalar_x=SCALAR_X,
    lr: float = 1e-3,
) -> dict:
    """Every DDP experiment of notebook 01 in one launch (process start-up costs seconds).

    Runs :func:`ddp_linear_worker` then :func:`ddp_scalar_worker` on this rank; see them for
    argument shapes and dtypes.

    Returns:
        ``{"linear": <ddp_linear_worker result>, "scalar": <ddp_scalar_worker result>}``.
    """
    return {
        "linear": ddp_linear_worker(rank, world_size, x, labels, seed),
        "scalar": ddp_scalar_worker(rank, world_size, scalar_x, lr),
    }

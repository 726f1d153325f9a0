"""DDP in practice: the pitfalls lab (notebook 06). Each pitfall reproduced safely, its fix proven.

Introduced in ``notebooks/06_ddp_pitfalls.ipynb``. Every experiment is small enough to check by
hand and runs on CPU with the gloo backend. The notebook starts few processes (each launch costs
seconds of ``import torch``): :func:`pitfalls_worker` runs the worker side of sections 1-9 in
**one** launch and returns one dict per section; three more workers exist because their point is
what the *launcher* sees (:func:`uneven_hang_worker`: a real hang ended by
:class:`helpers.launch.LaunchTimeout`; :func:`detail_ddp_worker`: a rank killed by a signal;
:func:`init_alone_worker`: a worker traceback relayed by :class:`helpers.launch.WorkerError`),
and :func:`syncbn_gpu_worker` runs only with one GPU per rank.

**Hangs inside one launch.** A section that shows a hang builds its DDP model on a fresh
process group, ``dist.new_group(timeout=collective_timeout_s)``: the rank left waiting raises
gloo's timeout error after a few seconds (instead of gloo's default 30 minutes), the worker
catches it and reports it, and the other sections carry on with the default group. With gloo a
timed-out collective raises an exception in the waiting rank; with NCCL a watchdog tears the
process down instead, so the notebook pins ``backend="gloo"`` for these demonstrations.

Vocabulary: ``rank``, ``world_size``, ``backend``, all-reduce, **bucket** (DDP packs gradients
into buckets of up to ``bucket_cap_mb`` MiB and all-reduces one bucket at a time; every model
here fits in one bucket).

References (torch 2.14.1 was used to check every statement):

* ``DistributedDataParallel``, ``no_sync``, ``find_unused_parameters``, ``static_graph``,
  ``broadcast_buffers`` (deprecated in 2.14 for ``forward_sync_buffers``), ``join``:
  https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html
* DDP communication hooks: https://pytorch.org/docs/stable/ddp_comm_hooks.html
* ``Join``: https://pytorch.org/docs/stable/distributed.algorithms.join.html and
  https://pytorch.org/tutorials/advanced/generic_join.html
* ``SyncBatchNorm``: https://pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html
* saving and loading under DDP:
  https://pytorch.org/tutorials/intermediate/ddp_tutorial.html#save-and-load-checkpoints
* ``TORCH_DISTRIBUTED_DEBUG`` and collective desynchronisation checks:
  https://pytorch.org/docs/stable/distributed.html#debugging-torch-distributed-applications
* ``static_graph`` with an output the loss ignores: pytorch/pytorch issue #97030.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = [
    "PitfallsConfig",
    "ACCUMULATION_VARIANTS",
    "CommCounter",
    "counting_allreduce_hook",
    "accumulation_model",
    "accumulation_batch",
    "accumulation_reference",
    "accumulation_worker",
    "join_inputs",
    "join_expected_grads",
    "join_worker",
    "uneven_hang_worker",
    "TwoHeads",
    "UNUSED_CASES",
    "parse_unused_parameter_error",
    "unused_parameters_worker",
    "unequal_batch_data",
    "unequal_batch_reference",
    "unequal_batch_worker",
    "bn_batches",
    "simulate_bn_buffers",
    "sync_batchnorm_reference",
    "emulated_dp_batchnorm",
    "batchnorm_worker",
    "syncbn_gpu_worker",
    "checkpoint_worker",
    "classifier_model",
    "classification_data",
    "evaluate",
    "EVAL_HANG_CASES",
    "evaluation_worker",
    "seeds_data",
    "seeded_training",
    "seeds_worker",
    "debug_worker",
    "detail_ddp_worker",
    "init_alone_worker",
    "env_var",
    "pitfalls_worker",
    "SECTIONS",
    "config_dict",
    "float32_sum_orders",
    "is_timeout_error",
]


@dataclass(frozen=True)
class PitfallsConfig:
    """Sizes of every experiment of notebook 06 (plain data: it is pickled to the workers).

    Attributes:
        seed: base seed of every model and data set.
        features: input features of the regression toys (sections 1, 6, 7, 8).
        accum_steps: ``k``, micro-batches per optimizer step (section 1).
        micro_batch: samples per micro-batch per rank (section 1).
        lr: SGD learning rate (sections 1, 6, 7, 8).
        join_base_batches: batches of rank 0 in section 2; rank ``r`` gets ``join_base_batches + r``.
        bn_channels, bn_batch, bn_steps: BatchNorm1d channels, samples per rank per step, steps (section 5).
        ckpt_steps: steps before the checkpoint and again after resuming (section 6).
        ckpt_dir: directory for the checkpoint file (section 6); ``None`` skips section 6.
        eval_samples: validation samples, split evenly over the ranks (section 7).
        seed_steps: SGD steps of the seeds experiment (section 8).
        seed_batch: global batch of section 8, split evenly over the ranks.
        seed_features: input features of section 8's ``Linear(seed_features, 1)``.
        aug_std: standard deviation of the Gaussian input "augmentation" noise (section 8).
        collective_timeout_s: seconds a rank waits in a hung collective before gloo raises
            (the process groups of the hang demonstrations only).
    """

    seed: int = 0
    features: int = 4
    accum_steps: int = 4
    micro_batch: int = 2
    lr: float = 0.1
    join_base_batches: int = 2
    bn_channels: int = 3
    bn_batch: int = 8
    bn_steps: int = 3
    ckpt_steps: int = 3
    ckpt_dir: str | None = None
    eval_samples: int = 64
    seed_steps: int = 30
    seed_batch: int = 64
    seed_features: int = 16
    aug_std: float = 0.5
    collective_timeout_s: float = 3.0

    def check(self, world_size: int) -> None:
        """Raise ``ValueError`` naming the setting if ``world_size`` does not fit these sizes."""
        if world_size < 2:
            raise ValueError(f"notebook 06 needs world_size >= 2 (its pitfalls are between ranks), got {world_size}")
        for name in ("eval_samples", "seed_batch"):
            if getattr(self, name) % world_size:
                raise ValueError(f"{name}={getattr(self, name)} is not divisible by world_size={world_size}")
        for name in ("accum_steps", "micro_batch", "join_base_batches", "bn_batch", "bn_steps", "ckpt_steps",
                     "seed_steps", "features", "bn_channels", "seed_features"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.bn_batch < 2:
            raise ValueError("bn_batch must be >= 2 (BatchNorm needs two samples for a variance)")


# ---------------------------------------------------------------------------------------------
# small utilities
# ---------------------------------------------------------------------------------------------
def _device() -> torch.device:
    from helpers.launch import worker_device  # lazily: only workers need it

    return worker_device()


def _wrap(model: nn.Module, **kwargs) -> DDP:
    """``DDP(model)`` on this rank's device (``device_ids`` only on CUDA)."""
    device = _device()
    model = model.to(device)
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)


def _short_timeout_group(seconds: float):
    """A new process group (all ranks) whose collectives time out after ``seconds``.

    Creating a gloo group connects every pair of ranks through the store, under the same
    timeout; a barrier on the default group (long timeout) first lets a rank that is still
    finishing a previous timed-out demonstration catch up.
    """
    dist.barrier()
    return dist.new_group(timeout=datetime.timedelta(seconds=seconds))


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().clone()


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _cpu(p) for n, p in module.named_parameters()}


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else _cpu(p.grad)) for n, p in module.named_parameters()}


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def is_timeout_error(text: str | None) -> bool:
    """Whether an error text is gloo's collective timeout.

    Gloo words it in more than one way for the same event (seen with torch 2.14.1):
    ``"[.../unbound_buffer.cc:129] Timed out waiting 3000ms for send operation to complete"``
    (or ``recv``), and ``"Application timeout caused pair closure"``.
    """
    return text is not None and ("timed out" in text.lower() or "timeout" in text.lower())


@contextlib.contextmanager
def env_var(name: str, value: str) -> Iterator[None]:
    """Set environment variable ``name`` to ``value`` for the ``with`` block, then restore it.

    Workers started by :func:`helpers.launch.launch` inherit the caller's environment, so this
    is how the notebook sets ``TORCH_DISTRIBUTED_DEBUG`` for one launch only.
    """
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# ---------------------------------------------------------------------------------------------
# 1. Gradient accumulation with no_sync()
# ---------------------------------------------------------------------------------------------
#: The accumulation variants of section 1: key -> what the loop does with micro-batches 0..k-1.
ACCUMULATION_VARIANTS = {
    "no_sync_all_but_last": "forward+backward of micro-batches 0..k-2 inside no_sync(), the last outside (correct)",
    "one_big_batch": "no accumulation: one forward/backward on all k micro-batches at once",
    "sync_every_micro_batch": "no no_sync() at all: every backward all-reduces",
    "off_by_one": "sync on the FIRST micro-batch, no_sync() on the others (the bug)",
    "forward_outside": "micro-batches 0..k-2: forward outside no_sync(), backward inside",
    "backward_outside": "micro-batches 0..k-2: forward inside no_sync(), backward outside",
}


class CommCounter:
    """State of :func:`counting_allreduce_hook`: ``calls`` (bucket all-reduces) and ``bytes``."""

    def __init__(self) -> None:
        self.calls = 0
        self.bytes = 0


def counting_allreduce_hook(state, bucket):  # no annotations: DDP checks them, and this module uses postponed ones
    """A DDP communication hook that counts, then does exactly what DDP does by default.

    Register with ``ddp.register_comm_hook(CommCounter(), counting_allreduce_hook)``. DDP calls
    the hook once per **bucket** that is ready to be all-reduced; ``bucket.buffer()`` is the
    flattened gradients of that bucket (its ``numel() * element_size()`` bytes are what one rank
    contributes to the all-reduce). The all-reduce itself is torch's
    ``default_hooks.allreduce_hook`` (all-reduce, then divide by ``world_size``), so gradients
    are unchanged. Source: https://pytorch.org/docs/stable/ddp_comm_hooks.html

    Args:
        state: a :class:`CommCounter`.
        bucket: a ``torch.distributed.GradBucket``.
    Returns:
        ``torch.futures.Future[torch.Tensor]``: the all-reduced bucket, as DDP expects.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buf = bucket.buffer()
    state.calls += 1
    state.bytes += buf.numel() * buf.element_size()
    return default_hooks.allreduce_hook(None, bucket)


def accumulation_model(features: int = 4, seed: int = 0) -> nn.Linear:
    """``Linear(features, 1)``, ``float64`` (so exact-looking comparisons hold), seeded."""
    torch.manual_seed(seed)
    return nn.Linear(features, 1, dtype=torch.float64)


def accumulation_batch(world_size: int, config: PitfallsConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one optimizer step of section 1.

    Returns:
        ``(x, y)``: ``x`` is ``(world_size * accum_steps * micro_batch, features) float64``,
        ``y`` is ``(same, 1) float64`` (a noisy linear target). Rank ``r`` takes the contiguous
        rows ``r * k * b : (r + 1) * k * b`` and cuts them into ``k`` micro-batches of ``b`` rows.
    """
    g = torch.Generator().manual_seed(config.seed + 11)
    n = world_size * config.accum_steps * config.micro_batch
    x = torch.randn(n, config.features, generator=g, dtype=torch.float64)
    w = torch.randn(config.features, 1, generator=g, dtype=torch.float64)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return x, y


def accumulation_reference(world_size: int, config: PitfallsConfig) -> dict[str, torch.Tensor]:
    """Single process: gradient of the mean squared error over the whole global batch.

    Returns ``{"weight": (1, features) float64, "bias": (1,) float64}``.
    """
    x, y = accumulation_batch(world_size, config)
    model = accumulation_model(config.features, config.seed)
    nn.functional.mse_loss(model(x), y).backward()
    return {"weight": _cpu(model.weight.grad), "bias": _cpu(model.bias.grad)}


def _accumulate(ddp: DDP, micro: list[tuple[torch.Tensor, torch.Tensor]], variant: str) -> None:
    """One optimizer step's worth of forward/backward passes in the given variant."""
    k = len(micro)

    def loss_of(out, y):  # each micro-batch loss / k: the sum over k is the mean over k*b rows
        return nn.functional.mse_loss(out, y) / k

    if variant == "one_big_batch":
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        nn.functional.mse_loss(ddp(x), y).backward()
        return
    for j, (x, y) in enumerate(micro):
        last = j == k - 1
        if variant == "no_sync_all_but_last" and not last:
            with ddp.no_sync():
                loss_of(ddp(x), y).backward()
        elif variant == "off_by_one" and j > 0:
            with ddp.no_sync():
                loss_of(ddp(x), y).backward()
        elif variant == "forward_outside" and not last:
            out = ddp(x)
            with ddp.no_sync():
                loss_of(out, y).backward()
        elif variant == "backward_outside" and not last:
            with ddp.no_sync():
                out = ddp(x)
            loss_of(out, y).backward()
        else:  # synchronised micro-batch (and every micro-batch of "sync_every_micro_batch")
            loss_of(ddp(x), y).backward()


def accumulation_worker(rank: int, world_size: int, config: PitfallsConfig) -> dict[str, dict[str, Any]]:
    """Section 1 (worker): one optimizer step with ``k`` micro-batches, in every variant.

    Each variant of :data:`ACCUMULATION_VARIANTS` builds a fresh :func:`accumulation_model`
    wrapped in DDP with :func:`counting_allreduce_hook`, runs the ``k`` micro-batches of this
    rank (loss: MSE / ``k`` per micro-batch), records the gradient, then takes one SGD step.

    ``no_sync()``: "Context manager to disable gradient synchronizations across DDP processes
    ... The forward pass should be included inside the context manager, or else gradients will
    still be synchronized." (https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html#torch.nn.parallel.DistributedDataParallel.no_sync)

    Returns:
        ``{variant: {"grad_weight": (1, features) float64, "grad_bias": (1,) float64,
        "allreduce_calls": int, "allreduce_bytes": int, "weight_after": (1, features),
        "bias_after": (1,)}}`` (CPU tensors).
    """
    x, y = accumulation_batch(world_size, config)
    k, b = config.accum_steps, config.micro_batch
    rows = slice(rank * k * b, (rank + 1) * k * b)
    device = _device()
    micro = [(x[rows][j * b:(j + 1) * b].to(device), y[rows][j * b:(j + 1) * b].to(device)) for j in range(k)]
    out = {}
    for variant in ACCUMULATION_VARIANTS:
        model = accumulation_model(config.features, config.seed)
        ddp = _wrap(model)
        counter = CommCounter()
        ddp.register_comm_hook(counter, counting_allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=config.lr)
        opt.zero_grad(set_to_none=True)
        _accumulate(ddp, micro, variant)
        grads = _grads(model)
        opt.step()
        out[variant] = {
            "grad_weight": grads["weight"],
            "grad_bias": grads["bias"],
            "allreduce_calls": counter.calls,
            "allreduce_bytes": counter.bytes,
            "weight_after": _cpu(model.weight),
            "bias_after": _cpu(model.bias),
        }
    return out


# ---------------------------------------------------------------------------------------------
# 2. Uneven inputs: Join
# ---------------------------------------------------------------------------------------------
def join_inputs(rank: int, base_batches: int = 2) -> list[float]:
    """Rank ``rank``'s scalar inputs in section 2: ``base_batches + rank`` batches of one sample.

    Batch ``i`` of rank ``r`` is the number ``10 * r + i + 1`` (rank 0: 1, 2; rank 1: 11, 12, 13;
    ...), so a gradient value says which ranks contributed. With the model ``y = w * x``
    (``w = 1``) and loss ``y.sum()``, the local gradient of a batch is its ``x``.
    """
    return [float(10 * rank + i + 1) for i in range(base_batches + rank)]


def join_expected_grads(world_size: int, base_batches: int, divide_by_initial_world_size: bool) -> list[list[float]]:
    """What DDP under ``Join`` should give: per rank, the gradient after each of its batches.

    At step ``i`` the *active* ranks ``A_i`` still have a batch; joined ranks shadow the
    all-reduce with zeros. So the gradient is ``sum(x[s][i] for s in A_i)`` divided by
    ``world_size`` (``divide_by_initial_world_size=True``, the default) or by ``len(A_i)``
    (``False``). Returns ``[[grad per step] per rank]`` (plain floats).
    """
    inputs = [join_inputs(r, base_batches) for r in range(world_size)]
    out = []
    for r in range(world_size):
        grads = []
        for i in range(len(inputs[r])):
            active = [s for s in range(world_size) if len(inputs[s]) > i]
            total = sum(inputs[s][i] for s in active)
            grads.append(total / (world_size if divide_by_initial_world_size else len(active)))
        out.append(grads)
    return out


def _scalar_model(device) -> nn.Linear:
    model = nn.Linear(1, 1, bias=False, dtype=torch.float64, device=device)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return model


def _join_run(ddp: DDP, model: nn.Module, inputs: list[float], device, use_join: bool, divide: bool) -> dict:
    from torch.distributed.algorithms.join import Join

    grads: list[float] = []
    t0 = time.perf_counter()
    try:
        with Join([ddp], enable=use_join, divide_by_initial_world_size=divide):
            for x in inputs:
                model.zero_grad(set_to_none=True)
                ddp(torch.tensor([[x]], dtype=torch.float64, device=device)).sum().backward()
                grads.append(model.weight.grad.item())
        error = None
    except RuntimeError as e:  # the collective timed out (no Join): this rank waited for the others
        error = _error_text(e)
    return {"grads": grads, "error": error, "seconds": time.perf_counter() - t0}


def join_worker(rank: int, world_size: int, config: PitfallsConfig) -> dict[str, dict[str, Any]]:
    """Section 2 (worker): ranks with different numbers of batches, with and without ``Join``.

    Rank ``r`` runs :func:`join_inputs` (``join_base_batches + r`` batches) through
    ``DDP(Linear(1, 1, bias=False))`` with ``w = 1``:

    * ``"no_join"``: a plain loop on a process group with a ``collective_timeout_s`` timeout.
      At the step where rank 0 has no batch left, the other ranks wait in the gradient
      all-reduce for rank 0, which never comes: gloo raises after the timeout (a hang in real
      life: gloo's default timeout is 30 minutes);
    * ``"join_divide_initial"`` / ``"join_divide_active"``: the same loop inside
      ``Join([ddp], divide_by_initial_world_size=True / False)``
      (``torch.distributed.algorithms.join.Join``, https://pytorch.org/docs/stable/distributed.algorithms.join.html;
      DDP's ``model.join()`` is the same thing).

    Returns:
        ``{case: {"grads": [float per completed step], "error": str | None, "seconds": float}}``.
    """
    device = _device()
    inputs = join_inputs(rank, config.join_base_batches)
    out = {}
    group = _short_timeout_group(config.collective_timeout_s)
    model = _scalar_model(device)
    out["no_join"] = _join_run(_wrap(model, process_group=group), model, inputs, device, False, True)
    for case, divide in (("join_divide_initial", True), ("join_divide_active", False)):
        model = _scalar_model(device)
        out[case] = _join_run(_wrap(model), model, inputs, device, True, divide)
    return out


def uneven_hang_worker(rank: int, world_size: int, base_batches: int = 2) -> list[float]:
    """Section 2, as the launcher sees it: uneven inputs **without** ``Join`` on the default timeout.

    Same loop as :func:`join_worker`'s ``"no_join"`` case, but the DDP process group has the
    launch's own timeout, so ranks ``1..world_size-1`` wait in the all-reduce of their extra
    batch until :func:`helpers.launch.launch` gives up with ``LaunchTimeout``; rank 0 returns.
    (A separate group keeps the waiting ranks' all-reduce apart from the barrier the launcher
    runs after rank 0's ``fn`` returns.) Returns the gradients (only rank 0 ever returns).
    """
    device = _device()
    group = dist.new_group()
    model = _scalar_model(device)
    ddp = _wrap(model, process_group=group)
    grads = []
    for i, x in enumerate(join_inputs(rank, base_batches)):
        if i >= base_batches:
            print(f"step {i}: rank 0 has no batch {i}; entering backward (its all-reduce waits for rank 0) ...")
        model.zero_grad(set_to_none=True)
        ddp(torch.tensor([[x]], dtype=torch.float64, device=device)).sum().backward()
        grads.append(model.weight.grad.item())
    print(f"finished its {len(grads)} batches")
    return grads


# ---------------------------------------------------------------------------------------------
# 3. Unused parameters
# ---------------------------------------------------------------------------------------------
class TwoHeads(nn.Module):
    """Two heads on the same input; the notebook's loss uses only ``head_a``.

    ``forward(x)``: ``x`` is ``(batch, features) float32``; returns ``(a, b)``, both
    ``(batch, 2)``, or only ``a`` when ``return_b=False`` (``head_b`` is then still computed,
    but its output is dropped). Parameter order (DDP's parameter indices):
    0 ``head_a.weight``, 1 ``head_a.bias``, 2 ``head_b.weight``, 3 ``head_b.bias``.
    """

    def __init__(self, features: int = 2, return_b: bool = True) -> None:
        super().__init__()
        self.head_a = nn.Linear(features, 2)
        self.head_b = nn.Linear(features, 2)
        self.return_b = return_b

    def forward(self, x: torch.Tensor):
        a = self.head_a(x)
        b = self.head_b(x)
        return (a, b) if self.return_b else a


#: Section 3's cases: key -> (DDP keyword arguments, forward returns head_b's output?, debug level).
UNUSED_CASES = {
    "default": ({}, True, "OFF"),
    "default_debug_info": ({}, True, "INFO"),
    "find_unused_parameters": ({"find_unused_parameters": True}, True, "OFF"),
    "static_graph_output_returned": ({"static_graph": True}, True, "OFF"),
    "static_graph_output_dropped": ({"static_graph": True}, False, "OFF"),
}

_UNUSED_RE = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")
_UNUSED_NAMES_RE = re.compile(r"Parameters which did not receive grad for rank (\d+): ([^\n]+)")


def parse_unused_parameter_error(message: str) -> dict[str, Any]:
    """Read DDP's "did not receive grad" error.

    Returns:
        ``{"rank": int | None, "indices": [int], "names": [str] | None}``: the indices DDP names
        (always, in torch 2.14.1) and the parameter names (only printed when the debug level is
        INFO or DETAIL).
    """
    m = _UNUSED_RE.search(message)
    n = _UNUSED_NAMES_RE.search(message)
    return {
        "rank": int(m.group(1)) if m else None,
        "indices": [int(i) for i in m.group(2).split()] if m else [],
        "names": [s.strip() for s in n.group(2).split(",")] if n else None,
    }


def unused_parameters_worker(rank: int, world_size: int, config: PitfallsConfig, iterations: int = 3) -> dict:
    """Section 3 (worker): a model with a head the loss never uses, in every case of :data:`UNUSED_CASES`.

    Iteration ``it`` feeds ``x = full((1, 2), rank + 1 + it)`` and backpropagates
    ``head_a(x).sum()``, so ``head_a.weight``'s local gradient is ``rank + 1 + it`` everywhere
    and its all-reduced gradient is the mean over ranks, ``(world_size + 1) / 2 + it``.
    ``find_unused_parameters=True`` makes DDP traverse the autograd graph after each forward and
    mark parameters without a gradient as ready; ``static_graph=True`` records the graph in the
    first iteration and reuses it (https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html; ``static_graph`` with an output the loss ignores:
    https://github.com/pytorch/pytorch/issues/97030). The debug level (``"INFO"``) is set with
    ``torch.distributed.set_debug_level`` just for that DDP construction: the same as starting
    the process with ``TORCH_DISTRIBUTED_DEBUG=INFO``.

    Returns:
        ``{case: {"grads": [{name: (tensor | None)} per completed iteration], "error": str | None,
        "error_iteration": int | None, "param_names": [str]}}``.
    """
    device = _device()
    out = {}
    for case, (kwargs, return_b, level) in UNUSED_CASES.items():
        torch.manual_seed(config.seed)
        model = TwoHeads(2, return_b=return_b)
        previous = dist.get_debug_level()
        dist.set_debug_level(getattr(dist.DebugLevel, level))
        try:
            ddp = _wrap(model, **kwargs)
        finally:
            dist.set_debug_level(previous)
        record = {"grads": [], "error": None, "error_iteration": None,
                  "param_names": [n for n, _ in model.named_parameters()]}
        for it in range(iterations):
            x = torch.full((1, 2), float(rank + 1 + it), device=device)
            try:
                model.zero_grad(set_to_none=True)
                res = ddp(x)
                a = res[0] if isinstance(res, tuple) else res
                a.sum().backward()
            except RuntimeError as e:
                record["error"] = str(e)
                record["error_iteration"] = it
                break
            record["grads"].append(_grads(model))
        out[case] = record
    return out


# ---------------------------------------------------------------------------------------------
# 4. Unequal per-rank batch sizes
# ---------------------------------------------------------------------------------------------
def unequal_batch_data(world_size: int) -> list[torch.Tensor]:
    """Section 4's shards: rank ``r`` holds ``r + 1`` samples of the global batch ``1, 2, ..., N``.

    ``N = world_size * (world_size + 1) / 2``; for 2 ranks: rank 0 ``[1]``, rank 1 ``[2, 3]``.
    Returns one ``(r + 1,) float64`` tensor per rank.
    """
    x = torch.arange(1, world_size * (world_size + 1) // 2 + 1, dtype=torch.float64)
    return list(x.split([r + 1 for r in range(world_size)]))


def unequal_batch_reference(world_size: int) -> dict[str, float]:
    """Hand formulas for section 4 (model ``y = w x`` at ``w = 1``, per-sample loss ``y^2``, gradient ``2 x^2``).

    Returns ``{"global_mean": 2 * mean(x^2) over all samples, "mean_of_rank_means": the average
    over ranks of 2 * mean(x^2) over each rank's samples}`` (what DDP gives with per-rank mean
    losses).
    """
    shards = unequal_batch_data(world_size)
    x = torch.cat(shards)
    return {
        "global_mean": float(2 * (x**2).mean()),
        "mean_of_rank_means": float(sum(2 * (s**2).mean() for s in shards) / world_size),
    }


def unequal_batch_worker(rank: int, world_size: int, config: PitfallsConfig) -> dict[str, Any]:
    """Section 4 (worker): DDP's gradient with per-rank mean losses versus a correctly weighted loss.

    * ``"naive"``: ``loss = mean over the rank's samples``; DDP then averages the ranks'
      gradients with equal weight ``1 / world_size``, whatever their sample counts.
    * ``"weighted"``: all-reduce the sample count ``N`` first, then
      ``loss = sum over the rank's samples * world_size / N``; DDP's ``1 / world_size`` cancels
      the ``world_size``, leaving ``sum over all samples / N``: the global mean.

    Returns:
        ``{"n_local": int, "n_total": int, "naive": float, "weighted": float}`` (the gradient
        of ``w`` each rank holds after backward).
    """
    device = _device()
    x = unequal_batch_data(world_size)[rank].to(device).reshape(-1, 1)
    out = {"n_local": x.shape[0]}
    n_total = torch.tensor([float(x.shape[0])], dtype=torch.float64, device=device)
    dist.all_reduce(n_total)
    out["n_total"] = int(n_total.item())
    for case in ("naive", "weighted"):
        model = _scalar_model(device)
        ddp = _wrap(model)
        per_sample = ddp(x).pow(2)  # (n_local, 1)
        loss = per_sample.mean() if case == "naive" else per_sample.sum() * world_size / n_total
        loss.sum().backward()
        out[case] = model.weight.grad.item()
    return out


# ---------------------------------------------------------------------------------------------
# 5. BatchNorm
# ---------------------------------------------------------------------------------------------
def bn_batches(rank: int, config: PitfallsConfig) -> list[torch.Tensor]:
    """Rank ``rank``'s ``bn_steps`` batches, each ``(bn_batch, bn_channels) float64``.

    Rank ``r``'s data have mean about ``3 r`` and standard deviation about ``1 + r`` per
    channel, so per-rank statistics visibly differ.
    """
    g = torch.Generator().manual_seed(config.seed * 1000 + 37 * rank + 5)
    return [torch.randn(config.bn_batch, config.bn_channels, generator=g, dtype=torch.float64) * (1 + rank) + 3 * rank
            for _ in range(config.bn_steps)]


def _bn(channels: int) -> nn.BatchNorm1d:
    return nn.BatchNorm1d(channels, dtype=torch.float64)


def _buffers(bn: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _cpu(b) for n, b in bn.named_buffers()}


def simulate_bn_buffers(batches: list[list[torch.Tensor]], broadcast_buffers: bool) -> list[dict[str, torch.Tensor]]:
    """Single-process model of DDP's BatchNorm buffers after training (section 5).

    ``batches[r][t]`` is rank ``r``'s batch at step ``t``. With ``broadcast_buffers=True``,
    DDP broadcasts rank 0's buffers to every rank at the start of each forward (when the
    previous forward ran with gradients enabled, and at the first forward), then each rank
    updates them with its own batch; with ``False`` every rank keeps its own.

    Returns one ``{"running_mean", "running_var", "num_batches_tracked"}`` dict per rank.
    """
    channels = batches[0][0].shape[1]
    mods = [_bn(channels) for _ in batches]
    for t in range(len(batches[0])):
        if broadcast_buffers:
            for m in mods[1:]:
                m.load_state_dict(mods[0].state_dict())
        for m, rank_batches in zip(mods, batches):
            m(rank_batches[t])
    return [_buffers(m) for m in mods]


def sync_batchnorm_reference(x: torch.Tensor, bn: nn.BatchNorm1d, group=None) -> torch.Tensor:
    """What ``SyncBatchNorm`` computes in training, from all-reduced sums (any device, any backend).

    Each rank all-reduces ``[sum(x), sum(x^2), count]`` per channel, so every rank gets the
    mean and (biased) variance of the **global** batch; the output is this rank's rows
    normalised with them, and ``bn``'s running statistics are updated in place with the global
    mean and the unbiased global variance, as ``nn.SyncBatchNorm`` does
    (https://pytorch.org/docs/stable/generated/torch.nn.SyncBatchNorm.html). Collective: every
    rank must call it.

    Args:
        x: ``(local_batch, channels)``, this rank's rows.
        bn: a ``BatchNorm1d(channels)`` whose affine parameters and buffers are used.
    Returns:
        ``(local_batch, channels)``, differentiable in ``x`` locally (the statistics are
        treated as constants: forward values only).
    """
    stats = torch.stack([x.sum(0), (x * x).sum(0), torch.full_like(x[0], x.shape[0])]).detach()
    dist.all_reduce(stats, group=group)
    n = stats[2]
    mean = stats[0] / n
    var = stats[1] / n - mean**2  # biased: what normalisation uses
    with torch.no_grad():
        m = bn.momentum
        bn.running_mean.mul_(1 - m).add_(m * mean)
        bn.running_var.mul_(1 - m).add_(m * var * n / (n - 1))
        bn.num_batches_tracked.add_(1)
    return (x - mean) / torch.sqrt(var + bn.eps) * bn.weight + bn.bias


def emulated_dp_batchnorm(bn: nn.BatchNorm1d, x: torch.Tensor, num_replicas: int) -> torch.Tensor:
    """A CPU EMULATION of ``nn.DataParallel`` around a BatchNorm in training mode (not torch's DP).

    Real DP (``torch/nn/parallel/data_parallel.py`` and ``replicate.py``) scatters ``x`` into
    ``x.chunk(len(device_ids))``, replicates the module per forward and runs each replica on
    its chunk: every replica normalises with **its own chunk's** statistics. The buffers are
    copied to the replicas with ``comm.broadcast_coalesced``, whose outputs for
    ``device_ids[0]`` are the original tensors, so only replica 0's running-statistics update
    lands in the module; the other replicas update copies that are thrown away. This function
    does exactly that on CPU: replica 0 is ``bn`` itself, the others are deep copies.

    Args:
        bn: the module (updated in place from chunk 0 only).
        x: ``(batch, channels)``.
        num_replicas: number of emulated devices.
    Returns:
        ``(batch, channels)``: the chunks' outputs, concatenated (DP's gather).
    """
    chunks = x.chunk(num_replicas)
    outs = [bn(chunks[0])] + [copy.deepcopy(bn)(c) for c in chunks[1:]]
    return torch.cat(outs)


def batchnorm_worker(rank: int, world_size: int, config: PitfallsConfig) -> dict[str, Any]:
    """Section 5 (worker): BatchNorm running statistics under DDP, and SyncBatchNorm on CPU.

    Cases, each a fresh ``BatchNorm1d(bn_channels)`` (``float64``) trained for ``bn_steps``
    steps on :func:`bn_batches`:

    * ``"local"``: no DDP (each rank alone);
    * ``"broadcast_buffers_true"``: ``DDP(bn)`` (the default ``broadcast_buffers=True``);
    * ``"broadcast_buffers_false"``: ``DDP(bn, broadcast_buffers=False)``.

    At construction (torch 2.14.1 deprecates ``broadcast_buffers`` in favour of
    ``forward_sync_buffers``): a BatchNorm whose buffers already differ per rank (one local
    forward) is wrapped with ``broadcast_buffers=False`` (no broadcast at construction either)
    and with ``forward_sync_buffers=False`` (still broadcast at construction); cases
    ``"wrap_broadcast_buffers_false"`` / ``"wrap_forward_sync_buffers_false"`` hold the buffers
    ``"before"`` and ``"after"`` wrapping.

    Then ``nn.SyncBatchNorm.convert_sync_batchnorm`` on a CPU tensor in training mode (raises
    ``ValueError`` in torch 2.14.1: SyncBatchNorm supports CUDA/XPU/HPU/privateuse1 devices
    only) and :func:`sync_batchnorm_reference` on the first batch.

    Returns:
        ``{case: {"running_mean": (C,), "running_var": (C,), "num_batches_tracked": ()}``, the
        two construction cases, ``"syncbn_error": str | None`` and
        ``"syncbn_reference": {"out": (bn_batch, C), buffers...}``.
    """
    device = _device()
    batches = [b.to(device) for b in bn_batches(rank, config)]
    out: dict[str, Any] = {}
    for case, kwargs in (("local", None), ("broadcast_buffers_true", {}),
                         ("broadcast_buffers_false", {"broadcast_buffers": False})):
        bn = _bn(config.bn_channels).to(device)
        model = bn if kwargs is None else _wrap(bn, **kwargs)
        for x in batches:
            (model(x) * torch.arange(1.0, config.bn_channels + 1, dtype=x.dtype, device=device)).sum().backward()
        out[case] = _buffers(bn)
    for case, kwargs in (("wrap_broadcast_buffers_false", {"broadcast_buffers": False}),
                         ("wrap_forward_sync_buffers_false", {"forward_sync_buffers": False})):
        bn = _bn(config.bn_channels).to(device)
        bn(batches[0])  # one local update: the buffers now differ per rank
        before = _buffers(bn)
        _wrap(bn, **kwargs)
        out[case] = {"before": before, "after": _buffers(bn)}
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(_bn(config.bn_channels))).to(device)
    try:
        sync(batches[0])
        out["syncbn_error"] = None
    except ValueError as e:
        out["syncbn_error"] = _error_text(e)
    ref_bn = _bn(config.bn_channels).to(device)
    ref_out = sync_batchnorm_reference(batches[0], ref_bn)
    out["syncbn_reference"] = {"out": _cpu(ref_out), **_buffers(ref_bn)}
    return out


def syncbn_gpu_worker(rank: int, world_size: int, config: PitfallsConfig) -> dict[str, torch.Tensor]:
    """Section 5 on GPUs only (nccl, one GPU per rank): real ``nn.SyncBatchNorm`` on the first batch.

    Returns ``{"out": (bn_batch, C), "running_mean", "running_var"}`` (CPU tensors) to compare
    with :func:`sync_batchnorm_reference`.

    Raises:
        RuntimeError: if this rank's device is not a GPU.
    """
    device = _device()
    if device.type != "cuda":
        raise RuntimeError("syncbn_gpu_worker needs backend='nccl' with one GPU per rank")
    x = bn_batches(rank, config)[0].to(device)
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(_bn(config.bn_channels))).to(device)
    y = sync(x)
    return {"out": _cpu(y), **_buffers(sync[0])}


# ---------------------------------------------------------------------------------------------
# 6. Checkpoints
# ---------------------------------------------------------------------------------------------
def _regression_step_data(rank: int, step: int, config: PitfallsConfig, batch: int = 8):
    g = torch.Generator().manual_seed(config.seed * 7919 + 101 * rank + step)
    x = torch.randn(batch, config.features, generator=g)
    y = torch.stack([x.sum(1), x[:, 0] - x[:, -1]], dim=1)
    return x, y


def _train_steps(ddp: DDP, opt, rank: int, steps: range, config: PitfallsConfig) -> None:
    device = _device()
    for step in steps:
        x, y = _regression_step_data(rank, step, config)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x.to(device)), y.to(device)).backward()
        opt.step()


def checkpoint_worker(rank: int, world_size: int, config: PitfallsConfig) -> dict[str, Any]:
    """Section 6 (worker): the ``module.`` prefix, save on rank 0, barrier, load everywhere, resume.

    1. ``DDP(Linear(features, 2))``: its ``state_dict()`` keys carry the ``module.`` prefix; a
       strict ``load_state_dict`` into a bare ``Linear`` fails with 2 missing and 2 unexpected
       keys (both recorded).
    2. Train ``ckpt_steps`` SGD steps (momentum 0.9); rank 0 alone saves
       ``{"model": ddp.module.state_dict(), "optimizer": opt.state_dict(), "step": n}`` to
       ``<ckpt_dir>/checkpoint.pt``; ``dist.barrier()``; every rank loads it with
       ``map_location=<its device>`` (``weights_only=True``) into a fresh bare model, wraps it in
       DDP and restores the optimizer.
    3. Both the original run and the resumed one take ``ckpt_steps`` more steps on the same data.

    Returns:
        ``{"wrapper_keys", "wrapper_state_dict", "bare_keys", "strict_error", "missing_keys",
        "unexpected_keys", "files", "resumed", "uninterrupted", "loaded_step"}``; parameters and
        state dicts as ``{name: CPU tensor}``.

    Raises:
        ValueError: if ``config.ckpt_dir`` is ``None``.
    """
    if config.ckpt_dir is None:
        raise ValueError("checkpoint_worker needs config.ckpt_dir (a directory every rank can read)")
    device = _device()
    path = os.path.join(config.ckpt_dir, "checkpoint.pt")
    torch.manual_seed(config.seed)
    ddp = _wrap(nn.Linear(config.features, 2))
    out: dict[str, Any] = {"wrapper_keys": list(ddp.state_dict()),
                           "wrapper_state_dict": {k: _cpu(v) for k, v in ddp.state_dict().items()}}
    bare = nn.Linear(config.features, 2)
    out["bare_keys"] = list(bare.state_dict())
    try:
        bare.load_state_dict(ddp.state_dict())
        out["strict_error"] = None
    except RuntimeError as e:
        out["strict_error"] = str(e)
    result = bare.load_state_dict(ddp.state_dict(), strict=False)
    out["missing_keys"], out["unexpected_keys"] = list(result.missing_keys), list(result.unexpected_keys)

    opt = torch.optim.SGD(ddp.parameters(), lr=config.lr, momentum=0.9)
    n = config.ckpt_steps
    _train_steps(ddp, opt, rank, range(n), config)
    if rank == 0:
        torch.save({"model": ddp.module.state_dict(), "optimizer": opt.state_dict(), "step": n}, path)
        print(f"saved {os.path.basename(path)} after step {n}")
    dist.barrier()  # nobody loads before rank 0 has finished writing
    out["files"] = sorted(os.listdir(config.ckpt_dir))
    ckpt = torch.load(path, map_location=device, weights_only=True)
    fresh = nn.Linear(config.features, 2).to(device)
    fresh.load_state_dict(ckpt["model"])  # strict: the keys have no "module." prefix
    resumed = _wrap(fresh)
    opt2 = torch.optim.SGD(resumed.parameters(), lr=config.lr, momentum=0.9)
    opt2.load_state_dict(ckpt["optimizer"])
    out["loaded_step"] = ckpt["step"]

    _train_steps(ddp, opt, rank, range(n, 2 * n), config)
    _train_steps(resumed, opt2, rank, range(n, 2 * n), config)
    out["uninterrupted"] = _params(ddp.module)
    out["resumed"] = _params(resumed.module)
    dist.barrier()  # nobody returns (and lets the caller delete the directory) while others read
    return out


# ---------------------------------------------------------------------------------------------
# 7. Evaluation and logging
# ---------------------------------------------------------------------------------------------
def classifier_model(features: int = 4, seed: int = 0) -> nn.Sequential:
    """``Linear(features, 8) -> BatchNorm1d(8) -> ReLU -> Linear(8, 2)``, seeded; it has buffers."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def classification_data(n: int, config: PitfallsConfig, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-class toy: ``x`` ``(n, features) float32``, labels ``(n,) int64`` = ``x[:, 0] + x[:, 1] > 0``."""
    g = torch.Generator().manual_seed(config.seed * 31 + 17 + offset)
    x = torch.randn(n, config.features, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def evaluate(model: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Evaluate ``model`` (put in eval mode, under ``no_grad``) on ``x`` ``(n, features)``.

    Returns ``{"loss_sum": summed cross-entropy, "correct": int, "count": n}`` as floats, so that
    ranks can all-reduce them and divide once.
    """
    model.eval()
    with torch.no_grad():
        logits = model(x)
        return {
            "loss_sum": float(nn.functional.cross_entropy(logits, labels, reduction="sum")),
            "correct": float((logits.argmax(1) == labels).sum()),
            "count": float(labels.numel()),
        }


#: Section 7's "forward on rank 0 alone" cases: key -> (model, training steps first, how rank 0 calls it).
EVAL_HANG_CASES = {
    "bn_wrapper_eval_no_grad": ("classifier (BatchNorm buffers)", 1, "ddp.eval(); with no_grad: ddp(x)"),
    "bn_module_eval_no_grad": ("classifier (BatchNorm buffers)", 1, "ddp.module.eval(); with no_grad: ddp.module(x)"),
    "linear_wrapper_no_grad": ("Linear (no buffers)", 1, "with no_grad: ddp(x)"),
    "linear_wrapper_grad_after_1_step": ("Linear (no buffers)", 1, "ddp(x), gradients enabled"),
    "linear_wrapper_grad_after_2_steps": ("Linear (no buffers)", 2, "ddp(x), gradients enabled"),
}


def _eval_hang_case(rank: int, case: str, config: PitfallsConfig) -> dict[str, Any]:
    device = _device()
    kind, steps, _ = EVAL_HANG_CASES[case]
    group = _short_timeout_group(config.collective_timeout_s)
    torch.manual_seed(config.seed)
    model = classifier_model(config.features, config.seed) if kind.startswith("classifier") else nn.Linear(config.features, 2)
    ddp = _wrap(model, process_group=group)
    x, labels = classification_data(16, config, offset=rank)
    x, labels = x.to(device), labels.to(device)
    for _ in range(steps):
        nn.functional.cross_entropy(ddp(x), labels).backward()
    if rank != 0:
        return {"result": "did not call", "seconds": 0.0}
    t0 = time.perf_counter()
    try:
        if case == "bn_wrapper_eval_no_grad":
            ddp.eval()
            with torch.no_grad():
                ddp(x)
        elif case == "bn_module_eval_no_grad":
            ddp.module.eval()
            with torch.no_grad():
                ddp.module(x)
        elif case == "linear_wrapper_no_grad":
            with torch.no_grad():
                ddp(x)
        else:
            ddp(x)
        result = "returned"
    except RuntimeError as e:
        result = _error_text(e)
    return {"result": result, "seconds": time.perf_counter() - t0}


def evaluation_worker(rank: int, world_size: int, config: PitfallsConfig) -> dict[str, Any]:
    """Section 7 (worker): distributed evaluation done right, and forwards on rank 0 alone.

    Right: train the :func:`classifier_model` for 2 DDP steps; broadcast rank 0's BatchNorm
    buffers (after training the ranks' running statistics differ, see section 5); each rank
    evaluates ``ddp.module`` on its contiguous shard of ``eval_samples`` validation samples;
    all-reduce ``[loss_sum, correct, count]``; rank 0 prints. Then each case of
    :data:`EVAL_HANG_CASES` on its own short-timeout process group: only rank 0 calls forward.

    Returns:
        ``{"state_dict": rank 0's module state (CPU), "local": evaluate() of the shard,
        "global": {"loss": mean loss, "accuracy": fraction}, "hang_cases": {case: {"result",
        "seconds"}}}``.
    """
    device = _device()
    model = classifier_model(config.features, config.seed)
    ddp = _wrap(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=config.lr)
    for step in range(2):
        x, labels = classification_data(32, config, offset=100 + 10 * step + rank)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(ddp(x.to(device)), labels.to(device)).backward()
        opt.step()
    for b in model.buffers():  # make the running statistics identical on every rank first
        dist.broadcast(b, src=0)
    x_val, y_val = classification_data(config.eval_samples, config, offset=999)
    shard = slice(rank * config.eval_samples // world_size, (rank + 1) * config.eval_samples // world_size)
    local = evaluate(ddp.module, x_val[shard].to(device), y_val[shard].to(device))
    totals = torch.tensor([local["loss_sum"], local["correct"], local["count"]], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    loss, acc = float(totals[0] / totals[2]), float(totals[1] / totals[2])
    if rank == 0:
        print(f"validation: loss {loss:.4f}, accuracy {acc:.3f} over {int(totals[2].item())} samples (all ranks)")
    out = {"state_dict": {k: _cpu(v) for k, v in model.state_dict().items()}, "local": local,
           "global": {"loss": loss, "accuracy": acc}, "hang_cases": {}}
    for case in EVAL_HANG_CASES:
        out["hang_cases"][case] = _eval_hang_case(rank, case, config)
    return out


# ---------------------------------------------------------------------------------------------
# 8. Seeds and determinism
# ---------------------------------------------------------------------------------------------
def seeds_data(config: PitfallsConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed global batch of section 8: ``x`` ``(seed_batch, seed_features) float32``, ``y`` ``(seed_batch, 1)``."""
    g = torch.Generator().manual_seed(config.seed + 2024)
    x = torch.randn(config.seed_batch, config.seed_features, generator=g)
    y = x @ torch.linspace(-1.0, 1.0, config.seed_features).reshape(-1, 1) + 0.5
    return x, y


def _seed_model(config: PitfallsConfig, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(config.seed_features, 1)


def seeded_training(rank: int, world_size: int, config: PitfallsConfig, augment: bool) -> dict[str, Any]:
    """Section 8: ``seed_steps`` SGD steps on the fixed global batch, split over the ranks.

    The model is ``Linear(seed_features, 1)`` initialised from ``torch.manual_seed(seed)`` on every
    rank. With ``augment=True`` each rank adds Gaussian noise (``aug_std``) to its inputs, drawn
    from its own generator seeded with ``seed + 1000 + rank`` (per-rank augmentation seeds).
    With ``world_size == 1`` or no process group it trains the plain model (the single-process
    run the notebook compares with); otherwise DDP.

    Returns:
        ``{"init": {name: tensor}, "final": {name: tensor}, "loss": [clean full-batch MSE before
        each step and after the last]}`` (float32).
    """
    device = _device() if dist.is_available() and dist.is_initialized() else torch.device("cpu")
    x, y = seeds_data(config)
    per = config.seed_batch // world_size
    xr, yr = x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)
    model = _seed_model(config, config.seed).to(device)
    init = _params(model)
    net = _wrap(model) if world_size > 1 else model
    opt = torch.optim.SGD(net.parameters(), lr=config.lr)
    gen = torch.Generator().manual_seed(config.seed + 1000 + rank)
    losses = []
    for _ in range(config.seed_steps):
        with torch.no_grad():
            losses.append(float(nn.functional.mse_loss(model(x.to(device)), y.to(device))))
        inp = xr + config.aug_std * torch.randn(xr.shape, generator=gen).to(device) if augment else xr
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(net(inp), yr).backward()
        opt.step()
    with torch.no_grad():
        losses.append(float(nn.functional.mse_loss(model(x.to(device)), y.to(device))))
    return {"init": init, "final": _params(model), "loss": losses}


def seeds_worker(rank: int, world_size: int, config: PitfallsConfig) -> dict[str, Any]:
    """Section 8 (worker): what seeds do under DDP.

    Returns:
        ``{"init_same_seed": params from manual_seed(seed), "init_rank_seed": params from
        manual_seed(seed + rank) before DDP, "init_rank_seed_after_ddp": the same model after
        DDP(...) (rank 0's, broadcast), "noise_rank_seed": the first (2, features) noise draw
        from a generator seeded with seed + 1000 + rank, "noise_same_seed": the same from seed
        + 1000 on every rank, "plain": seeded_training(augment=False), "augmented":
        seeded_training(augment=True)}``.
    """
    out: dict[str, Any] = {"init_same_seed": _params(_seed_model(config, config.seed))}
    model = _seed_model(config, config.seed + rank)
    out["init_rank_seed"] = _params(model)
    _wrap(model)  # DDP's constructor broadcasts rank 0's parameters and buffers
    out["init_rank_seed_after_ddp"] = _params(model)
    shape = (2, config.seed_features)
    out["noise_rank_seed"] = torch.randn(shape, generator=torch.Generator().manual_seed(config.seed + 1000 + rank))
    out["noise_same_seed"] = torch.randn(shape, generator=torch.Generator().manual_seed(config.seed + 1000))
    out["plain"] = seeded_training(rank, world_size, config, augment=False)
    out["augmented"] = seeded_training(rank, world_size, config, augment=True)
    return out


# ---------------------------------------------------------------------------------------------
# 9. Debugging
# ---------------------------------------------------------------------------------------------
def debug_worker(rank: int, world_size: int, config: PitfallsConfig) -> dict[str, str]:
    """Section 9 (worker): a collective mismatch, without and with the DETAIL debug level.

    Rank ``r`` all-reduces a tensor of ``2 + r`` elements (a shape mismatch: a classic bug when
    ranks disagree about, e.g., a padded length):

    * ``"off"``: on a plain short-timeout group. Gloo's all-reduce does not check shapes; what
      happens depends on sizes and timing (an error from gloo, a timeout, or wrong values);
      recorded as text.
    * ``"detail"``: on a group created while the debug level is DETAIL
      (``dist.set_debug_level(DebugLevel.DETAIL)``, the in-process equivalent of
      ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` for groups created afterwards): DDP's debug wrapper
      (``ProcessGroupWrapper``) compares the collectives' fingerprints across ranks before
      running them and raises ``Detected mismatch between collectives on ranks`` on every rank.

    Returns ``{"off": str, "detail": str}``.
    """
    out = {}
    plain = _short_timeout_group(config.collective_timeout_s)
    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        checked = dist.new_group()
    finally:
        dist.set_debug_level(previous)
    for case, group in (("detail", checked), ("off", plain)):
        t = torch.ones(2 + rank, device=_device())
        try:
            dist.all_reduce(t, group=group)
            out[case] = f"no error; result {t.tolist()}"
        except RuntimeError as e:
            out[case] = _error_text(e)
    return out


def detail_ddp_worker(rank: int, world_size: int) -> str:
    """Construct ``DDP(Linear(2, 2))`` in a process started with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.

    With the gloo backend in torch 2.14.1 this process dies with SIGSEGV inside DDP's
    constructor (``c10d::Logger::set_env_variables``, reached from
    ``Logger.set_construction_data_and_log``): under DETAIL the process group's backend is the
    debug wrapper, not ``ProcessGroupGloo``. Returns ``"constructed"`` on builds where it does not
    crash.
    """
    print(f"debug level in this worker: {dist.get_debug_level()}")
    _wrap(nn.Linear(2, 2))
    return "constructed"


def _free_port() -> int:
    from helpers.procs import free_port

    return free_port()


def init_alone_worker(rank: int, world_size: int, timeout_s: float = 3.0) -> str:
    """Section 9: ``init_process_group`` waiting for a rank that never starts, with a short timeout.

    The launcher has already initialised this worker's group; the worker destroys it and calls
    ``dist.init_process_group("gloo", init_method="tcp://127.0.0.1:<free port>", rank=rank,
    world_size=world_size + 1, timeout=timeout_s)``, as a job would whose ``WORLD_SIZE`` counts
    one process more than were started. Rank 0 hosts the rendezvous store and waits for the
    missing client; the call raises after about ``timeout_s`` seconds. Meant for
    ``launch(init_alone_worker, 1, ...)``.

    Raises:
        torch.distributed.DistStoreError (a ``RuntimeError``): the rendezvous timed out.
    """
    if world_size != 1:
        raise ValueError("init_alone_worker is written for world_size=1 (one process of a job of two)")
    dist.destroy_process_group()
    port = _free_port()
    print(f"init_process_group(world_size={world_size + 1}, rank={rank}, timeout={timeout_s} s) at port {port} ...")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size + 1, timeout=datetime.timedelta(seconds=timeout_s))
    return "initialised"  # not reached when the other process is missing


# ---------------------------------------------------------------------------------------------
# everything at once
# ---------------------------------------------------------------------------------------------
#: Section key of :func:`pitfalls_worker`'s result -> worker function.
SECTIONS = {
    "accumulation": accumulation_worker,
    "join": join_worker,
    "unused": unused_parameters_worker,
    "unequal": unequal_batch_worker,
    "batchnorm": batchnorm_worker,
    "checkpoint": checkpoint_worker,
    "evaluation": evaluation_worker,
    "seeds": seeds_worker,
    "debug": debug_worker,
}


def pitfalls_worker(rank: int, world_size: int, config: PitfallsConfig, sections: tuple[str, ...] | None = None) -> dict:
    """Every worker-side experiment of notebook 06 in one launch (process start-up costs seconds).

    Runs the functions of :data:`SECTIONS` in order (``sections`` selects a subset; section 6 is
    skipped when ``config.ckpt_dir`` is ``None``). Use with ``backend="gloo"``: the hang
    demonstrations rely on gloo raising when a collective times out.

    Returns:
        ``{section: that worker's result, "seconds": {section: float}}``.
    """
    config.check(world_size)
    out: dict[str, Any] = {"seconds": {}}
    for name, fn in SECTIONS.items():
        if sections is not None and name not in sections:
            continue
        if name == "checkpoint" and config.ckpt_dir is None:
            continue
        t0 = time.perf_counter()
        out[name] = fn(rank, world_size, config)
        out["seconds"][name] = time.perf_counter() - t0
    if rank == 0:
        print("sections done: " + ", ".join(f"{k} {v:.1f} s" for k, v in out["seconds"].items()))
    return out


def config_dict(config: PitfallsConfig) -> dict[str, Any]:
    """``dataclasses.asdict(config)``, for display."""
    return asdict(config)


def float32_sum_orders(values=(1e8, 1.0, -1e8, 1.0)) -> dict[str, float]:
    """The same four float32 numbers added in two orders (why "equal" is not "bit-identical").

    ``"left_to_right"``: ``((v0 + v1) + v2) + v3``, one process summing its batch in order;
    ``"pairs"``: ``(v0 + v2) + (v1 + v3)``, two ranks each summing a half, then an all-reduce.
    With the default values (float32 has 24 bits of mantissa, so ``1e8 + 1 == 1e8``): 1.0 and 2.0.
    """
    v = [torch.tensor(x, dtype=torch.float32) for x in values]
    return {"left_to_right": float(((v[0] + v[1]) + v[2]) + v[3]), "pairs": float((v[0] + v[2]) + (v[1] + v[3]))}

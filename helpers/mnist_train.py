"""MNIST training in three modes: one process, ``nn.DataParallel`` and DDP (notebook 04).

The recipe is the seed's: ``Linear(784, 10)`` (or a small CNN) trained with plain SGD on a mean
cross-entropy loss, over the same global batches in the same order in every mode. The parts:

- :mod:`helpers.mnist_config`: :class:`TrainConfig`, :data:`MODELS`, :func:`build_model`,
  :func:`epoch_permutation` (what is trained, on which data order);
- this module: the shared training loop and the three modes, :func:`summarize_ddp`;
- :mod:`helpers.mnist_eval`: :func:`distributed_accuracy`, :func:`peak_rss_mib`.

All of them are importable from here.

Entry points:
    train_single(config)                      -> history   (in the notebook kernel)
    train_dp(config)                          -> history   (in the notebook kernel)
    ddp_train_worker(rank, world_size, config) -> history  (in each worker, via helpers.engine.launch)

From a notebook::

    from helpers.engine import launch
    histories = launch(ddp_train_worker, 2, TrainConfig(max_steps=200))

Under torchrun (same worker, same history on each rank; the one torchrun entry point is
:mod:`helpers.mnist_torchrun`)::

    torchrun --standalone --nproc_per_node=2 -m helpers.mnist_torchrun --max-steps 200

A ``history`` is a plain dict (see :func:`train_single` for its keys) so it crosses process
boundaries and goes straight into a pandas table.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset
from tqdm import tqdm

from helpers.data import load_mnist
from helpers.engine import worker_device
from helpers.mnist_config import MODELS, TrainConfig, build_model, epoch_permutation
from helpers.mnist_eval import cuda_peaks_mib, distributed_accuracy, peak_rss_mib

__all__ = [
    "MODELS",
    "TrainConfig",
    "build_model",
    "ddp_train_worker",
    "distributed_accuracy",
    "epoch_permutation",
    "peak_rss_mib",
    "summarize_ddp",
    "train_dp",
    "train_single",
]


# --------------------------------------------------------------------------------------------
# The shared training loop
# --------------------------------------------------------------------------------------------


class _LineStream:
    """File-like wrapper turning tqdm's carriage-return redraws into whole lines, so that the
    launcher (which relays worker output line by line) shows each refresh, at most one line per
    ``mininterval``."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").rstrip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def _progress(total: int, desc: str, enabled: bool, in_worker: bool):
    """A tqdm bar: ``tqdm.auto`` in the notebook kernel, plain tqdm on stderr in workers (the
    launcher forwards worker stderr to the cell, so bars update rarely there)."""
    if not enabled:
        return None
    if in_worker:
        return tqdm(total=total, desc=desc, file=_LineStream(sys.stderr), mininterval=5.0,
                    ascii=True, unit="step")
    with warnings.catch_warnings():  # without ipywidgets tqdm.auto falls back to text bars
        warnings.simplefilter("ignore")
        from tqdm.auto import tqdm as auto_tqdm  # its import warns (once) when ipywidgets is missing
    return auto_tqdm(total=total, desc=desc, mininterval=0.5, unit="step")


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def _train_loop(
    model: nn.Module,
    plain: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    epoch_indices,
    config: TrainConfig,
    total: int,
    bar,
) -> dict[str, Any]:
    """Run up to ``total`` optimizer steps. ``model`` is what the forward goes through (plain,
    DP or DDP); ``plain`` is the underlying module (for snapshots). ``epoch_indices(epoch)``
    returns this process's batches for that epoch, in order: a sequence of ``(b,) int64``
    tensors of training indices, ``b`` being this process's batch size."""
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    device = images.device
    losses: list[torch.Tensor] = []
    snapshot = _snapshot(plain) if config.snapshot_step == 0 else None
    model.train()
    step = samples = 0
    warm_s = warm_samples = 0.0  # the first step (lazy initialisation) is excluded from samples/s
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for epoch in range(config.epochs):
        if step >= total:
            break
        for batch in epoch_indices(epoch):
            if step >= total:
                break
            batch = batch.to(device, non_blocking=True)
            x, y = images[batch], labels[batch]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)  # mean over this process's batch
            loss.backward()                       # DDP: gradients all-reduced (averaged) here
            optimizer.step()
            losses.append(loss.detach())
            step += 1
            samples += batch.numel()
            if step == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                warm_s, warm_samples = time.perf_counter() - t0, samples
            if config.snapshot_step == step:
                snapshot = _snapshot(plain)
            if bar is not None:
                bar.update(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    out: dict[str, Any] = {
        "losses": torch.stack(losses).float() if losses else torch.zeros(0, device=device),
        "steps": step,
        "local_samples": samples,
        "seconds": seconds,
        # samples/s after the warm-up step; a single-step run falls back to the whole loop
        "local_samples_per_s": (samples - warm_samples) / (seconds - warm_s)
        if step > 1 and seconds > warm_s else samples / max(seconds, 1e-12),
    }
    if config.snapshot_step is not None:
        if snapshot is None:
            raise ValueError(f"snapshot_step={config.snapshot_step} > steps run ({step})")
        out["snapshot"] = snapshot
    return out


def _load(config: TrainConfig, device: torch.device):
    xtr, ytr = load_mnist(train=True, root=config.data_root)
    xte, yte = load_mnist(train=False, root=config.data_root)
    return xtr.to(device), ytr.to(device), xte.to(device), yte.to(device)


def _history(mode: str, config: TrainConfig, rank: int, world_size: int, device, loop, **extra):
    h = {
        "mode": mode,
        "rank": rank,
        "world_size": world_size,
        "device": str(device),
        "num_threads": torch.get_num_threads(),
        "config": asdict(config),
        "global_batch_size": config.global_batch_size,
        "batch_per_rank": config.batch_per_rank(world_size),
        "steps": loop["steps"],
        "samples": loop["local_samples"] * world_size,
        "seconds": loop["seconds"],
        "samples_per_s": loop["local_samples_per_s"] * world_size,
        "losses": loop["losses"].cpu().tolist(),
    }
    if "snapshot" in loop:
        h["snapshot"] = loop["snapshot"]
    h.update(extra)
    h["peak_rss_mib"] = peak_rss_mib()
    return h


def _single_like(config: TrainConfig, mode: str) -> dict[str, Any]:
    """Shared body of :func:`train_single` and :func:`train_dp`."""
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if use_cuda else "cpu")
    xtr, ytr, xte, yte = _load(config, device)
    plain = build_model(config.model, config.seed).to(device)
    if mode == "dp":
        model = nn.DataParallel(plain)  # all visible GPUs; on CPU device_ids == [] (a pass-through)
        gpus = list(model.device_ids)
    else:
        model = plain
        gpus = [0] if use_cuda else []
    for d in gpus:
        torch.cuda.reset_peak_memory_stats(d)
    n, b = xtr.shape[0], config.global_batch_size
    total = config.total_steps(n, 1)
    bar = _progress(total, f"{mode} {config.model}", config.progress, in_worker=False)
    loop = _train_loop(
        model, plain, xtr, ytr,
        lambda epoch: epoch_permutation(n, config.seed, epoch).split(b),
        config, total, bar,
    )
    accuracy = distributed_accuracy(plain, xte, yte, 0, 1, config.eval_batch_size)
    extra = {"test_accuracy": accuracy, "peak_cuda_mib": cuda_peaks_mib(gpus)}
    if mode == "dp":
        extra["dp_device_ids"] = list(model.device_ids)
    return _history(mode, config, 0, 1, device, loop, **extra)


def train_single(config: TrainConfig) -> dict[str, Any]:
    """Train in this process on one device (``cuda:0`` if present, else the CPU).

    Data: the 60,000 training images as in-memory tensors (``helpers.data.load_mnist``), visited
    in ``epoch_permutation(60000, seed, epoch)`` order, cut into global batches (the last one of
    an epoch is partial: 60,000 = 937 x 64 + 32). Evaluation: the 10,000 test images.

    Returns a history dict:
        mode ("single"), rank (0), world_size (1), device, num_threads, config (dict),
        global_batch_size, batch_per_rank, steps, samples (images trained on),
        seconds (training loop wall time, s; excludes loading and evaluation),
        samples_per_s (images per second of the loop, excluding its first step, which pays
        one-off lazy initialisation), losses (list of per-step mean cross-entropy over the
        global batch, nats), test_accuracy (in [0, 1]), peak_cuda_mib (list, per GPU used, MiB),
        peak_rss_mib (this process's peak RSS so far, MiB), and snapshot if requested.

    Raises:
        ValueError: if ``snapshot_step`` is beyond the steps actually run.
    """
    return _single_like(config, "single")


def train_dp(config: TrainConfig) -> dict[str, Any]:
    """Train through ``nn.DataParallel`` in this process, one thread per visible GPU.

    With GPUs, DP scatters each global batch across ``device_ids`` (all visible GPUs), replicates
    the module every step, runs the replicas in threads, gathers the outputs on ``cuda:0`` and
    sums the gradients into the original module. On a CPU-only machine ``device_ids == []`` and
    ``DataParallel.forward`` simply calls the module: the run is the single-process run,
    bit for bit, with no parallelism at all.

    Same data, order and return value as :func:`train_single` (``mode == "dp"``), plus
    ``dp_device_ids`` (list of int; ``[]`` on CPU).
    """
    return _single_like(config, "dp")


def ddp_train_worker(rank: int, world_size: int, config: TrainConfig) -> dict[str, Any]:
    """One DDP rank; run it with ``helpers.engine.launch(ddp_train_worker, world_size, config)``.

    Needs the default process group (the launcher or torchrun sets it up). Each rank loads the
    data itself, builds the model from ``config.seed`` (DDP also broadcasts rank 0's weights),
    wraps it in ``DistributedDataParallel`` and trains on ``batch_per_rank`` images per step,
    taken from a ``DistributedSampler(shuffle=True, seed=config.seed)`` over a
    ``TensorDataset``: at step ``s`` rank ``r`` holds ``global_batch_s[r::world_size]``.
    The gradient all-reduce averages the ranks' gradients of their mean losses, which equals the
    gradient of the mean loss over the global batch, so the run follows :func:`train_single`.

    Returns the :func:`train_single` history with ``mode == "ddp"``, this rank's ``rank``, and:
        losses: the **global** per-step loss -- the per-rank mean losses all-reduced and
            averaged once after training (no extra collective per step), identical on all ranks;
        local_losses: this rank's own per-step mean loss on its shard;
        samples / samples_per_s: global images (all ranks), and ``world_size`` times this rank's
            own images per second (ranks move in lockstep: each step ends with an all-reduce);
        test_accuracy: :func:`distributed_accuracy` of ``ddp_model.module`` (same on all ranks);
        peak_rss_mib: this worker process's peak RSS.

    Raises:
        ValueError: if ``global_batch_size`` is not divisible by ``world_size``.
        RuntimeError: if no process group is initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("ddp_train_worker needs the default process group: run it via helpers.engine.launch")
    b = config.batch_per_rank(world_size)  # fail fast, before loading anything
    device = worker_device()
    xtr, ytr, xte, yte = _load(config, device)
    plain = build_model(config.model, config.seed).to(device)
    ddp = DDP(plain, device_ids=[device.index] if device.type == "cuda" else None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sampler = DistributedSampler(
        TensorDataset(xtr, ytr), num_replicas=world_size, rank=rank, shuffle=True, seed=config.seed
    )

    def epoch_indices(epoch: int):
        sampler.set_epoch(epoch)
        # index the in-memory tensors with the sampler's indices (no per-item DataLoader work)
        return torch.tensor(list(sampler), dtype=torch.int64).split(b)

    total = config.total_steps(xtr.shape[0], world_size)
    bar = _progress(total, f"ddp {config.model} rank 0/{world_size}", config.progress and rank == 0, in_worker=True)
    loop = _train_loop(ddp, plain, xtr, ytr, epoch_indices, config, total, bar)

    local = loop["losses"]
    global_losses = local.clone()
    dist.all_reduce(global_losses, op=dist.ReduceOp.SUM)  # one collective for the whole curve
    global_losses /= world_size  # equal shard sizes: mean of rank means == global mean
    loop["losses"] = global_losses
    accuracy = distributed_accuracy(ddp.module, xte, yte, rank, world_size, config.eval_batch_size)
    gpus = [device.index] if device.type == "cuda" else []
    return _history(
        "ddp", config, rank, world_size, device, loop,
        local_losses=local.cpu().tolist(),
        test_accuracy=accuracy,
        peak_cuda_mib=cuda_peaks_mib(gpus),
        backend=dist.get_backend(),
    )


def summarize_ddp(histories: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the per-rank histories :func:`ddp_train_worker` returns into one row.

    Checks that every rank reports the same global loss curve and test accuracy (both are
    all-reduced, so they must agree) and raises ``AssertionError`` otherwise. Returns
    rank 0's history with ``samples_per_s`` and ``seconds`` taken from the slowest rank, and
    ``peak_rss_mib`` the largest rank's value; ``peak_rss_mib_per_rank`` lists them all.
    """
    if not histories:
        raise ValueError("no histories")
    first = histories[0]
    for h in histories[1:]:
        # all-reduced values: the same on every rank (bit-identical with gloo; rounding allowed)
        torch.testing.assert_close(
            torch.tensor(h["losses"]), torch.tensor(first["losses"]),
            msg=lambda m, rank=h["rank"]: f"rank {rank} global loss curve differs from rank 0's: {m}")
        assert h["test_accuracy"] == first["test_accuracy"], f"rank {h['rank']} accuracy differs"
    row = dict(first)
    row["rank"] = "all"
    row["seconds"] = max(h["seconds"] for h in histories)
    row["samples_per_s"] = min(h["samples_per_s"] for h in histories)
    row["peak_rss_mib_per_rank"] = [h["peak_rss_mib"] for h in histories]
    row["peak_rss_mib"] = max(row["peak_rss_mib_per_rank"])
    row.pop("local_losses", None)
    return row

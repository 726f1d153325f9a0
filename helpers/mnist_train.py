"""Notebook 04's DDP training, packaged: what lessons 07a and 07b and torchrun run.

:func:`ddp_train_worker` is 04's ``ddp_train`` with a progress bar, a timing and a history;
04 checks that both give the same global losses, bit for bit. The recipe is the seed's:
``Linear(784, 10)`` (or a small CNN), plain SGD on a mean cross-entropy, global batches in the
order ``DistributedSampler(shuffle=True, seed=seed)`` draws, so at step ``s`` rank ``r`` holds
``global_batch_s[r::world_size]``. The torchrun entry point is :mod:`helpers.mnist_torchrun`::

    from helpers.engine import launch
    histories = launch(ddp_train_worker, 2, TrainConfig(max_steps=200))
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
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
from helpers.mnist_steps import total_steps

__all__ = ["MODELS", "TrainConfig", "build_model", "ddp_train_worker", "distributed_accuracy",
           "peak_rss_mib"]

MODELS = ("linear", "cnn")


@dataclass
class TrainConfig:
    """One training run.

    Attributes:
        global_batch_size: samples per optimizer step, summed over all ranks (seed: 64).
        lr: SGD learning rate (seed: 0.01).
        epochs: passes over the 60,000 training images.
        max_steps: stop after this many optimizer steps; ``None`` or ``0``: all ``epochs``.
        model: ``"linear"`` (``Linear(784, 10)``, the seed) or ``"cnn"`` (two 3x3 convolutions).
        seed: seeds the initial weights and the data order (the ``DistributedSampler`` seed).
        progress: show a tqdm bar (rank 0 only).
        eval_batch_size: images per forward pass during evaluation (memory only).
        data_root: the ``data/`` folder; ``None`` means the repository's.

    Raises:
        ValueError: on a non-positive batch size, learning rate or epoch count, a negative
            ``max_steps`` or an unknown model name.
    """

    global_batch_size: int = 64
    lr: float = 0.01
    epochs: int = 1
    max_steps: int | None = None
    model: str = "linear"
    seed: int = 0
    progress: bool = True
    eval_batch_size: int = 1000
    data_root: str | None = None

    def __post_init__(self) -> None:
        for name in ("global_batch_size", "epochs", "eval_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        steps = self.max_steps
        if steps is not None and (not isinstance(steps, int) or steps < 0):
            raise ValueError(f"max_steps must be None or an int >= 0, got {steps!r}")
        self.max_steps = steps or None  # 0: papermill's spelling of "no limit"
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")

    def batch_per_rank(self, world_size: int) -> int:
        """``global_batch_size // world_size``.

        Raises:
            ValueError: if ``world_size < 1`` or does not divide ``global_batch_size`` (unequal
                shares would weight the ranks' mean losses unequally).
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if self.global_batch_size % world_size:
            lower = self.global_batch_size - self.global_batch_size % world_size
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"world_size={world_size}: every rank must take the same share of each global "
                f"batch. Choose e.g. global_batch_size={lower or world_size} or "
                f"{lower + world_size}, or a world_size that divides {self.global_batch_size}.")
        return self.global_batch_size // world_size

    def total_steps(self, n_train: int, world_size: int = 1) -> int:
        """Optimizer steps on ``n_train`` images: :func:`helpers.mnist_steps.total_steps`, after
        :meth:`batch_per_rank` checks ``world_size``."""
        self.batch_per_rank(world_size)
        return total_steps(n_train, self.global_batch_size, world_size, epochs=self.epochs,
                           max_steps=self.max_steps)


def build_model(name: str = "linear", seed: int | None = 0) -> nn.Module:
    """Input ``(batch, 1, 28, 28) float32``, logits ``(batch, 10)``; ``torch.manual_seed(seed)``
    first, so every rank starts from the same weights. ``"linear"``: 7,850 parameters; ``"cnn"``:
    Conv(1->8)-ReLU-MaxPool-Conv(8->16)-ReLU-MaxPool-Linear(784, 10), 9,098. Raises ``ValueError``
    on an unknown name."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    if seed is not None:
        torch.manual_seed(seed)
    if name == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * 7 * 7, 10))


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, MiB.

    Linux: ``VmHWM`` of ``/proc/self/status``; not ``ru_maxrss``, which Linux carries across
    ``fork`` + ``exec`` (a worker would report the kernel's peak). Elsewhere psutil's
    ``peak_wset`` (Windows) or ``ru_maxrss`` (bytes on macOS, KiB elsewhere).
    """
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        pass
    try:
        import resource  # POSIX only
    except ImportError:  # Windows
        import psutil

        return psutil.Process().memory_info().peak_wset / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


@torch.no_grad()
def distributed_accuracy(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, rank: int,
                         world_size: int, batch_size: int = 1000) -> float:
    """Accuracy over the whole set, computed by the ranks together; the same on every rank.

    Rank ``r`` scores the unpadded shard ``r, r + W, ...`` (``DistributedSampler`` would pad it
    with repeats), then one all-reduce sums ``[correct, total]``: every image counts once.
    ``model`` is the plain module (``ddp_model.module``), on any device; ``images``
    ``(N, 1, 28, 28) float32``, ``labels`` ``(N,) int64``. A collective when ``world_size > 1``.

    Raises:
        ValueError: if the shapes disagree or ``rank`` is out of range.
        RuntimeError: if ``world_size > 1`` and no default process group is initialised.
    """
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("distributed_accuracy with world_size > 1 needs a process group")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    shard = torch.arange(rank, len(labels), world_size)
    correct = sum(int((model(images[i].to(device)).argmax(1) == labels[i].to(device)).sum())
                  for i in shard.split(batch_size))
    model.train(was_training)
    counts = torch.tensor([correct, len(shard)], device=device)
    if world_size > 1:
        dist.all_reduce(counts)
    return int(counts[0]) / int(counts[1])


class _LineStream:
    """tqdm's carriage-return redraws as whole lines: the launcher relays output line by line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        if (text := text.replace("\r", "").rstrip("\n")).strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def ddp_train_worker(rank: int, world_size: int, config: TrainConfig) -> dict[str, Any]:
    """One DDP rank: ``launch(ddp_train_worker, world_size, config)``, or under torchrun.

    Returns a history dict (plain values, so it crosses processes and makes a pandas row):
    ``mode`` ("ddp"), ``rank``, ``world_size``, ``device``, ``backend``, ``num_threads``,
    ``config`` (dict), ``global_batch_size``, ``batch_per_rank``, ``steps``, ``samples`` (all
    ranks), ``seconds`` (the loop's wall time), ``samples_per_s``, ``losses`` (the global
    per-step mean cross-entropy in nats, all-reduced once after training: the same on every
    rank), ``local_losses`` (this rank's own), ``test_accuracy`` (:func:`distributed_accuracy`
    of ``ddp_model.module``) and ``peak_rss_mib``.

    Raises:
        ValueError: if ``world_size`` does not divide ``global_batch_size``.
        RuntimeError: if no process group is initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("ddp_train_worker needs the default process group: launch it")
    b = config.batch_per_rank(world_size)  # fail fast, before loading anything
    device = worker_device()
    xtr, ytr = (t.to(device) for t in load_mnist(train=True, root=config.data_root))
    xte, yte = load_mnist(train=False, root=config.data_root)
    plain = build_model(config.model, config.seed).to(device)
    ddp = DDP(plain, device_ids=[device.index] if device.type == "cuda" else None)
    sampler = DistributedSampler(TensorDataset(xtr, ytr), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=config.seed)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=config.lr)
    total = config.total_steps(len(ytr), world_size)
    bar = None
    if config.progress and rank == 0:
        bar = tqdm(total=total, desc=f"ddp {config.model} rank 0/{world_size}", unit="step",
                   file=_LineStream(sys.stderr), mininterval=5.0, ascii=True)
    losses, samples = [], 0
    t0 = time.perf_counter()
    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)
        for idx in torch.tensor(list(sampler)).split(b):  # index the in-memory tensors directly
            if len(losses) == total:
                break
            idx = idx.to(device)
            loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])  # mean over this rank's batch
            optimizer.zero_grad()
            loss.backward()  # DDP: gradients averaged over the ranks here
            optimizer.step()
            losses.append(loss.detach())
            samples += len(idx)
            if bar is not None:
                bar.update(1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    local = torch.stack(losses)
    global_losses = local.clone()
    dist.all_reduce(global_losses)  # one collective for the whole curve
    global_losses /= world_size  # equal shards: the mean of the rank means is the global mean
    accuracy = distributed_accuracy(ddp.module, xte, yte, rank, world_size, config.eval_batch_size)
    return {"mode": "ddp", "rank": rank, "world_size": world_size, "device": str(device),
            "backend": dist.get_backend(), "num_threads": torch.get_num_threads(),
            "config": asdict(config), "global_batch_size": config.global_batch_size,
            "batch_per_rank": b, "steps": len(losses), "samples": samples * world_size,
            "seconds": seconds, "samples_per_s": samples * world_size / seconds,
            "losses": global_losses.cpu().tolist(), "local_losses": local.cpu().tolist(),
            "test_accuracy": accuracy, "peak_rss_mib": peak_rss_mib()}

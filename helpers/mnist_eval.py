"""Measuring notebook 04's runs: test accuracy computed jointly by the ranks, and peak memory.

All names are also importable from :mod:`helpers.mnist_train`.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from helpers.sampler import distributed_eval_counts

__all__ = ["cuda_peaks_mib", "distributed_accuracy", "peak_rss_mib"]


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB, over the process's whole life.

    Linux: ``VmHWM`` from ``/proc/self/status`` (the high-water mark of this process's own
    memory). Not ``getrusage().ru_maxrss``: Linux carries that across ``fork`` + ``exec``, so a
    spawned DDP worker would report the notebook kernel's peak if it was larger. macOS:
    ``ru_maxrss`` (bytes). Windows: psutil's peak working set.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB -> MiB
    except OSError:
        pass
    try:
        import resource  # POSIX only: not importable on Windows

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes vs KiB
    except ImportError:  # Windows
        import psutil  # only needed there

        return psutil.Process().memory_info().peak_wset / 2**20


def cuda_peaks_mib(devices: list[int]) -> list[float]:
    """Peak memory allocated by torch on each CUDA device in ``devices`` so far, in MiB."""
    return [torch.cuda.max_memory_allocated(d) / 2**20 for d in devices]


@torch.no_grad()
def distributed_accuracy(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    rank: int,
    world_size: int,
    batch_size: int = 1000,
) -> float:
    """Test accuracy over the **whole** set, computed jointly by all ranks (notebook 04).

    Rank ``r`` evaluates its unpadded shard ``r, r + W, r + 2W, ...`` of the ``N`` images
    (:func:`helpers.sampler.distributed_eval_counts`, notebook 03); the ranks then all-reduce
    (sum) their ``[correct, total]`` counts, so every rank
    returns the same exact accuracy and no image is counted twice (``DistributedSampler`` would
    pad the shards with repeats; that is fine for training, wrong for measuring).

    Args:
        model: the plain module, e.g. ``ddp_model.module`` -- never the DDP wrapper: a forward
            through the wrapper may start a collective (buffer broadcast) that only this code
            path runs, and evaluation must not depend on that.
        images: ``(N, 1, 28, 28) float32``, normalised; any device (batches are moved to the
            model's device).
        labels: ``(N,) int64``.
        rank, world_size: this process's place in the default process group; with
            ``world_size == 1`` no process group is needed.
        batch_size: images per forward pass (memory only).

    Returns:
        accuracy in ``[0, 1]``, identical on every rank.

    Raises:
        ValueError: if the shapes disagree or ``rank`` is out of range.
        RuntimeError: if ``world_size > 1`` and no default process group is initialised.
    """
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {labels.shape[0]} labels")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("distributed_accuracy with world_size > 1 needs an initialised process group")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()

    def count_correct(indices: list[int]) -> int:
        idx = torch.tensor(indices, dtype=torch.int64)
        correct = 0
        for i in range(0, len(idx), batch_size):
            batch = idx[i:i + batch_size]
            logits = model(images[batch].to(device, non_blocking=True))
            correct += int((logits.argmax(dim=1) == labels[batch].to(device)).sum())
        return correct

    with torch.no_grad():
        correct, total = distributed_eval_counts(count_correct, images.shape[0], rank, world_size, device)
    model.train(was_training)
    return correct / total

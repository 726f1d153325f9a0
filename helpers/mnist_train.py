"""MNIST training in three modes: one process, ``nn.DataParallel`` and DDP (notebook 04).

The recipe is the seed's: ``Linear(784, 10)`` (or a small CNN) trained with plain SGD on a mean
cross-entropy loss. Everything is stated in terms of the **global batch** (samples per optimizer
step); DDP derives ``batch_per_rank = global_batch_size // world_size``, so the three modes take
the same optimizer steps on the same data and are directly comparable.

Data order. Every mode visits the training set in the order ``epoch_permutation(N, seed, epoch)``,
which is exactly the permutation ``DistributedSampler(shuffle=True, seed=seed)`` draws after
``set_epoch(epoch)``. The sampler hands rank ``r`` the strided slice ``perm[r::world_size]``, so at
step ``s`` rank ``r`` holds ``global_batch[r::world_size]``: the ranks' batches together are
exactly the single-process batch of that step, split evenly.

Entry points:
    train_single(config)                      -> history   (in the notebook kernel)
    train_dp(config)                          -> history   (in the notebook kernel)
    ddp_train_worker(rank, world_size, config) -> history  (in each worker, via helpers.launch)

From a notebook::

    from helpers.launch import launch
    histories = launch(ddp_train_worker, 2, TrainConfig(max_steps=200))

Under torchrun (same worker, same history on each rank)::

    torchrun --standalone --nproc_per_node=2 -m helpers.mnist_train --max-steps 200

A ``history`` is a plain dict (see :func:`train_single` for its keys) so it crosses process
boundaries and goes straight into a pandas table.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers.sampler import distributed_eval_counts

MODELS = ("linear", "cnn")


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """One training run, identical for every mode.

    Attributes:
        global_batch_size: samples per optimizer step, summed over all ranks (seed: 64).
        lr: SGD learning rate (seed: 0.01).
        epochs: passes over the 60,000 training images.
        max_steps: stop after this many optimizer steps in total (for smoke runs); ``None`` or
            ``0`` means run all ``epochs`` in full.
        model: ``"linear"`` (``Linear(784, 10)``, the seed) or ``"cnn"`` (two 3x3 convolutions).
        seed: seeds the initial weights (``torch.manual_seed``) and the data order (the
            ``DistributedSampler`` seed).
        progress: show a tqdm bar (rank 0 only).
        snapshot_step: if set, the history also holds ``"snapshot"``, the model's parameters
            (CPU tensors) right after this many optimizer steps, for equivalence checks.
        eval_batch_size: images per forward pass during evaluation (memory only, not maths).
        data_root: the ``data/`` folder; ``None`` means the repository's.

    Raises:
        ValueError: on a non-positive batch size, learning rate or epoch count, a negative
            ``max_steps`` or ``snapshot_step``, or an unknown model name.
    """

    global_batch_size: int = 64
    lr: float = 0.01
    epochs: int = 1
    max_steps: int | None = None
    model: str = "linear"
    seed: int = 0
    progress: bool = True
    snapshot_step: int | None = None
    eval_batch_size: int = 1000
    data_root: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.global_batch_size, int) or self.global_batch_size < 1:
            raise ValueError(f"global_batch_size must be a positive int, got {self.global_batch_size!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be an int >= 1, got {self.epochs!r}")
        if self.max_steps is not None:
            if not isinstance(self.max_steps, int) or self.max_steps < 0:
                raise ValueError(f"max_steps must be None or an int >= 0, got {self.max_steps!r}")
            if self.max_steps == 0:  # papermill-friendly spelling of "no limit"
                self.max_steps = None
        if self.snapshot_step is not None and (
            not isinstance(self.snapshot_step, int) or self.snapshot_step < 0
        ):
            raise ValueError(f"snapshot_step must be None or an int >= 0, got {self.snapshot_step!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if not isinstance(self.eval_batch_size, int) or self.eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be a positive int, got {self.eval_batch_size!r}")

    def batch_per_rank(self, world_size: int) -> int:
        """Samples each rank processes per step: ``global_batch_size // world_size``.

        Raises:
            ValueError: if ``world_size < 1`` or ``global_batch_size`` is not divisible by
                ``world_size`` (an uneven split would weight the ranks' mean losses unequally,
                and DDP would no longer follow the single-process run).
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if self.global_batch_size % world_size:
            lower = self.global_batch_size - self.global_batch_size % world_size
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not divisible by "
                f"world_size={world_size}: every rank must take the same share of each global "
                f"batch. Choose e.g. global_batch_size={lower or world_size} or "
                f"{lower + world_size}, or a world_size that divides {self.global_batch_size}."
            )
        return self.global_batch_size // world_size

    def total_steps(self, n_train: int, world_size: int = 1) -> int:
        """Optimizer steps this config runs on ``n_train`` images (every epoch ends with the
        partial global batch, if any; ``max_steps`` caps the total)."""
        per_rank = math.ceil(n_train / world_size)  # DistributedSampler pads to this
        steps = self.epochs * math.ceil(per_rank / self.batch_per_rank(world_size))
        return steps if self.max_steps is None else min(steps, self.max_steps)


# --------------------------------------------------------------------------------------------
# Model, data order, measurements
# --------------------------------------------------------------------------------------------


def build_model(name: str = "linear", seed: int | None = 0) -> nn.Module:
    """The classifier: input ``(batch, 1, 28, 28) float32``, output logits ``(batch, 10)``.

    ``"linear"`` is the seed's ``Linear(784, 10)`` after a flatten (7,850 parameters);
    ``"cnn"`` is Conv(1->8, 3x3)-ReLU-MaxPool-Conv(8->16, 3x3)-ReLU-MaxPool-Linear(784, 10)
    (9,098 parameters). With ``seed`` set, ``torch.manual_seed(seed)`` runs first so every mode
    and every rank starts from identical weights. Raises ``ValueError`` on an unknown name.
    """
    if name not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    if seed is not None:
        torch.manual_seed(seed)
    if name == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),    # (8, 14, 14)
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # (16, 7, 7)
        nn.Flatten(), nn.Linear(16 * 7 * 7, 10),
    )


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the ``n`` training indices in ``epoch``: ``(n,) int64``.

    Identical to the permutation ``DistributedSampler(dataset, shuffle=True, seed=seed)`` draws
    after ``set_epoch(epoch)`` (a CPU generator seeded with ``seed + epoch``), so single-process,
    DP and DDP runs see the same data in the same order.
    """
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g)


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
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes vs KiB
    except ImportError:  # Windows
        import psutil

        return psutil.Process().memory_info().peak_wset / 2**20


def _cuda_peaks_mib(devices: list[int]) -> list[float]:
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
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, file=_LineStream(sys.stderr), mininterval=5.0,
                    ascii=True, unit="step")
    with warnings.catch_warnings():  # without ipywidgets tqdm.auto falls back to text bars
        warnings.simplefilter("ignore")
        from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, mininterval=0.5, unit="step")


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
    from helpers.data import load_mnist

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
    extra = {"test_accuracy": accuracy, "peak_cuda_mib": _cuda_peaks_mib(gpus)}
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
    """One DDP rank; run it with ``helpers.launch.launch(ddp_train_worker, world_size, config)``.

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
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DistributedSampler, TensorDataset

    from helpers.launch import worker_device

    if not dist.is_initialized():
        raise RuntimeError("ddp_train_worker needs the default process group: run it via helpers.launch.launch")
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
        peak_cuda_mib=_cuda_peaks_mib(gpus),
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
            msg=lambda m: f"rank {h['rank']} global loss curve differs from rank 0's: {m}")
        assert h["test_accuracy"] == first["test_accuracy"], f"rank {h['rank']} accuracy differs"
    row = dict(first)
    row["rank"] = "all"
    row["seconds"] = max(h["seconds"] for h in histories)
    row["samples_per_s"] = min(h["samples_per_s"] for h in histories)
    row["peak_rss_mib_per_rank"] = [h["peak_rss_mib"] for h in histories]
    row["peak_rss_mib"] = max(row["peak_rss_mib_per_rank"])
    row.pop("local_losses", None)
    return row


def _main(argv: list[str] | None = None) -> None:
    """``torchrun ... -m helpers.mnist_train [options]``: the same entry point as ``-m helpers.cluster``."""
    from helpers.cluster import main

    main(argv)


if __name__ == "__main__":
    _main()

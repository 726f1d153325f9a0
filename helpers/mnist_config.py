"""What notebook 04 trains: the run's configuration, the model, and the data order.

Everything is stated in terms of the **global batch** (samples per optimizer step);
DDP derives ``batch_per_rank = global_batch_size // world_size``, so the three modes of
:mod:`helpers.mnist_train` take the same optimizer steps on the same data and are directly
comparable.

Data order. Every mode visits the training set in the order ``epoch_permutation(N, seed, epoch)``,
which is exactly the permutation ``DistributedSampler(shuffle=True, seed=seed)`` draws after
``set_epoch(epoch)``. The sampler hands rank ``r`` the strided slice ``perm[r::world_size]``, so at
step ``s`` rank ``r`` holds ``global_batch[r::world_size]``: the ranks' batches together are
exactly the single-process batch of that step, split evenly.

All names are also importable from :mod:`helpers.mnist_train`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from helpers.mnist_steps import total_steps

__all__ = ["MODELS", "TrainConfig", "build_model", "epoch_permutation"]

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
        partial global batch, if any; ``max_steps`` caps the total): :func:`helpers.mnist_steps.total_steps`,
        after :meth:`batch_per_rank` checks that ``world_size`` divides the global batch."""
        self.batch_per_rank(world_size)
        return total_steps(n_train, self.global_batch_size, world_size, epochs=self.epochs, max_steps=self.max_steps)


# --------------------------------------------------------------------------------------------
# Model, data order
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

"""How many optimizer steps an MNIST run takes: the one home of that count, importable without torch.

:meth:`helpers.mnist_train.TrainConfig.total_steps` calls :func:`total_steps`, and so do the
parameter-check cells of notebooks 07a and 07b, which run before torch is imported.
"""

from __future__ import annotations

import math

__all__ = ["MNIST_TRAIN_IMAGES", "total_steps"]

#: images in MNIST's training split
MNIST_TRAIN_IMAGES = 60_000


def total_steps(n_train: int, global_batch_size: int, world_size: int = 1, *, epochs: int = 1,
                max_steps: int | None = None) -> int:
    """Optimizer steps of a run over ``n_train`` images on ``world_size`` ranks.

    ``DistributedSampler`` pads the data to ``ceil(n_train / world_size)`` indices per rank, and
    each rank takes ``global_batch_size // world_size`` of them per step, so every epoch ends
    with the partial global batch, if any. ``max_steps`` caps the total; ``None`` or ``0`` means
    no cap. The caller checks that ``world_size`` divides ``global_batch_size``
    (:meth:`helpers.mnist_train.TrainConfig.batch_per_rank`).
    """
    per_rank = math.ceil(n_train / world_size)
    steps = epochs * math.ceil(per_rank / (global_batch_size // world_size))
    return min(steps, max_steps) if max_steps else steps

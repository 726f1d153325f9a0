"""What ``nn.DataParallel`` does with one batch, computed without CUDA (notebooks 01 and 04).

``DataParallel.forward`` scatters each input tensor along dim 0 with ``comm.scatter``, which,
given no ``chunk_sizes``, splits it as ``tensor.chunk(len(device_ids), dim)``
(``torch/csrc/cuda/comm.cpp``, ``scatter``); it then replicates the module onto
``device_ids[:len(chunks)]`` and calls each replica once on its chunk
(``torch/nn/parallel/data_parallel.py``). ``Tensor.chunk`` makes chunks of
``ceil(batch / n)`` items, so it can return *fewer* than ``n`` chunks: a batch of 10 on 9 GPUs
gives 5 chunks of 2, so only 5 replicas run.
"""

from __future__ import annotations

import torch

__all__ = ["scatter_chunk_sizes"]


def scatter_chunk_sizes(batch_size: int, n_devices: int) -> list[int]:
    """Items per replica call when ``nn.DataParallel`` over ``n_devices`` GPUs gets a batch of
    ``batch_size`` (dim 0): one entry per replica that runs, ``device_ids[0]`` first.

    Raises:
        ValueError: ``batch_size`` or ``n_devices`` below 1.
    """
    if batch_size < 1 or n_devices < 1:
        raise ValueError(f"batch_size and n_devices must be >= 1, got {batch_size} and {n_devices}")
    # the same call comm.scatter makes, on a CPU tensor of the batch's length (no data copied)
    return [len(c) for c in torch.empty(batch_size, 0).chunk(n_devices, dim=0)]

"""helpers.dataparallel.scatter_chunk_sizes: the replica calls notebooks 01 and 04 expect from real
``nn.DataParallel`` on GPUs, worked by hand (Tensor.chunk: chunks of ceil(batch / n) items)."""

import pytest

from helpers.dataparallel import scatter_chunk_sizes


@pytest.mark.parametrize("batch_size, n_gpus, expected", [
    (64, 1, [64]),                  # one GPU: the module is called once on the whole batch
    (64, 2, [32, 32]),
    (7, 2, [4, 3]),                 # ceil(7 / 2) = 4, then the rest
    (2, 2, [1, 1]),                 # notebook 01's toy batch (world_size rows) on 2 GPUs
    (64, 8, [8] * 8),               # the old rule, len(calls) == min(n_gpus, batch), holds to 8
    (64, 9, [8] * 8),               # ceil(64 / 9) = 8: 8 chunks, the ninth GPU idle: not min(9, 64)
    (10, 9, [2, 2, 2, 2, 2]),       # 5 replicas on 9 GPUs: not min(9, 10) = 9
    (2, 9, [1, 1]),                 # a batch smaller than the GPU count: one replica per item
])
def test_chunk_sizes_worked_by_hand(batch_size, n_gpus, expected):
    sizes = scatter_chunk_sizes(batch_size, n_gpus)
    assert sizes == expected
    assert sum(sizes) == batch_size and len(sizes) <= n_gpus


@pytest.mark.parametrize("batch_size, n_gpus", [(0, 2), (4, 0)])
def test_bad_input(batch_size, n_gpus):
    with pytest.raises(ValueError, match=">= 1"):
        scatter_chunk_sizes(batch_size, n_gpus)

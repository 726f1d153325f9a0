"""How ``DistributedSampler`` splits a dataset over ranks, and how to evaluate without its padding
(notebook 03).

Introduced in ``notebooks/03_distributed_sampler.ipynb``, which writes the sampler loop, the
evaluation with all-reduced counts and the gathering of predictions in its own cells and runs
them on real ranks; this module only holds the infrastructure around them. The table helpers
ask the **real** ``torch.utils.data.DistributedSampler`` which indices each rank receives: it
accepts ``num_replicas`` and ``rank`` explicitly, so no process group is needed to ask it
(nothing here re-implements its split). What it does (``torch/utils/data/distributed.py``):

* ``shuffle=True``: permute ``range(N)`` with a generator seeded ``seed + epoch`` (the epoch set
  by ``set_epoch``; 0 if never called), identically on every rank;
* ``drop_last=False`` (default): **pad** the list with its own first items up to
  ``total_size = ceil(N / num_replicas) * num_replicas`` so every rank gets the same number of
  samples (equal batch counts, so no rank waits forever in a collective); ``drop_last=True``:
  cut the tail instead (those items are never seen);
* rank ``r`` takes ``indices[r : total_size : num_replicas]``.

The sampler splits **indices**; it assumes every rank holds the *same* dataset. Padding is fine
for training and wrong for measuring: ``helpers.mnist_train.distributed_accuracy`` scores
unpadded shards and all-reduces the counts, so every item counts once.

Reference: https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

__all__ = ["sampler_indices", "sampler_assignment", "epoch_assignment", "assignment_lists",
           "times_seen", "accuracy_through", "plot_assignment"]


def _check_sizes(dataset_len: int, num_replicas: int) -> None:
    if isinstance(dataset_len, bool) or not isinstance(dataset_len, int) or dataset_len < 1:
        raise ValueError(f"dataset_len must be a positive int, got {dataset_len!r}")
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")


def sampler_indices(dataset_len: int, num_replicas: int, rank: int, *, shuffle: bool = False,
                    seed: int = 0, drop_last: bool = False, epoch: int | None = None) -> list[int]:
    """The dataset indices rank ``rank`` receives, in order, from a fresh
    ``torch.utils.data.DistributedSampler(range(dataset_len), num_replicas, rank, shuffle, seed,
    drop_last)`` (``set_epoch(epoch)`` called first unless ``epoch`` is None).

    Returns:
        list of ``int`` of length ``ceil(dataset_len / num_replicas)`` (``drop_last=False``) or
        ``dataset_len // num_replicas`` (``drop_last=True``).

    Raises:
        ValueError: ``dataset_len`` or ``num_replicas`` not a positive int, or ``rank`` outside
            ``[0, num_replicas)`` (the sampler's own check).
    """
    from torch.utils.data import DistributedSampler

    _check_sizes(dataset_len, num_replicas)
    sampler = DistributedSampler(range(dataset_len), num_replicas=num_replicas, rank=rank,
                                 shuffle=shuffle, seed=seed, drop_last=drop_last)
    if epoch is not None:
        sampler.set_epoch(epoch)
    return [int(i) for i in sampler]


def sampler_assignment(dataset_len: int, num_replicas: int, *, shuffle: bool = False, seed: int = 0,
                       drop_last: bool = False, epoch: int | None = None):
    """Which rank gets which index: a ``pandas.DataFrame`` with one row per (rank, position).

    Columns ``rank``, ``position`` (0-based place in that rank's order, i.e. its batch number
    with ``batch_size=1``) and ``index`` (dataset index), all ``int64``, sorted by rank then
    position. Arguments and errors as :func:`sampler_indices`, for every rank.
    """
    import pandas as pd

    _check_sizes(dataset_len, num_replicas)
    rows = [{"rank": r, "position": p, "index": i}
            for r in range(num_replicas)
            for p, i in enumerate(sampler_indices(dataset_len, num_replicas, r, shuffle=shuffle, seed=seed,
                                                  drop_last=drop_last, epoch=epoch))]
    return pd.DataFrame(rows, columns=["rank", "position", "index"]).astype("int64")


def epoch_assignment(dataset_len: int, num_replicas: int, epochs: int, *, call_set_epoch: bool,
                     seed: int = 0, drop_last: bool = False):
    """Each rank's shuffled order over ``epochs`` epochs, from **one** sampler per rank reused
    across epochs, as a training loop does; ``set_epoch(epoch)`` is called at the start of each
    epoch only if ``call_set_epoch``.

    Returns:
        ``pandas.DataFrame`` with ``int64`` columns ``epoch``, ``rank``, ``position``, ``index``.

    Raises:
        ValueError: as :func:`sampler_indices`, or ``epochs < 1``.
    """
    import pandas as pd
    from torch.utils.data import DistributedSampler

    _check_sizes(dataset_len, num_replicas)
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    rows = []
    for r in range(num_replicas):
        sampler = DistributedSampler(range(dataset_len), num_replicas=num_replicas, rank=r, shuffle=True,
                                     seed=seed, drop_last=drop_last)
        for epoch in range(epochs):
            if call_set_epoch:
                sampler.set_epoch(epoch)
            rows += [{"epoch": epoch, "rank": r, "position": p, "index": int(i)} for p, i in enumerate(sampler)]
    return pd.DataFrame(rows, columns=["epoch", "rank", "position", "index"]).astype("int64")


def assignment_lists(df) -> list[list[int]]:
    """``[indices of rank 0, indices of rank 1, ...]`` (each in position order) from a
    :func:`sampler_assignment` table (one epoch)."""
    ordered = df.sort_values(["rank", "position"])
    n_ranks = int(ordered["rank"].max()) + 1 if len(ordered) else 0
    return [ordered.loc[ordered["rank"] == r, "index"].astype(int).tolist() for r in range(n_ranks)]


def times_seen(df, dataset_len: int):
    """How many times each dataset index is handed out in one epoch, over all ranks.

    Returns:
        ``pandas.Series`` of ``int64`` indexed by dataset index ``0 .. dataset_len - 1``
        (0: never seen; 2: seen twice, i.e. padding duplicated it).
    """
    counts = df["index"].value_counts().reindex(range(dataset_len), fill_value=0).astype("int64")
    counts.index.name = "index"
    return counts.rename("times seen")


def accuracy_through(df, correct: Sequence[bool]) -> Fraction:
    """Accuracy as a naive distributed evaluation computes it when it iterates this sampler
    assignment: every handed-out index counts, duplicates twice, dropped ones never.

    Args:
        df: a :func:`sampler_assignment` table.
        correct: ``correct[i]`` is True when the model is right on dataset item ``i``.

    Returns:
        ``fractions.Fraction`` ``(sum of correct over handed-out indices) / (number handed out)``.
    """
    idx = df["index"].tolist()
    return Fraction(sum(bool(correct[i]) for i in idx), len(idx))


def plot_assignment(df, dataset_len: int, ax=None, title: str | None = None, legend: bool = True):
    """Draw a sampler assignment: ranks as rows, dataset indices as columns.

    A filled cell means "this rank receives this index" and is labelled with its position
    (``p0`` = first batch). Indices handed out more than once in the epoch (padding) are drawn
    in orange with a thick red edge; indices never handed out (``drop_last``) get a grey
    hatched column. A legend explains the colours.

    Args:
        df: a :func:`sampler_assignment` table; dataset_len: number of dataset items (columns).
        ax: a matplotlib ``Axes`` (a new figure if None); title: the axes title;
        legend: draw the colour legend to the right of the axes.

    Returns:
        the ``Axes``.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if ax is None:
        _, ax = plt.subplots(figsize=(0.55 * dataset_len + 1.5, 0.5 * (df["rank"].max() + 1) + 1.2))
    n_ranks = int(df["rank"].max()) + 1
    seen = times_seen(df, dataset_len)
    colours = {"once": "#4c72b0", "dup": "#f28e2b"}
    for i in range(dataset_len):
        if seen[i] == 0:
            ax.add_patch(Rectangle((i - 0.5, -0.5), 1, n_ranks, facecolor="#dddddd", hatch="//",
                                   edgecolor="#999999", linewidth=0.5))
    for rank, position, index in zip(df["rank"], df["position"], df["index"]):
        dup = seen[index] > 1
        ax.add_patch(Rectangle((index - 0.45, rank - 0.45), 0.9, 0.9,
                               facecolor=colours["dup" if dup else "once"],
                               edgecolor="#c0392b" if dup else "white", linewidth=2.5 if dup else 0.5))
        ax.text(index, rank, f"p{position}", ha="center", va="center", color="white",
                fontsize=8, fontweight="bold")
    ax.set_xlim(-0.5, dataset_len - 0.5)
    ax.set_ylim(n_ranks - 0.5, -0.5)
    ax.set_xticks(range(dataset_len))
    ax.set_yticks(range(n_ranks), [f"rank {r}" for r in range(n_ranks)])
    ax.set_xlabel("dataset index")
    ax.set_ylabel("rank")
    ax.set_aspect("equal")
    if title:
        ax.set_title(title, fontsize=10)
    handles = [Patch(facecolor=colours["once"], label="seen once"),
               Patch(facecolor=colours["dup"], edgecolor="#c0392b", linewidth=2, label="seen twice (padding)"),
               Patch(facecolor="#dddddd", hatch="//", edgecolor="#999999", label="never seen")]
    if legend:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return ax

"""The alpha-beta cost model of ring all-reduce, and what it predicts for data-parallel training.

Introduced in notebook 05b ("communication and cost model"). Pure arithmetic (numpy), no processes.

**The model.** A ring all-reduce of ``S`` bytes over ``n`` processes is a reduce-scatter followed
by an all-gather, ``2 (n - 1)`` steps in all; in every step each process sends one chunk of
``S / n`` bytes to its neighbour. With ``alpha`` the latency of one step (seconds) and ``B`` the
bandwidth of one link (bytes/s)::

    t(S, n) = 2 (n - 1) * alpha  +  2 (n - 1) / n * S / B

Sources: R. Thakur, R. Rabenseifner, W. Gropp, "Optimization of Collective Communication
Operations in MPICH", Int. J. High Performance Computing Applications 19(1):49-66, 2005 (the
alpha-beta-gamma cost analysis of all-reduce algorithms; the reduction term ``gamma`` is folded
into ``B`` here); P. Patarasuk, X. Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", J. Parallel and Distributed Computing 69(2):117-124, 2009 (the ring's
``2 (n - 1) / n * S`` bytes per process is the lower bound for all-reduce). The factor
``2 (n - 1) / n`` is also the one nccl-tests uses to turn *algorithm bandwidth* ``S / t`` into
*bus bandwidth*, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md.

Units everywhere: bytes, seconds, bytes per second (helpers print GB/s = 1e9 bytes/s).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "NCCL_TESTS_PERFORMANCE_URL",
    "algbw",
    "busbw",
    "busbw_factor",
    "ring_allreduce_seconds",
    "AlphaBetaFit",
    "fit_alpha_beta",
    "predict_data_parallel",
]

NCCL_TESTS_PERFORMANCE_URL = "https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md"


def _check_n(n) -> np.ndarray:
    n = np.asarray(n, dtype=float)
    if np.any(n < 1) or np.any(n != np.round(n)):
        raise ValueError(f"the number of processes n must be integers >= 1, got {n!r}")
    return n


def busbw_factor(n) -> float | np.ndarray:
    """``2 (n - 1) / n``: bytes each process sends per byte all-reduced by a ring (0 for n = 1).
    ``n``: int or array of ints >= 1, else ``ValueError``."""
    n = _check_n(n)
    f = 2.0 * (n - 1.0) / n
    return float(f) if f.ndim == 0 else f


def algbw(nbytes, seconds) -> float | np.ndarray:
    """Algorithm bandwidth ``S / t`` in bytes/s (nccl-tests' ``algbw``): ``nbytes``, the tensor
    each rank all-reduces; ``seconds`` (> 0, else ``ValueError``), one all-reduce's time."""
    seconds = np.asarray(seconds, dtype=float)
    if np.any(seconds <= 0):
        raise ValueError(f"times must be > 0 seconds, got {seconds!r}")
    out = np.asarray(nbytes, dtype=float) / seconds
    return float(out) if out.ndim == 0 else out


def busbw(algbw_Bps, n) -> float | np.ndarray:
    """Bus bandwidth ``algbw * 2 (n - 1) / n`` in bytes/s (nccl-tests' ``busbw`` for all-reduce).

    It removes the dependence on ``n``: for a ring it is the bandwidth each link actually
    carries, so it can be compared with the hardware's peak (here: the memory-copy bandwidth).
    Source: nccl-tests, doc/PERFORMANCE.md (:data:`NCCL_TESTS_PERFORMANCE_URL`).
    """
    out = np.asarray(algbw_Bps, dtype=float) * busbw_factor(n)
    return float(out) if out.ndim == 0 else out


def ring_allreduce_seconds(nbytes, n, alpha_s: float, bandwidth_Bps: float) -> float | np.ndarray:
    """Predicted time of one ring all-reduce: ``2 (n-1) alpha + 2 (n-1)/n * S / B`` seconds.

    Args:
        nbytes: message size ``S`` in bytes (scalar or array).
        n: number of processes (scalar or array, broadcast against ``nbytes``); 1 gives 0 s.
        alpha_s: latency per ring step, seconds (>= 0).
        bandwidth_Bps: link bandwidth ``B``, bytes/s (> 0).

    Raises:
        ValueError: on ``alpha_s < 0``, ``bandwidth_Bps <= 0`` or a bad ``n``.
    """
    if alpha_s < 0 or not bandwidth_Bps > 0:
        raise ValueError(f"need alpha_s >= 0 and bandwidth_Bps > 0, got {alpha_s!r}, {bandwidth_Bps!r}")
    n = _check_n(n)
    out = 2.0 * (n - 1.0) * alpha_s + busbw_factor(n) * np.asarray(nbytes, dtype=float) / bandwidth_Bps
    return float(out) if np.ndim(out) == 0 else out


@dataclass
class AlphaBetaFit:
    """Result of :func:`fit_alpha_beta`.

    Attributes:
        alpha_s: fitted latency per ring step, seconds.
        bandwidth_Bps: fitted link bandwidth ``B = 1 / beta``, bytes/s.
        relative_errors: ``(predicted - measured) / measured`` for every point, in input order.
        max_relative_error: largest absolute relative error over the points.
        n_points: number of points fitted.
    """

    alpha_s: float
    bandwidth_Bps: float
    relative_errors: list[float]
    max_relative_error: float
    n_points: int

    def predict(self, nbytes, n):
        """``ring_allreduce_seconds(nbytes, n, alpha_s, bandwidth_Bps)`` in seconds."""
        return ring_allreduce_seconds(nbytes, n, self.alpha_s, self.bandwidth_Bps)

    def as_dict(self) -> dict:
        return asdict(self)


def fit_alpha_beta(nbytes: Sequence[float], n: Sequence[int], seconds: Sequence[float]) -> AlphaBetaFit:
    """Fit ``alpha`` and ``B`` of the ring model to measured all-reduce times.

    The model is linear in ``(alpha, 1/B)``: ``t = alpha * 2(n-1) + (1/B) * 2(n-1)/n * S``.
    Each equation is divided by its measured ``t`` before the least-squares solve, so the fit
    minimises *relative* errors (times span several orders of magnitude from 4 KiB to 64 MiB;
    an unweighted fit would ignore the small messages). A negative latency is not physical:
    if the unconstrained solution has ``alpha < 0``, ``alpha`` is set to 0 and ``B`` refitted.

    Args:
        nbytes: message sizes in bytes, one per point.
        n: number of processes of each point (>= 2).
        seconds: measured time of one all-reduce of each point, s (> 0).

    Returns:
        :class:`AlphaBetaFit`.

    Raises:
        ValueError: on mismatched lengths, fewer than 2 points, ``n < 2``, a non-positive time,
            or data from which no positive bandwidth can be fitted.
    """
    S = np.asarray(nbytes, dtype=float).ravel()
    N = _check_n(n).ravel()
    t = np.asarray(seconds, dtype=float).ravel()
    if not (S.shape == N.shape == t.shape):
        raise ValueError(f"nbytes, n and seconds must have the same length, got {S.size}, {N.size}, {t.size}")
    if S.size < 2:
        raise ValueError(f"need at least 2 points to fit two parameters, got {S.size}")
    if np.any(N < 2):
        raise ValueError("every point needs n >= 2 processes (with n = 1 there is no communication)")
    if np.any(t <= 0) or np.any(S < 0):
        raise ValueError("times must be > 0 s and sizes >= 0 bytes")
    X = np.stack([2.0 * (N - 1.0), busbw_factor(N) * S], axis=1)
    A = X / t[:, None]
    ones = np.ones_like(t)
    (alpha, beta), *_ = np.linalg.lstsq(A, ones, rcond=None)
    if alpha < 0:
        alpha = 0.0
        col = A[:, 1]
        beta = float(col @ ones / (col @ col)) if col @ col > 0 else 0.0
    if not beta > 0:
        raise ValueError(
            "the fitted bandwidth term is not positive: include points with larger messages "
            "(the bandwidth term must dominate somewhere)")
    pred = X @ np.array([alpha, beta])
    rel = (pred - t) / t
    return AlphaBetaFit(float(alpha), float(1.0 / beta), [float(r) for r in rel],
                        float(np.max(np.abs(rel))), int(S.size))


def predict_data_parallel(
    n_gpus: Sequence[int],
    n_params: float,
    compute_s: float,
    alpha_s: float,
    bandwidth_Bps: float,
    bytes_per_param: int = 4,
    bucket_bytes: float = 25 * 2**20,
) -> list[dict]:
    """Predicted DDP step time and scaling efficiency for a model on ``n`` GPUs (weak scaling).

    Every GPU keeps its per-GPU batch, so one GPU's step takes ``compute_s`` (forward + backward
    + optimizer, no communication). DDP all-reduces the gradients (``n_params * bytes_per_param``
    bytes) in buckets of ``bucket_bytes``; every bucket is one ring all-reduce, so the latency
    term is paid once per bucket::

        comm_s = n_buckets * 2 (n-1) alpha + 2 (n-1)/n * gradient_bytes / B

    Two bounds on the step time: **no overlap** ``compute_s + comm_s`` (communication after
    backward) and **perfect overlap** ``max(compute_s, comm_s)`` (DDP's goal: buckets
    all-reduced while backward continues). Scaling efficiency = ``compute_s / step_s``
    (throughput of ``n`` GPUs divided by ``n`` times one GPU's).

    Args:
        n_gpus: the world sizes to predict (ints >= 1).
        n_params: number of parameters (e.g. ResNet-50: 25.6e6).
        compute_s: one GPU's step time without communication, seconds (an assumption you state).
        alpha_s: latency per ring step, seconds.
        bandwidth_Bps: link bandwidth, bytes/s (100 Gb/s = 12.5e9 bytes/s).
        bytes_per_param: 4 for float32 gradients, 2 for bf16/fp16.
        bucket_bytes: DDP's ``bucket_cap_mb`` in bytes (default 25 MiB).

    Returns:
        one dict per ``n``: ``n_gpus``, ``gradient_MB`` (1e6 bytes), ``n_buckets``,
        ``latency_ms``, ``bandwidth_ms``, ``comm_ms``, ``step_ms_no_overlap``,
        ``step_ms_overlap``, ``efficiency_no_overlap``, ``efficiency_overlap`` (fractions in
        [0, 1]).

    Raises:
        ValueError: on non-positive ``n_params``, ``compute_s``, ``bucket_bytes`` or bandwidth.
    """
    if not (n_params > 0 and compute_s > 0 and bucket_bytes > 0 and bandwidth_Bps > 0 and alpha_s >= 0):
        raise ValueError("n_params, compute_s, bucket_bytes, bandwidth_Bps must be > 0 and alpha_s >= 0")
    grad_bytes = float(n_params) * bytes_per_param
    n_buckets = max(1, math.ceil(grad_bytes / bucket_bytes))
    rows = []
    for n in n_gpus:
        n = int(_check_n(n))
        latency = n_buckets * 2.0 * (n - 1) * alpha_s
        bandwidth = busbw_factor(n) * grad_bytes / bandwidth_Bps
        comm = latency + bandwidth
        no_overlap = compute_s + comm
        overlap = max(compute_s, comm)
        rows.append({"n_gpus": n, "gradient_MB": grad_bytes / 1e6, "n_buckets": n_buckets,
                     "latency_ms": latency * 1e3, "bandwidth_ms": bandwidth * 1e3,
                     "comm_ms": comm * 1e3, "step_ms_no_overlap": no_overlap * 1e3,
                     "step_ms_overlap": overlap * 1e3,
                     "efficiency_no_overlap": compute_s / no_overlap,
                     "efficiency_overlap": compute_s / overlap})
    return rows

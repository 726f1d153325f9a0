"""helpers.bench and helpers.costmodel: formulas, the cost-model fit, and tiny benchmark runs.

No timing is asserted anywhere: the runs only have to return well-formed rows.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import REPO_ROOT, bench, costmodel
from helpers.costmodel import (
    AlphaBetaFit,
    algbw,
    busbw,
    busbw_factor,
    fit_alpha_beta,
    predict_data_parallel,
    ring_allreduce_seconds,
)
from helpers.data import MNIST_MEAN, MNIST_STD, load_mnist
from helpers.engine import launch

# ---- formulas ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 1024])
def test_busbw_is_algbw_times_2_n_minus_1_over_n(n):
    a = algbw(64 * 2**20, 0.01)
    assert a == pytest.approx(64 * 2**20 / 0.01)
    assert busbw(a, n) == pytest.approx(a * 2 * (n - 1) / n)
    assert busbw_factor(n) == pytest.approx(2 * (n - 1) / n)
    assert costmodel.NCCL_TESTS_PERFORMANCE_URL.endswith("nccl-tests/blob/master/doc/PERFORMANCE.md")
    a = algbw(np.array([1e6, 2e6]), np.array([1e-3, 1e-3]))  # vectorised
    np.testing.assert_allclose(busbw(a, 4), a * 1.5)


def test_ring_model_values():
    assert ring_allreduce_seconds(1e9, 1, 1e-5, 1e10) == 0.0
    assert ring_allreduce_seconds(1e9, 2, 1e-5, 1e10) == pytest.approx(2e-5 + 0.1)  # n = 2: 2 alpha + S / B
    # large n: the bandwidth term tends to 2 S / B, the latency term grows linearly
    assert ring_allreduce_seconds(1e9, 1024, 0.0, 1e10) == pytest.approx(2 * 1023 / 1024 * 0.1)


@pytest.mark.parametrize("fn, args", [
    (algbw, (1e6, 0.0)), (busbw_factor, (0,)), (busbw_factor, (2.5,)),
    (ring_allreduce_seconds, (1e9, 2, -1.0, 1e10)), (ring_allreduce_seconds, (1e9, 2, 1e-5, 0.0)),
    (fit_alpha_beta, ([1e6], [2], [1e-3])),  # one point
    (fit_alpha_beta, ([1e6, 2e6], [1, 1], [1e-3, 2e-3])),  # n = 1: no communication
    (fit_alpha_beta, ([1e6, 2e6], [2, 2], [1e-3])),  # lengths differ
    (fit_alpha_beta, ([1e6, 2e6], [2, 2], [1e-3, 0.0])),
    (predict_data_parallel, ([2], 0, 0.1, 1e-5, 1e10)),
    (bench.profile_config, ("huge",)), (bench.build_bench_model, ("resnet",)),
    (bench.run_interleaved, ({"A": lambda n=None: [1.0]}, 0)),  # rounds=0
    (bench.run_benchmarks, (["nonsense"], "smoke", None, False)),  # an unknown benchmark
], ids=lambda v: getattr(v, "__name__", None))
def test_bad_input_raises_value_error(fn, args):
    with pytest.raises(ValueError):
        fn(*args)


@pytest.mark.parametrize("alpha, bw, noise", [(20e-6, 1.2e9, 0), (1e-6, 40e9, 0), (300e-6, 5e8, 0),
                                              (50e-6, 2e9, 0.02)])
def test_fit_recovers_known_alpha_and_bandwidth(alpha, bw, noise):
    """Exact times give the parameters back; times with 2% noise, within 10%."""
    S = np.array([4 * 2**10 * 4**k for k in range(8)] * 2, dtype=float)  # 4 KiB .. 64 MiB
    ns = np.array([2] * 8 + [4] * 8)
    t = ring_allreduce_seconds(S, ns, alpha, bw) * (1 + np.random.default_rng(0).normal(0, noise, S.size))
    fit = fit_alpha_beta(S.tolist(), ns.tolist(), t)
    rel = 0.1 if noise else 1e-6
    assert isinstance(fit, AlphaBetaFit) and len(fit.relative_errors) == S.size
    assert fit.alpha_s == pytest.approx(alpha, rel=rel) and fit.bandwidth_Bps == pytest.approx(bw, rel=rel)
    json.dumps(fit.as_dict())
    if not noise:
        assert fit.max_relative_error < 1e-6
        np.testing.assert_allclose(fit.predict(S, ns), t, rtol=1e-6)


def test_fit_clamps_negative_alpha():
    S = np.array([1e6, 1e7, 1e8])
    t = S / 1e9 - 1e-5 + 2e-5 * (S == 1e8)  # would give a negative latency
    fit = fit_alpha_beta(S, [2, 2, 2], np.abs(t))
    assert fit.alpha_s >= 0 and fit.bandwidth_Bps > 0


def test_predict_data_parallel_shape_and_bounds():
    rows = predict_data_parallel([1, 8, 64, 1024], 25.6e6, 0.1, 10e-6, 12.5e9)
    assert [r["n_gpus"] for r in rows] == [1, 8, 64, 1024]
    assert rows[0]["comm_ms"] == 0 and rows[0]["efficiency_no_overlap"] == pytest.approx(1.0)
    assert rows[0]["n_buckets"] == math.ceil(25.6e6 * 4 / (25 * 2**20))
    for r in rows:
        assert 0 < r["efficiency_no_overlap"] <= r["efficiency_overlap"] <= 1
        assert r["comm_ms"] == pytest.approx(r["latency_ms"] + r["bandwidth_ms"])
    eff = [r["efficiency_no_overlap"] for r in rows]
    assert eff == sorted(eff, reverse=True)
    # the bandwidth term tends to 2 S / B: 2 * 102.4 MB / 12.5 GB/s = 16.4 ms
    assert rows[-1]["bandwidth_ms"] == pytest.approx(2 * 1023 / 1024 * 102.4e6 / 12.5e9 * 1e3)


# ---- bench utilities (no processes) ------------------------------------------------------------

def test_profiles_are_complete_and_copied_and_machine_info_is_json():
    for name in bench.PROFILES:
        cfg = bench.profile_config(name)
        assert set(cfg) == set(bench.BENCHMARKS)
        cfg["pipeline"]["world_sizes"].append(99)
        assert 99 not in bench.PROFILES[name]["pipeline"]["world_sizes"]
    info = bench.machine_info()  # what every JSON file records beside the sizes
    assert info["logical_cpus"] >= 1 and "torch" in info
    json.dumps(info)


def test_models():
    x = torch.zeros(3, 1, 28, 28)
    for name, n in [("linear", 7850), ("cnn", 9098), ("mlp", bench.MLP_PARAMS)]:
        m = bench.build_bench_model(name)
        assert m(x).shape == (3, 10)
        assert sum(p.numel() for p in m.parameters()) == n


@pytest.mark.slow(4)
def test_mmap_path_gives_the_same_normalised_images():
    imgs, labels = bench._mmap_split(False)
    assert imgs.dtype == torch.uint8 and imgs.shape == (10000, 28, 28)
    x, y = load_mnist(train=False)
    got = imgs[:100].unsqueeze(1).float().mul_(1.0 / (255.0 * MNIST_STD)).sub_(MNIST_MEAN / MNIST_STD)
    torch.testing.assert_close(got, x[:100])
    assert torch.equal(labels[:100].long(), y[:100])


def test_memcpy_rows():
    rows = bench.memcpy_bandwidth([4096, 2**20], threads=1, target_bytes=2**22)
    assert [r["bytes"] for r in rows] == [4096, 2**20]
    for r in rows:
        assert r["seconds"] > 0 and r["copy_GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)


def test_run_interleaved_alternates_blocks_after_warming_up_each():
    calls = []

    def mode(name):
        def run(n=None):
            calls.append((name, n))
            return [float(len(calls))]
        return run

    times, order = bench.run_interleaved({"A": mode("A"), "B": mode("B"), "C": None}, rounds=3, warmup=2)
    assert calls[:2] == [("A", 2), ("B", 2)]  # every mode warmed up (2 steps) before any timing
    assert [c[0] for c in calls[2:]] == ["A", "B"] * 3 and all(n is None for _, n in calls[2:])
    assert order == ["A", "B", "C"] * 3  # the process that takes no part in C still counts its blocks
    assert times == {"A": [3.0, 5.0, 7.0], "B": [4.0, 6.0, 8.0]}  # warm-up results are dropped


def test_timeline_overlap_on_a_synthetic_timeline():
    tl = [
        {"kind": "step", "start_ms": 0.0, "dur_ms": 10.0},
        {"kind": "backward", "start_ms": 2.0, "dur_ms": 2.0},
        {"kind": "allreduce launched", "start_ms": 4.0, "dur_ms": 0.1},
        {"kind": "allreduce", "start_ms": 4.0, "dur_ms": 4.0},   # 2 ms inside backward (4..6)
        {"kind": "backward", "start_ms": 4.0, "dur_ms": 2.0},    # last backward op: 4..6
        {"kind": "allreduce launched", "start_ms": 5.9, "dur_ms": 0.1},
        {"kind": "allreduce", "start_ms": 6.0, "dur_ms": 1.0},   # after backward
    ]
    o = bench.timeline_overlap(tl)
    assert o["allreduce_ms"] == pytest.approx(5.0)
    assert o["overlapped_ms"] == pytest.approx(2.0)
    assert o["overlap_fraction"] == pytest.approx(0.4)
    assert o["launches"] == 2 and o["launched_early"] == 0 and o["backward_ms"] == pytest.approx(4.0)
    # busy times are of the union of the all-reduce events (two threads may run at once)
    assert o["busy_ms"] == pytest.approx(4.0)  # 4..8; the 6..7 call runs beside it
    assert o["busy_in_backward_ms"] == pytest.approx(2.0) and o["busy_after_backward_ms"] == pytest.approx(2.0)
    assert o["step_ms"] == [10.0] and o["steps"] == 1
    assert o["launched_early_per_step"] == [0]
    tl[2]["start_ms"] = 3.0
    assert bench.timeline_overlap(tl)["launched_early"] == 1
    # a second step with no early launch: the total (1) hides it, the per-step list does not
    second = [dict(e, start_ms=e["start_ms"] + 20.0) for e in tl
              if e["kind"] != "allreduce launched" or e["start_ms"] > 5]
    assert bench.timeline_overlap(tl + second)["launched_early_per_step"] == [1, 0]
    after = [dict(e, start_ms=e["start_ms"] + 3.0) if e["kind"] == "allreduce" else e for e in tl]  # 7..11, 9..10
    o = bench.timeline_overlap(after)
    assert o["busy_in_backward_ms"] == 0 and o["busy_after_backward_ms"] == pytest.approx(4.0)


@pytest.mark.slow(10)
def test_cli_help_runs_as_a_module_and_refuses_unknown_names():
    proc = subprocess.run([sys.executable, "-m", "helpers.bench", "--help"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines at the terminal width
    assert "usage: python -m helpers.bench" in text
    assert "pipeline, scaling, allreduce, launch, memory, buckets, simulated" in text
    with pytest.raises(SystemExit):  # an unknown name
        bench.main(["nonsense"])


# ---- tiny runs through the launcher (well-formed rows; no timing asserted) ---------------------

@pytest.mark.slow(15)
@pytest.mark.timeout(180)
def test_simulated_rows_beside_real_ranks():
    rows = bench.bench_simulated([4], [2], steps=2, batch=8)
    assert [(r["mode"], r["world_size"]) for r in rows] == [("gloo", 2), ("simulated", 4)]
    for r in rows:
        assert r["step_s"] > 0 and r["peak_rss_mib"] > 0
    assert rows[0]["step_vs_real"] == 1 and rows[0]["rss_vs_real"] == 1
    assert rows[1]["step_vs_real"] == pytest.approx(rows[1]["step_s"] / rows[0]["step_s"])

@pytest.mark.slow(20)
@pytest.mark.timeout(120)
def test_tiny_allreduce(no_leftover_processes):
    out = bench.bench_allreduce([2], [4, 64])
    rows = out["allreduce"]
    assert [(r["world_size"], r["bytes"]) for r in rows] == [(2, 4096), (2, 65536)]
    for r in rows:
        assert r["seconds"] > 0 and r["iters"] >= 3
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (2 - 1) / 2)
        assert r["copy_GBps"] > 0
        # measured by the kernel: each of 2 ranks sends at least the ring's 2(n-1)/n * S = S bytes
        assert len(r["sent_bytes_per_call"]) == 2 and min(r["sent_bytes_per_call"]) >= r["bytes"]
    assert max(rows[1]["sent_bytes_per_call"]) <= 1.02 * rows[1]["bytes"]  # 64 KiB: headers are small
    assert len(out["memcpy"]) == 2


@pytest.mark.slow(8)
@pytest.mark.timeout(120)
def test_tiny_pipeline_same_accuracy(no_leftover_processes):
    rows = bench.bench_pipeline([1], n_train=256, n_test=200, repeats=2)
    # the timed epochs alternate between the pipelines, repeat after repeat
    timed = sorted(rows, key=lambda r: r["timed_position"])
    assert [(r["repeat"], r["wrapper"], r["pipeline"]) for r in timed] == [
        (rep, w, p) for rep in (0, 1) for w in ("none", "ddp") for p in ("seed", "memory")]
    rows = [r for r in rows if r["repeat"] == 0]
    by = {(r["wrapper"], r["pipeline"]): r for r in rows}
    assert set(by) == {(w, p) for w in ("none", "ddp") for p in ("seed", "memory")}
    for r in rows:
        assert r["samples"] == 256 and r["steps_per_rank"] == 4 and r["samples_per_s"] > 0
        assert 0 <= r["test_accuracy"] <= 1
    for w in ("none", "ddp"):
        seed, memory = by[(w, "seed")], by[(w, "memory")]
        assert seed["speedup_vs_seed"] == 1.0
        # same initial weights, same sampler order, same normalisation: the same model up to rounding
        assert abs(seed["test_accuracy"] - memory["test_accuracy"]) <= 0.005
        assert seed["final_loss_rank0"] == pytest.approx(memory["final_loss_rank0"], rel=1e-4)
    # DDP with one rank averages over one rank: the same training as the plain module
    ddp_loss, plain_loss = by[("ddp", "memory")]["final_loss_rank0"], by[("none", "memory")]["final_loss_rank0"]
    assert ddp_loss == pytest.approx(plain_loss, rel=1e-5)


@pytest.mark.slow(4)
@pytest.mark.timeout(180)
def test_scaling_alternates_every_mode_in_one_launch(no_leftover_processes):
    """Notebook 05a's comparison: 1 and 2 ranks, the single process and DP, timed in alternation
    (round after round of one block per mode), each warmed up first; rows report median and min-max
    and where the time went (no_sync, one rank alone)."""
    rows = bench.bench_scaling([[1, 1], [2, 1]], ["linear"], [64], steps=1, warmup=1, rounds=3, local=True)
    labels = [r["label"] for r in rows]
    threads = sorted({1, os.cpu_count() or 1})
    assert labels == ["ddp 1x1", "ddp 2x1"] + [f"{m} {t}" for m in ("single", "dp") for t in threads]
    one_round = ["ddp 1x1", "ddp 1x1 no_sync", "ddp 2x1", "ddp 2x1 no_sync", "ddp 2x1 solo",
                 *[f"{m} {t}" for m in ("single", "dp") for t in threads]]
    order = rows[0]["timed_order"]
    assert order == one_round * 3, order  # A B C .. A B C .., never all of A first
    assert all(r["timed_order"] == order for r in rows)
    for r in rows:
        assert r["rounds"] == 3 and r["steps"] == 1
        assert 0 < r["step_ms_min"] <= r["step_ms"] <= r["step_ms_max"]
        assert r["samples_per_s_min"] <= r["samples_per_s"] <= r["samples_per_s_max"]
    by = {r["label"]: r for r in rows}
    if not torch.cuda.is_available():
        assert by["dp 1"]["dp_device_ids"] == []  # DP on CPU has no devices: it just calls the module
    assert by["ddp 1x1"]["speedup"] == pytest.approx(1.0)
    assert by["ddp 1x1"]["solo_step_ms"] == by["ddp 1x1"]["nosync_step_ms"]  # one rank: alone = no_sync
    r = by["ddp 2x1"]
    assert r["samples_per_s"] == pytest.approx(64 / (r["step_ms"] / 1e3))
    assert r["nosync_step_ms"] > 0 and r["comm_exposed_ms"] == pytest.approx(r["step_ms"] - r["nosync_step_ms"])
    assert r["solo_step_ms"] > 0 and r["interference_ms"] == pytest.approx(r["nosync_step_ms"] - r["solo_step_ms"])
    assert r["speedup"] == pytest.approx(r["samples_per_s"] / by["ddp 1x1"]["samples_per_s"])
    assert r["dataset_mib_per_rank"] == pytest.approx((60000 * 784 * 4 + 60000 * 8) / 2**20)
    # measured in the ranks: the storages allocated, and the resident memory the load added
    assert r["dataset_storage_mib_per_rank"] == pytest.approx(r["dataset_mib_per_rank"])
    assert r["dataset_rss_growth_mib_per_rank"] >= 60000 * 784 * 4 / 2**20
    with pytest.raises(ValueError, match="not divisible"):  # before any launch
        bench.bench_scaling([[2, 1]], ["linear"], [63], steps=1, warmup=0, local=False)
    with pytest.raises(Exception, match="needs at least 4 ranks"):
        launch(bench.scaling_worker, 2, [[4, 1]], ["linear"], [64], 1, 0, 1)


@pytest.mark.slow(7)
@pytest.mark.timeout(120)
def test_tiny_buckets_and_timeline(no_leftover_processes):
    out = bench.bench_buckets(2, [1.0, 100.0], [False], steps=2, warmup=1, profile_cap_mb=1.0, rounds=2)
    rows = out["rows"]
    assert [r["bucket_cap_mb"] for r in rows] == [1.0, 100.0]
    small, big = rows
    # the caps were timed in alternation (one block each per round), not one after the other
    assert small["timed_order"] == ["1/False", "100/False"] * 2
    assert small["step_ms_min"] <= small["step_ms"] <= small["step_ms_max"]
    assert small["n_buckets"] > big["n_buckets"] >= 1  # smaller cap, more buckets
    assert sum(small["bucket_mb"]) == pytest.approx(bench.MLP_PARAMS * 4 / 1e6, rel=1e-6)
    largest = max(p.numel() * 4 for p in bench.build_bench_model("mlp").parameters())
    assert all(b * 1e6 < 2**20 + largest for b in small["bucket_mb"]) and max(small["bucket_mb"]) * 1e6 > 2**20
    # bucket_cap_mb left at its default: the first bucket closes at 1 MiB, the rest at 25 MiB
    first, *rest = out["default_cap_bucket_mb"]
    assert 2**20 <= first * 1e6 < 2**20 + largest and len(rest) == 1
    # the first step runs on one bucket of everything; the rebuilt buckets list their tensors, and the
    # tensor larger than the cap (the first layer's weight) closes a bucket it shares with the one before it
    for r in rows:
        assert r["first_step_bucket_mb"] == [pytest.approx(bench.MLP_PARAMS * 4 / 1e6, rel=1e-6)]
        assert [sum(b) for b in r["bucket_tensor_bytes"]] == [round(mb * 1e6) for mb in r["bucket_mb"]]
    assert [len(b) for b in small["bucket_tensor_bytes"] if max(b) == largest] == [2]
    assert [sum(b) for b in out["default_cap_bucket_tensor_bytes"]] == [round(mb * 1e6) for mb in [first, *rest]]
    kinds = {e["kind"] for e in out["timeline"]}
    assert {"forward", "backward", "allreduce launched", "allreduce", "step"} <= kinds
    o = bench.timeline_overlap(out["timeline"])
    # DDP launches every bucket but the last while backward still has gradients to compute
    assert o["launches"] == 2 * small["n_buckets"]
    assert o["launched_early"] == 2 * (small["n_buckets"] - 1)
    # the comparison run: the same buckets, all-reduced only after backward (no overlap)
    after = bench.timeline_overlap(out["timeline_after_backward"])
    assert after["launches"] == 2 * small["n_buckets"] and after["launched_early"] == 0
    assert after["busy_in_backward_ms"] == 0 and after["busy_after_backward_ms"] > 0 and after["steps"] == 2


def test_threads_by_launcher_hides_omp_num_threads_and_restores_it(monkeypatch):
    """The children of ``bench_threads_by_launcher`` see no OMP_NUM_THREADS (each launcher's own
    default is what is measured) and the caller's value is back afterwards, even when a child
    fails. Every row of the real run (five launchers, real processes) is asserted by notebook 05a,
    section 2, which the suite runs in the smoke profile (tests/course/test_notebooks.py)."""
    from helpers.bench import threads

    seen = []

    def first_child_fails(cmd, env=None, **kwargs):
        seen.append(env)
        raise subprocess.CalledProcessError(1, cmd)

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(threads.subprocess, "Popen", first_child_fails)
    with pytest.raises(subprocess.CalledProcessError):
        bench.bench_threads_by_launcher(2)
    assert seen and "OMP_NUM_THREADS" not in seen[0]
    assert os.environ["OMP_NUM_THREADS"] == "3"


@pytest.mark.slow(30)
@pytest.mark.timeout(600)
def test_launch_bench_puts_warm_ranks_beside_cold_launch(no_leftover_processes):
    """`python -m helpers.bench launch` rows: warm-rank start-up and warm calls beside cold launches
    of the same worker, and a table with the ratio (no timing asserted). Each launch in it checks
    its results are in rank order (``bench.spawn_launch``'s too: it has no test of its own, which
    would start two more fresh interpreters)."""
    rows = bench.bench_launch_overhead(world_sizes=(2,), repeats=1)
    methods = {r["method"] for r in rows}
    assert {"helpers.engine.launch", bench.LAUNCH_FIRST, "torch.multiprocessing.spawn", bench.WARM_START,
            bench.WARM_RUN, bench.WARM_START_FRESH} <= methods
    assert sum(r["method"] == bench.WARM_RUN for r in rows) == 10
    ((_, ratio),) = [t for t in bench._tables("launch", rows) if t[0].startswith("warm ranks")]
    warm_ratio = ratio["cold_launch_s"].iloc[0] / ratio["warm_run_s"].iloc[0]
    assert list(ratio.columns) == ["start_ranks_s", "start_ranks_fresh_engines_s", "cold_launch_s", "warm_run_s",
                                   "warm_speedup_x"]
    assert ratio["warm_speedup_x"].iloc[0] == pytest.approx(warm_ratio)


def test_load_line_flags_a_busy_machine(monkeypatch):
    """05a and 05b print it beside their timings: BUSY above 3/4 of the CPUs' 1-minute load."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (2.9, 1.0, 0.5))
    assert bench.load_line("start") == "load average (start): 2.90 (1 min), 1.00 (5 min) on 4 cores"
    monkeypatch.setattr(os, "getloadavg", lambda: (3.1, 1.0, 0.5))
    assert bench.load_line("end").endswith(
        "on 4 cores  <-- BUSY: other processes compete for the cores, timings are distorted")

"""The GPU path, checked in one command on a machine with CUDA (issue 15).

    python ci/gpu_check.py OUT_DIR

Runs, each as a check that is ``ok`` or ``failed`` (a failure does not stop the others): the
runner's ``gpu`` profile on every notebook with a GPU branch (:data:`GPU_NOTEBOOKS`, executed
under ``OUT_DIR/notebooks/gpu/``); ``launch`` with ``backend="nccl"``; real ``nn.DataParallel``
over every visible GPU against one device; ``nn.SyncBatchNorm`` under nccl against
``nn.BatchNorm1d`` on the CPU (one GPU: torch runs it as plain batch norm, which the summary
says); warm ranks with nccl.

Writes ``OUT_DIR/summary.json`` and ``summary.md`` (GPU, torch, CUDA, each check with its
seconds and error, every ``**Claim (GPU):**`` of the lessons with its status from
``ci/gpu_claims.py``) and ``runner_table.txt``. Exit code 0 when every check is ok, 1 otherwise,
2 without CUDA (refused before anything runs). Meant to finish in under 8 minutes on one GPU;
the notebook run is cut at ``--notebook-budget`` seconds. No process is left behind (checked).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

# All at module level: every run but `--help` needs torch (the CUDA test comes first), and the
# functions below that launch sends to the ranks by value find these as globals there.
import psutil
import torch
import torch.distributed as dist
from torch import nn

from ci.gpu_claims import gpu_claim_status

try:
    from helpers.engine import launch, leftover_children, start_ranks, worker_device
    from helpers.engine.internal import end_processes
except ModuleNotFoundError as e:  # run as a file without the repository installed
    if e.name != "helpers":
        raise
    sys.exit("error: the package `helpers` is not importable: install the repository first "
             "(`python3 -m pip install -r requirements.lock`, which runs `pip install -e .`), "
             "or run `python3 -m ci.gpu_check ...` from the repository root")

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_NOTEBOOKS = ["01", "04", "05a", "05b", "06b", "07a", "07b"]
EXIT_OK, EXIT_FAILED, EXIT_NO_CUDA = 0, 1, 2


def no_cuda_message() -> str | None:
    """None when CUDA is usable here, else why the check cannot run."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return (f"this machine has no usable CUDA GPU (torch {torch.__version__}, "
                f"torch.version.cuda={torch.version.cuda}, torch.cuda.is_available()="
                f"{torch.cuda.is_available()}). ci/gpu_check.py checks the GPU path and must run on a "
                "machine with an NVIDIA GPU and a CUDA build of torch; nothing was run.")
    return None


# the checks (functions defined here are sent to the ranks by value by launch)

def nccl_allreduce(rank, world_size):
    device = worker_device()
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    return {"backend": dist.get_backend(), "device": str(device), "sum": t.cpu().tolist()}


def check_launch_nccl() -> str:
    (r,) = launch(nccl_allreduce, 1, backend="nccl", timeout=120)
    assert r["backend"] == "nccl" and r["device"] == "cuda:0", r
    assert r["sum"] == [1.0] * 4, r
    return f"launch(backend='nccl', world_size=1): backend {r['backend']}, device {r['device']}"


def check_data_parallel() -> str:
    n = torch.cuda.device_count()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
    x, y = torch.randn(8 * n, 16, device="cuda"), torch.randn(8 * n, 4, device="cuda")
    nn.functional.mse_loss(model(x), y).backward()
    single = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    dp = nn.DataParallel(model)
    assert dp.device_ids == list(range(n)), dp.device_ids
    nn.functional.mse_loss(dp(x), y).backward()
    for a, b in zip(single, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    return f"nn.DataParallel over device_ids {dp.device_ids}: gradients equal one device's"


def syncbn_rank(rank, world_size, x_all):
    device = worker_device()
    shard = x_all.chunk(world_size)[rank].to(device)
    sync = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(x_all.shape[1]))).to(device)
    out = sync(shard)
    return {"type": type(sync[0]).__name__, "device": str(out.device), "out": out.detach().cpu(),
            "running_mean": sync[0].running_mean.cpu(), "running_var": sync[0].running_var.cpu()}


def check_syncbn() -> str:
    n = torch.cuda.device_count()
    x = torch.randn(8 * n, 3, generator=torch.Generator().manual_seed(1))
    results = launch(syncbn_rank, n, x, backend="nccl", timeout=180)
    bn = nn.BatchNorm1d(3)
    expected = bn(x)
    for rank, r in enumerate(results):
        assert r["type"] == "SyncBatchNorm" and r["device"].startswith("cuda"), r
        torch.testing.assert_close(r["out"], expected.chunk(n)[rank], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r["running_mean"], bn.running_mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r["running_var"], bn.running_var, rtol=1e-4, atol=1e-5)
    note = "" if n > 1 else " (one GPU: torch runs SyncBatchNorm as plain batch norm at world_size 1)"
    return f"SyncBatchNorm on {n} GPU rank(s) equals BatchNorm1d on the whole batch{note}"


def check_warm_ranks() -> str:
    warm = start_ranks(1, backend="nccl", timeout=120)
    try:
        (r,) = warm.run(nccl_allreduce)
        assert r["backend"] == "nccl" and r["sum"] == [1.0] * 4, r
    finally:
        warm.stop()
    return "warm ranks with nccl at world_size 1: all_reduce on cuda:0 checked"


def check_notebooks(out_dir: Path, budget_s: float) -> str:
    cmd = [sys.executable, str(REPO_ROOT / "ci" / "run_notebooks.py"), "--profile", "gpu",
           "--output-dir", str(out_dir / "notebooks"), *GPU_NOTEBOOKS]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        runner = psutil.Process(proc.pid)
        end_processes([runner, *runner.children(recursive=True)], 3.0)  # the runner, its kernels, their ranks
        output, _ = proc.communicate()
        (out_dir / "runner_table.txt").write_text(output)
        raise RuntimeError(f"the runner took longer than {budget_s:.0f} s (it and its kernels were ended); "
                           "see runner_table.txt") from None
    (out_dir / "runner_table.txt").write_text(output)
    if proc.returncode != 0:
        raise RuntimeError(f"runner exit code {proc.returncode}; see runner_table.txt:\n{output[-2500:]}")
    return f"runner --profile gpu {' '.join(GPU_NOTEBOOKS)}: every notebook ok"


def gpu_claims(executed_dir: Path | None = None) -> list[dict]:
    """Every ``**Claim (GPU):**`` of the lessons with its ``status`` in ``executed_dir`` (None: not run)."""
    return gpu_claim_status(executed_dir)


def claims_lines(rows: list[dict]) -> list[str]:
    """The markdown table of :func:`gpu_claims`' rows."""
    return (["| lesson | GPU claim | status |", "| --- | --- | --- |"]
            + [f"| {r['lesson']} | {r['claim']} | {r['status']} |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python ci/gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="folder for the executed notebooks, the runner table and the summary")
    p.add_argument("--notebook-budget", type=float, default=330.0,
                   help="seconds for the runner's gpu profile (default 330)")
    a = p.parse_args(argv)
    reason = no_cuda_message()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return EXIT_NO_CUDA

    out = Path(a.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    checks = [("launch nccl world_size 1", check_launch_nccl),
              ("real nn.DataParallel", check_data_parallel),
              ("SyncBatchNorm on GPU", check_syncbn),
              ("warm ranks nccl", check_warm_ranks),
              ("notebooks, runner profile gpu", lambda: check_notebooks(out, a.notebook_budget))]
    rows = []
    for name, fn in checks:
        start = time.monotonic()
        try:
            detail, status = fn(), "ok"
        except BaseException as e:  # noqa: BLE001 - report every check
            if isinstance(e, KeyboardInterrupt):
                raise
            detail, status = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}", "failed"
        rows.append({"check": name, "status": status, "seconds": round(time.monotonic() - start, 1),
                     "detail": detail})
        print(f"{status:6s} {name} ({rows[-1]['seconds']} s): {detail.splitlines()[0]}", flush=True)
    claims = gpu_claims(out / "notebooks" / "gpu")
    for r in claims:
        print(f"GPU claim, {r['status']}: {r['lesson']}: {r['claim']}", flush=True)
    left = [c for c in leftover_children() if c.pid not in before]
    survivors = end_processes(left, 3.0)
    summary = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
               "host": platform.node(),
               "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
               "torch": torch.__version__, "cuda": torch.version.cuda,
               "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
               "python": platform.python_version(), "seconds": round(time.monotonic() - t0, 1),
               "processes_left": len(left), "processes_unkillable": len(survivors), "checks": rows,
               "gpu_claims": claims}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# GPU check, {summary['date_utc']} UTC", "",
             f"GPUs: {', '.join(summary['gpus'])}; torch {summary['torch']}, CUDA {summary['cuda']}, "
             f"NCCL {summary['nccl']}, Python {summary['python']}; {summary['seconds']} s in all; "
             f"processes left: {summary['processes_left']}.", "",
             "| check | status | seconds | detail |", "| --- | --- | ---: | --- |"]
    lines += [f"| {r['check']} | {r['status']} | {r['seconds']} | {r['detail'].splitlines()[0]} |" for r in rows]
    lines += ["", f"{sum(r['status'] == 'proven on GPU' for r in claims)} of {len(claims)} GPU claims proven "
              "(the same claims print `not proven here` on CPU):", "", *claims_lines(claims)]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print(f"\nsummary: {out / 'summary.md'}")
    ok = all(r["status"] == "ok" for r in rows) and not left
    return EXIT_OK if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

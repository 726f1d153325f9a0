r"""What every rank runs under torchrun: ``torchrun ... -m helpers.mnist_torchrun`` (notebook 07a).

:func:`main` joins the process group torchrun describes (:func:`helpers.engine.main_from_env`)
and runs :func:`cluster_train_worker`: :func:`helpers.mnist_train.ddp_train_worker`, plus what
torchrun told this process (:data:`ENV_KEYS`), written to ``DIR/rank<RANK>.json`` with
``--output DIR``. Notebook 07a checks the losses equal the notebook's ``launch`` run.
:func:`cluster_commands` and :func:`run_job` are :mod:`helpers.engine.cluster`'s, with this
module as the entry.

The commands (run from the repository root, after ``pip install -r requirements.lock``; add
``--output runs/job1`` to keep every rank's history as JSON):

One machine, 2 processes::

    torchrun --standalone --nproc-per-node=2 -m helpers.mnist_torchrun --epochs 1

Several machines, 2 processes each, c10d rendezvous (run the same command on every node;
HOST0 is the address of the first node, reachable from all nodes; any free port)::

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \
        --rdzv-id=mnist-job1 -m helpers.mnist_torchrun --epochs 1

SLURM batch script (``sbatch mnist.sbatch``; one torchrun agent per node, which starts one
worker per GPU)::

    #!/bin/bash
    #SBATCH --job-name=ddp-lab-mnist
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=1
    #SBATCH --gpus-per-node=2
    #SBATCH --cpus-per-task=8
    #SBATCH --time=00:30:00
    set -euo pipefail
    head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    export OMP_NUM_THREADS=1
    srun torchrun --nnodes="$SLURM_NNODES" --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint="$head_node:29500" --rdzv-id="$SLURM_JOB_ID" \
        -m helpers.mnist_torchrun --epochs 1 --output "runs/$SLURM_JOB_ID"

Add ``--max-restarts=3`` to let torchrun restart the whole worker group after a failure
(training restarts from step 0: this entry point does not checkpoint). With GPUs each rank uses
``cuda:<LOCAL_RANK>`` and nccl; without, gloo on the CPU. :func:`cluster_commands` returns
exactly these texts (a test checks that this docstring and ``docs/CLUSTER.md`` hold them).

Fault injection for teaching (never on by default): ``--fail-rank R --fail-at-step S`` makes
global rank ``R`` raise :class:`InjectedFailure` in the forward pass of training step ``S``
(1-based) while ``TORCHELASTIC_RESTART_COUNT < --fail-attempts`` (default: always).

References: torchrun https://pytorch.org/docs/stable/elastic/run.html; errors and ``@record``
https://pytorch.org/docs/stable/elastic/errors.html.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel

from helpers.engine import BACKENDS, main_from_env, resolve_backend
from helpers.engine.cluster import JobResult
from helpers.engine.cluster import cluster_commands as _cluster_commands
from helpers.engine.cluster import run_job as _run_job
from helpers.mnist_train import MODELS, TrainConfig, ddp_train_worker

__all__ = ["ENV_KEYS", "MODULE", "InjectedFailure", "cluster_commands", "cluster_train_worker", "main", "run_job"]

#: this module's name: what torchrun runs in every rank (``torchrun ... -m helpers.mnist_torchrun``)
MODULE = "helpers.mnist_torchrun"

#: Environment variables torchrun sets in every worker, reported in each rank's output.
ENV_KEYS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME")


class InjectedFailure(RuntimeError):
    """The failure ``--fail-rank/--fail-at-step`` injects (teaching only)."""


def _install_failure(rank: int, fail_rank: int | None, fail_at_step: int, fail_attempts: int):
    """A global forward pre-hook that raises in rank ``fail_rank``'s training step
    ``fail_at_step`` (forwards through the DDP wrapper only, so evaluation does not count);
    ``None`` when nothing is injected on this rank or restart."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if fail_rank is None or rank != fail_rank or restart >= fail_attempts:
        return None
    steps = [0]

    def hook(module, inputs):
        if isinstance(module, DistributedDataParallel):
            steps[0] += 1
            if steps[0] == fail_at_step:
                raise InjectedFailure(f"injected failure: rank {rank}, training step {fail_at_step}, "
                                      f"restart count {restart} (--fail-rank/--fail-at-step)")

    return register_module_forward_pre_hook(hook)


def _net_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/net")  # e.g. "net:[4026531840]": one id per namespace
    except OSError:
        return "unknown"


def cluster_train_worker(rank: int, world_size: int, config, output_dir: str | None = None,
                         fail_rank: int | None = None, fail_at_step: int = 1,
                         fail_attempts: int = 10**9) -> dict[str, Any]:
    """One rank of notebook 04's DDP training, under torchrun (or :func:`helpers.engine.launch`).

    Returns :func:`ddp_train_worker`'s history plus ``"node"``: :data:`ENV_KEYS`' values,
    ``hostname``, ``pid`` and ``net_namespace``. With ``output_dir`` (created if missing) the
    history is also written as JSON to ``output_dir/rank<rank>.json``. ``fail_*``: fault
    injection (module docstring); raises :class:`InjectedFailure` when it fires.
    """
    handle = _install_failure(rank, fail_rank, fail_at_step, fail_attempts)
    try:
        history = ddp_train_worker(rank, world_size, config)
    finally:
        if handle is not None:
            handle.remove()
    history["node"] = {
        **{k: os.environ.get(k) for k in ENV_KEYS},
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "net_namespace": _net_namespace(),
    }
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".rank{rank}.json.tmp{os.getpid()}"
        tmp.write_text(json.dumps(history))
        os.replace(tmp, out / f"rank{rank}.json")
    return history


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"torchrun ... -m {MODULE}",
        description="Notebook 04's MNIST DDP training as a torchrun entry point "
                    f"(torchrun --standalone --nproc-per-node=2 -m {MODULE} --epochs 1).")
    p.add_argument("--global-batch-size", type=int, default=64, help="samples per optimizer step, all ranks")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps; 0: full epochs")
    p.add_argument("--model", choices=MODELS, default="linear")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    p.add_argument("--output", default=None, help="folder for rank<R>.json (history and torchrun env)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="default: nccl when this node has a GPU per local rank, else gloo")
    p.add_argument("--fail-rank", type=int, default=None, help="(teaching) global rank that raises")
    p.add_argument("--fail-at-step", type=int, default=1, help="(teaching) 1-based training step to fail in")
    p.add_argument("--fail-attempts", type=int, default=10**9,
                   help="(teaching) fail only while TORCHELASTIC_RESTART_COUNT is below this")
    return p.parse_args(argv)


# torchelastic's ``@record``: an uncaught exception in a worker is written to the error file
# torchrun reads, so the agent's failure summary shows the worker's traceback.
@record
def main(argv: list[str] | None = None) -> None:
    """``torchrun ... -m helpers.mnist_torchrun ...``: one rank of the MNIST training.

    Raises:
        SystemExit: when not started by torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` or
            ``MASTER_PORT`` missing from the environment), saying how to start it.
        ValueError: ``--backend nccl`` without one CUDA GPU per local rank
            (:func:`helpers.engine.resolve_backend`).
    """
    a = _parse(argv)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise SystemExit(f"{MODULE} runs under torchrun, which sets {', '.join(missing)}. "
                         f"Start it with e.g. `torchrun --standalone --nproc-per-node=2 -m {MODULE} "
                         "--epochs 1`, or "
                         "from a notebook with helpers.engine.launch(ddp_train_worker, 2, TrainConfig()).")
    config = TrainConfig(global_batch_size=a.global_batch_size, lr=a.lr, epochs=a.epochs,
                         max_steps=a.max_steps, model=a.model, seed=a.seed, progress=not a.no_progress)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True)
        except Exception:  # noqa: BLE001 - not a TextIOWrapper
            pass
    backend = resolve_backend(a.backend, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    h = main_from_env(cluster_train_worker, config, a.output, a.fail_rank, a.fail_at_step, a.fail_attempts,
                      backend=backend)
    n = h["node"]
    print(f"[rank {h['rank']}/{h['world_size']}, node {n['GROUP_RANK']}, local rank {n['LOCAL_RANK']}] "
          f"{h['steps']} steps, final loss {h['losses'][-1]:.4f}, test accuracy {h['test_accuracy']:.4f}, "
          f"restart count {n['TORCHELASTIC_RESTART_COUNT']}")


def cluster_commands(**options) -> dict[str, str]:
    """The torchrun commands that run this module (one node, several nodes, SLURM), as text:
    :func:`helpers.engine.cluster.cluster_commands` with ``module=MODULE``; ``options`` are its
    keywords (``nproc_per_node``, ``nnodes``, ``host``, ``port``, ``rdzv_id``, ``args``)."""
    return _cluster_commands(module=MODULE, **options)


def run_job(train_args, **options) -> JobResult:
    """Run this module under torchrun as one or several "nodes" on this machine:
    :func:`helpers.engine.cluster.run_job` with ``module=MODULE``; ``train_args`` are :func:`main`'s
    options, ``options`` the job's shape (``nodes``, ``nproc_per_node``, ``network``,
    ``max_restarts``, ``timeout``, ``env``)."""
    return _run_job(train_args, module=MODULE, **options)


if __name__ == "__main__":
    main()

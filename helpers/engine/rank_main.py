"""What runs inside each rank that :func:`helpers.engine.launch` starts: :func:`worker_entry`, which

1. asks Linux to SIGKILL the rank when its parent dies (``PR_SET_PDEATHSIG``: a launcher killed by
   SIGKILL or the OOM killer leaves no rank; the reaper removes its run folder) and starts a
   session the launcher ends; closes its copy of the fork server's pipe; seeds its generators
   afresh; captures its stdout and stderr (:mod:`~helpers.engine.rank_output`); keeps its store and
   gloo on loopback (:func:`~helpers.engine.processes.listen_on_loopback`);
2. registers its stack dump on SIGUSR1 (:mod:`~helpers.engine.stacks`), writes its ``pid`` marker,
   sets its thread count, unpickles ``fn, args, kwargs``;
3. joins the default group, writes its ``started`` marker (``timeout`` counts from all of them) and
   calls ``fn(rank, world_size, *args, **kwargs)``;
4. writes its ``done`` (or ``error``) marker, waits for its peers' markers, destroys the group and
   hands the cloudpickled result to the agent; rank 0 prints :func:`alone_note` where it applies.

:func:`worker_device` is what ``fn`` calls to find its device.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import multiprocessing
import os
import signal
import sys
import time
import traceback

import cloudpickle
import psutil
import torch
import torch.distributed as dist

from helpers.engine import processes as procs
from helpers.engine import stacks
from helpers.engine.fork_server import AGENT_ENV, close_inherited_pipe, fresh_random_state
from helpers.engine.rank_output import capture_output
from helpers.engine.run_dir import write_marker
from helpers.engine.start_method import with_hint

__all__ = ["worker_device", "worker_entry"]


def worker_device():
    """The ``torch.device`` this rank should use: ``cuda:<local_rank>`` under nccl, else ``cpu``."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def alone_note(world_size: int, caller: str = "launch") -> str | None:
    """A note for the cell when a rank's code ran as a job of its own although ``caller`` started
    ``world_size`` > 1 ranks, else ``None``: accelerate's ``DistributedType.NO`` (with no GPU it uses the
    group only with ``ACCELERATE_USE_CPU``, accelerate/state.py ``_prepare_backend``; under simulate
    never: it reads ``RANK`` from ``os.environ``), or a default group of 1 rank (e.g. Fabric ``devices=1``)."""
    if world_size < 2:
        return None
    state = sys.modules.get("accelerate.state")
    try:
        kind = getattr(state.PartialState, "_shared_state", {}).get("distributed_type") if state else None
    except Exception:  # noqa: BLE001 - another accelerate: no note
        kind = None
    if getattr(kind, "value", kind) == "NO":
        alone = (f"Note: accelerate ran each of the {world_size} ranks as a job of its own (DistributedType.NO, "
                 "num_processes 1: no gradients averaged, every rank sees all the data). ")
        if caller == "simulate":
            return alone + ("It reads RANK and WORLD_SIZE from os.environ, which simulated ranks (threads of one "
                            "process) share: run the code with helpers.engine.launch and "
                            "os.environ['ACCELERATE_USE_CPU'] = 'yes' instead.")
        return alone + ("With no GPU it uses the ranks only when told the job is on CPU: set "
                        "os.environ['ACCELERATE_USE_CPU'] = 'yes' before the launch (what `accelerate launch --cpu` "
                        "sets), or write Accelerator(cpu=True).")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        return (f"Note: {caller} started {world_size} ranks, but your function ended in a process group of 1 rank: "
                "it (or a framework it uses, e.g. Lightning Fabric with devices=1) set up a group of its own, so "
                "each rank ran as a job of its own (no gradients averaged). Use the group the ranks start with "
                f"(no init_process_group), or give the framework the world size (e.g. Fabric(devices={world_size}, "
                "strategy='ddp')).")
    return None


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with_parent(parent_pid: int, launcher_pid: int) -> None:
    """Linux only: SIGKILL this process when its parent (``parent_pid``) dies (``PR_SET_PDEATHSIG`` fires
    when the creating *thread* exits: the fork server's only one, or the launcher's agent thread, which
    outlives the ranks), exiting at once if it already did; a rank forked after the launcher
    (``launcher_pid``) died SIGKILLs the server and itself. Then a session of its own (``os.setsid``),
    which keeps what the rank starts, even re-parented, for the launcher to end."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    if parent_pid != launcher_pid and _parent_of(parent_pid) != launcher_pid:
        os.kill(parent_pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    with contextlib.suppress(OSError):  # already a session leader
        os.setsid()


def _parent_of(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def _wait_for_peers(run_dir: str, world_size: int, poll_s: float = 0.01) -> None:
    """Return once every rank wrote its ``done`` marker (or any its ``error`` one). Not a collective: it
    never pairs with one a rank's code left unmatched (a hang would read "Connection closed by peer")."""
    while True:
        if all(os.path.exists(os.path.join(run_dir, f"done.{r}")) for r in range(world_size)):
            return
        if glob.glob(os.path.join(run_dir, "error.*")):
            return
        time.sleep(poll_s)


def _write_started(run_dir: str, rank: int) -> None:
    """Write the ``started`` marker just before ``fn`` is called: start-up is over (the launcher's
    ``timeout`` counts from when every rank has one)."""
    write_marker(run_dir, "started", rank, {"time": time.time()})


def worker_entry(payload: bytes, run_dir: str, parent_pid: int, launcher_pid: int, backend: str | None,
                 timeout_s: float | None, threads: int, style: str) -> bytes:
    """What each spawned process runs (via the elastic agent): set up, call ``fn``, report.

    ``payload`` is ``cloudpickle.dumps((fn, args, kwargs))``. ``style`` is ``"launch"``
    (initialise the default group, call ``fn(rank, world_size, *args, **kwargs)``) or ``"spawn"``
    (``torch.multiprocessing.spawn``'s contract: no group, ``fn(rank, *args)``). Returns the
    cloudpickled result, so a cell-defined class can come back too.
    """
    _die_with_parent(parent_pid, launcher_pid)
    close_inherited_pipe()
    fresh_random_state()  # not the fork server's generators: each rank draws its own numbers
    # the platform's default, as a torchrun rank has (a DataLoader's fork needs no pickled Dataset)
    multiprocessing.set_start_method(None, force=True)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    capture_output(run_dir, rank)
    procs.listen_on_loopback()
    stacks.register(run_dir, rank)  # before the pid marker: the launcher signals only registered ranks
    write_marker(run_dir, "pid", rank, {"pid": os.getpid()})
    try:
        if threads and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(threads)
        fn, args, kwargs = cloudpickle.loads(payload)
        if style == "spawn":
            # torch.multiprocessing.spawn gives none of the agent's variables: env:// would join its store
            for name in AGENT_ENV:
                os.environ.pop(name, None)
            for name in [n for n in os.environ if n.startswith("TORCHELASTIC_")]:
                os.environ.pop(name, None)
            _write_started(run_dir, rank)
            result = fn(rank, *args, **kwargs)
        else:
            procs.init_process_group_from_env(backend, timeout_s)
            _write_started(run_dir, rank)
            result = fn(rank, world_size, *args, **kwargs)
        try:
            data = cloudpickle.dumps(result)
        except Exception as e:  # noqa: BLE001
            raise TypeError(
                f"rank {rank} returned a {type(result).__name__} that cannot be pickled back to the "
                f"caller ({type(e).__name__}: {e}); return plain data or CPU tensors."
            ) from None
        # not under helpers.mp: its ranks have no RANK or WORLD_SIZE, which accelerate also reads
        note = alone_note(world_size) if style != "spawn" and rank == 0 else None
        if note:
            print(note, file=sys.stderr)
        write_marker(run_dir, "done", rank, {"time": time.time()})
        if dist.is_initialized():
            if style != "spawn":
                # no rank tears the group down while another is in a collective (markers, not a barrier)
                _wait_for_peers(run_dir, world_size)
            dist.destroy_process_group()
    except BaseException as e:
        write_marker(run_dir, "error", rank, {
            "rank": rank,
            "type": type(e).__name__,
            "message": with_hint(str(e)) if not isinstance(e, SystemExit) else f"sys.exit({e.code!r})",
            "traceback": traceback.format_exc(),
            "time": time.time(),
        })
        sys.stdout.flush()
        sys.stderr.flush()
        if isinstance(e, Exception):
            # reported in the marker; raising on would leave a pytorch-errorfile-*.pickle (spawn.py, _wrap)
            raise SystemExit(1) from None
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    return data

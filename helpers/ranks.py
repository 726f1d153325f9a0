"""Warm ranks: a process group that lives across notebook cells, on ipyparallel engines.

:func:`launch` starts new processes for every call, and nothing of them survives it. Warm ranks
start ``world_size`` persistent IPython engines once (``ipyparallel``) with a process group, and
keep them: names defined in one cell are still there in the next (poke at weights, gradients,
buckets step by step), and a call costs milliseconds::

    from helpers.ranks import start_ranks
    ranks = start_ranks(world_size=2)          # also activates %%px in this notebook

    %%px
    t = torch.tensor([float(rank)]); dist.all_reduce(t); print(t)

    ranks.run(lambda rank, world_size: rank * 10)   # -> [0, 10]
    ranks.stop()

Predefined on every rank: ``rank`` (= engine id), ``world_size``, ``device`` (``cuda:<rank>``
under nccl, else ``cpu``), ``torch``, ``dist`` (``torch.distributed``).

What this module adds to ipyparallel (engines, ``%%px``, output labelled ``[stdout:<rank>]``
and cloudpickle for cell-defined code are ipyparallel's own):

- the input checks, backend rule and threads per rank of :func:`helpers.launch.launch`;
- a process group on ``127.0.0.1`` through a ``TCPStore`` rank 0 opens on port 0 (the OS picks a
  free port), with ``timeout=`` (the ranks' ``timeout`` + 5 s) so gloo itself raises;
- a time limit on every ``run`` and ``%%px`` cell. ipyparallel's ``%%px`` waits forever and
  cannot restart engines, so a thin ``%%px``/``%px`` replaces it: it runs the cell with
  ipyparallel's ``DirectView.execute`` and shows output with ipyparallel's streaming/display,
  but watches the ranks while it waits. A hung collective, a rank that raised while its peers
  wait, a dead rank (SIGKILL, ``os._exit``) and "interrupt kernel" (SIGINT is sent to the
  ranks; if they do not stop within seconds, e.g. in a C++ collective) end the wait, **end all
  ranks at once** (never a half-dead group) and raise ``WorkerError``, :class:`RanksTimeout` or
  ``KeyboardInterrupt`` naming the ranks, within seconds; fresh ranks start by themselves
  before the next ``run`` or ``%%px`` cell. ``%%px`` with ipyparallel options (``--targets``,
  ``--noblock`` ...) goes to ipyparallel's magic, without these guarantees;
- nothing left behind: :meth:`WarmRanks.stop` (idempotent) kills the controller and engine trees,
  at interpreter exit (kernel shutdown/restart) and when :func:`start_ranks` gets another
  ``world_size``, backend, timeout or environment; a watchdog process (:mod:`helpers.ranks_engine`)
  kills them if the kernel dies without ``atexit`` (SIGKILL).

References: https://ipyparallel.readthedocs.io/en/latest/tutorial/magics.html , ipyparallel's
``client/magics.py`` (``parallel_execute``) and torch's ``distributed/distributed_c10d.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ipyparallel as ipp
import psutil

from helpers import ranks_engine as eng
from helpers.fork_server import environment
from helpers.launch import LaunchError, WorkerError, _check_world_size, resolve_backend, threads_per_rank
from helpers.procs import end_processes
from helpers.sending import serialise_call  # refuses what cannot be sent, naming the variable

RanksTimeout = eng.RanksTimeout  # raised by run and %%px past their timeout

__all__ = ["RanksTimeout", "WarmRanks", "current_ranks", "start_ranks"]

_POLL_S = 0.05  # how often a wait checks the ranks (seconds)
_ERROR_GRACE_S = 2.0  # after one rank raised, how long its peers get to finish (seconds)
_INTERRUPT_GRACE_S = 3.0  # after SIGINT, how long the ranks get to stop (seconds)
_GROUP_MARGIN_S = 5.0  # the group's collective timeout is the ranks' timeout plus this (seconds)
_START_TIMEOUT_S = 180.0  # engines + torch import + process group (seconds; 2 busy cores)
_OUTPUT_WAIT_S = 30.0  # the most a finished %%px cell waits for its ranks' output (seconds; returns when all is in)




# ----------------------------------------------------------------------------------------------
# in the kernel
# ----------------------------------------------------------------------------------------------

_CURRENT: WarmRanks | None = None
_ATEXIT_REGISTERED = False


def current_ranks() -> WarmRanks | None:
    """The running :class:`WarmRanks` started by :func:`start_ranks`, or ``None``."""
    return _CURRENT if _CURRENT is not None and not _CURRENT.stopped else None


def _atexit_stop() -> None:
    if _CURRENT is not None:
        _CURRENT.stop()


def _check_timeout(timeout: Any, name: str = "timeout") -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise LaunchError(f"{name} must be a positive number of seconds, got {timeout!r}.")
    return float(timeout)


def start_ranks(world_size: int = 2, backend: str | None = None, timeout: float = 60.0, *,
                env: dict[str, str] | None = None, activate: bool = True) -> WarmRanks:
    """Start ``world_size`` warm ranks with a default process group, or return the running ones.

    Calling it again with the same arguments (and the same ``os.environ``) returns the running
    ranks unchanged (re-running the cell is cheap); any change (``world_size``, ``backend``,
    ``timeout``, ``env`` or the kernel's environment) stops the old ranks first.

    Args:
        world_size: number of ranks (engines), a positive int; same limits as ``launch``.
        backend: ``"gloo"`` (CPU), ``"nccl"`` (one GPU per rank) or ``None`` (nccl when CUDA has at
            least ``world_size`` GPUs, else gloo): :func:`helpers.launch.resolve_backend`.
        timeout: seconds a :meth:`WarmRanks.run` call or a ``%%px`` cell may take (per-call
            ``timeout=`` overrides it). The process group's collective timeout is this plus 5 s,
            so gloo itself raises in a rank stuck in a collective if a call was given longer.
        env: extra environment variables for the ranks (set before torch is imported there).
        activate: register the ``%%px``/``%px`` magics in the calling IPython session.

    Returns:
        WarmRanks: rank ``r`` is engine ``r``; ``torch.set_num_threads(threads_per_rank(world_size))``
        on each unless ``OMP_NUM_THREADS`` is set; ``device`` is ``cuda:<rank>`` under nccl.

    Raises:
        LaunchError: bad ``world_size``, ``backend`` or ``timeout`` (before anything starts).
        RuntimeError: the engines or the process group did not come up within 180 s; nothing is
            left running.
    """
    global _CURRENT, _ATEXIT_REGISTERED
    world_size = _check_world_size(world_size)  # private in launch.py: launch()'s own checks and messages
    backend = resolve_backend(backend, world_size)
    timeout = _check_timeout(timeout)
    env = {str(k): str(v) for k, v in (env or {}).items()}
    key = (world_size, backend, timeout, tuple(sorted(env.items())), environment())
    if _CURRENT is not None and not _CURRENT.stopped:
        if _CURRENT._key == key and not _CURRENT.dead_ranks():
            if _CURRENT._restart_pending:
                _CURRENT.restart()
            if activate:
                _CURRENT._activate()
            return _CURRENT
        _CURRENT.stop()
    if not _ATEXIT_REGISTERED:
        atexit.register(_atexit_stop)
        _ATEXIT_REGISTERED = True
    ranks = WarmRanks(world_size, backend, timeout, env, activate, key)
    _CURRENT = ranks
    ranks._start()
    return ranks


class WarmRanks:
    """``world_size`` persistent ranks (ipyparallel engines) sharing a default process group.

    Create with :func:`start_ranks`. Attributes: ``world_size``, ``backend``, ``timeout``
    (seconds), ``devices`` (``["cpu", ...]`` or ``["cuda:0", ...]``), ``pids`` (engine process
    ids in rank order), ``client`` and ``view`` (ipyparallel ``Client`` and ``DirectView`` over
    all ranks, in rank order), ``stopped``, ``restarts`` (how many times fresh ranks were started
    after a fault), ``startup_seconds`` (the last start: engines, torch import, group) and
    ``startup_phases`` (``{"engines": s, "torch and group": s}``: controller and engines up, then
    each engine importing torch and joining the group).
    """

    def __init__(self, world_size: int, backend: str, timeout: float, env: dict, activate: bool, key):
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.env = env
        self._activate_magics = activate
        self._key = key
        self.cluster = self.client = self.view = None
        self.pids: list[int] = []
        self.devices: list[str] = []
        self.stopped = False
        self.restarts = 0
        self.startup_seconds = None
        self.startup_phases: dict[str, float] = {}
        self._profile_dir = None
        self._watchdog = None
        self._ipp_px = None
        self._restart_pending = False
        self._started: list = []  # the process trees as they were once started
        self._ipp_log: logging.Logger | None = None

    def __repr__(self):
        state = ("stopped" if self.stopped else "restarting on the next call" if self._restart_pending
                 else f"pids {self.pids}")
        return f"<WarmRanks world_size={self.world_size} backend={self.backend!r} timeout={self.timeout:g} s, {state}>"

    # -- life cycle --------------------------------------------------------------------------

    def _start(self) -> None:
        t0 = time.perf_counter()
        # ipyparallel's reports to stderr, by a logger of this start alone that _shutdown silences
        self._ipp_log = logging.Logger("helpers.ranks ipyparallel", logging.WARNING)
        self._ipp_log.addHandler(logging.StreamHandler(sys.stderr))
        self._profile_dir = tempfile.mkdtemp(prefix="ddp-lab-ranks-")
        try:
            self.cluster = ipp.Cluster(
                controller_args=eng.CONTROLLER_ARGS,
                n=self.world_size, profile_dir=self._profile_dir, cluster_id="ddp-lab",
                controller_ip="127.0.0.1", delay=0.0, engine_timeout=int(_START_TIMEOUT_S),
                log=self._ipp_log, shutdown_atexit=False, load_profile=False, config=eng.engine_config(self.env))
            self.cluster.start_cluster_sync(n=self.world_size)
            self.client = self.cluster.connect_client_sync()
            # interactive=False: no progress bar in the cell
            self.client.wait_for_engines(self.world_size, timeout=_START_TIMEOUT_S, interactive=False)
            ids = sorted(self.client.ids)
            assert ids == list(range(self.world_size)), f"engine ids {ids}"
            self.view = self.client[ids]
            self.view.use_cloudpickle()  # cell-defined functions, closures, classes by value
            self.pids = self.view.apply_async(os.getpid).get(_START_TIMEOUT_S)
            t_engines = time.perf_counter()
            self._started = self._processes()
            self._start_watchdog()
            group_timeout = self.timeout + _GROUP_MARGIN_S
            port = self.client[0].apply_async(eng.open_store, self.world_size, group_timeout).get(_START_TIMEOUT_S)
            joins = [self.client[r].apply_async(eng.join_group, r, self.world_size, self.backend, port, group_timeout,
                                                threads_per_rank(self.world_size))
                     for r in ids]
            self.devices = [j.get(_START_TIMEOUT_S) for j in joins]
            for r in ids:
                self.client[r].push({"rank": r, "world_size": self.world_size}, block=True)
            self.view.execute(eng.PRELUDE, block=False).get(_START_TIMEOUT_S)
        except BaseException as e:
            self._shutdown()
            self.stopped = True
            if isinstance(e, KeyboardInterrupt):
                raise
            raise RuntimeError(f"warm ranks did not start ({type(e).__name__}: {eng.ANSI.sub('', str(e))}); "
                               "nothing was left running") from e
        self.startup_seconds = time.perf_counter() - t0
        self.startup_phases = {"engines": t_engines - t0, "torch and group": time.perf_counter() - t_engines}
        if self._activate_magics:
            self._activate()

    def _start_watchdog(self) -> None:
        roots = [*self.pids, *(p.pid for p in self._launched())]
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", eng.WATCHDOG, str(os.getpid()), self._profile_dir, *map(str, sorted(set(roots)))],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # not in the kernel's process group: it must outlive a killpg

    def _launched(self) -> list:
        """The controller's and every engine's process as ipyparallel's launchers started them
        (psutil.Process; none once stopped)."""
        if self.cluster is None:
            return []
        launchers = [self.cluster.controller] if self.cluster.controller is not None else []
        for es in self.cluster.engines.values():
            launchers += list(es.launchers.values())
        return [el.process for el in launchers if getattr(el, "process", None) is not None]

    def _processes(self) -> list:
        """The controller and engine process trees (psutil.Process), found from the launchers."""
        roots = self._launched()
        roots += [psutil.Process(p) for p in self.pids if psutil.pid_exists(p)]
        procs = {p.pid: p for p in self._started if p.is_running()}  # also any re-parented since

        for p in roots:
            with contextlib.suppress(psutil.Error):
                procs[p.pid] = p
                for c in p.children(recursive=True):
                    procs[c.pid] = c
        return list(procs.values())

    def _shutdown(self) -> None:
        procs = self._processes()
        # ended on purpose: ipyparallel would log each exit and the controller's whole log as warnings
        if self._ipp_log is not None:
            self._ipp_log.disabled = True
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close(linger=0)
        end_processes(procs, terminate=False, timeout=5.0)  # SIGKILL: engines hold nothing worth a grace
        if self.cluster is not None:
            self.cluster.controller = None  # already dead: ipyparallel has nothing left to stop
            self.cluster.engines = {}
        if self._watchdog is not None:
            with contextlib.suppress(Exception):
                self._watchdog.kill()
                self._watchdog.wait(5)
        if self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
        self.cluster = self.client = self.view = self._watchdog = self._profile_dir = None
        self.pids, self._started = [], []

    def stop(self) -> None:
        """Stop the ranks: kill the engines, the controller and the watchdog. Safe to call twice."""
        if self.stopped:
            return
        self.stopped = True
        self._shutdown()

    def restart(self) -> None:
        """Stop the ranks and start a fresh set with the same settings (names defined on them are lost).

        After a fault the ranks are ended at once and this runs by itself before the next
        ``run`` or ``%%px`` cell."""
        self._shutdown()
        self.stopped = False
        self._restart_pending = False
        self.restarts += 1
        self._start()

    def _activate(self) -> None:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is None or self.view is None:
            return
        self.view.activate()  # ipyparallel's %px, %%px, %autopx, %pxresult, %pxconfig
        self._ipp_px = ip.magics_manager.magics["cell"].get("px")
        ip.register_magic_function(_px_magic, magic_kind="line_cell", magic_name="px")

    # -- health ------------------------------------------------------------------------------

    def dead_ranks(self) -> dict[int, str]:
        """``{rank: description}`` of ranks whose engine process is gone (killed, exited)."""
        dead = {}
        for rank, pid in enumerate(self.pids):
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                pass
            dead[rank] = eng.exit_description(self.cluster, pid)
        return dead

    def _check_alive(self, what: str) -> None:
        if self.stopped:
            raise RuntimeError("these warm ranks were stopped; call start_ranks(...) again")
        if self._restart_pending:
            print(f"(starting fresh warm ranks after the last fault: about "
                  f"{self.startup_seconds or 0:.0f} s)", file=sys.stderr, flush=True)
            self.restart()
            return
        dead = self.dead_ranks()
        if dead:
            raise self._restart_with(self._dead_error(dead, what, before=True))

    def _dead_error(self, dead: dict[int, str], what: str, before: bool = False) -> WorkerError:
        rank = min(dead)
        others = {r: "ended" for r in range(self.world_size) if r != rank}
        others.update({r: d for r, d in dead.items() if r != rank})
        return WorkerError(rank, dead[rank],
                           f"the engine process of rank {rank} (pid {self.pids[rank]}) "
                           + (f"was found dead when {what} started" if before else f"died before {what} finished")
                           + " (a signal such as SIGKILL, e.g. from the out-of-memory killer, or os._exit()). "
                           + eng.RESTART_NOTE, "", others)

    def _restart_with(self, error: BaseException) -> BaseException:
        """End the ranks now (no half-dead group survives) and start fresh ones on the next call
        (``run``, ``%%px``), so the fault is reported at once; return ``error`` to raise."""
        self._shutdown()
        self._restart_pending = True
        return error

    # -- waiting for the ranks -----------------------------------------------------------------

    def _supervise(self, ar, timeout: float | None, what: str) -> tuple[list[int], BaseException | None]:
        """Wait for ``ar`` (one message per rank) while watching the ranks.

        Returns ``(ranks_with_errors, fault)``; ``fault`` (to raise after a restart) is set when a
        rank died, the time ran out, peers still ran after a rank raised, or the caller was
        interrupted.
        """
        parts = ar.split() if self.world_size > 1 else [ar]
        limit = self.timeout if timeout is None else _check_timeout(timeout)
        start = time.monotonic()
        first_error = None
        try:
            while True:
                ar.wait(_POLL_S)
                done = [p.ready() for p in parts]
                errors = [r for r, p in enumerate(parts) if done[r] and not p.successful()]
                if all(done):  # an engine that died mid-task ends as an EngineError: report the death
                    dead = self.dead_ranks() if errors else {}
                    return errors, (self._dead_error(dead, what) if dead else None)
                dead = self.dead_ranks()
                if dead:
                    return errors, self._dead_error(dead, what)
                if errors:
                    first_error = first_error or time.monotonic()
                    if time.monotonic() - first_error > _ERROR_GRACE_S:
                        err = eng.worker_error(parts, errors[0])
                        err.other_ranks.update({r: "had not finished (waiting for the failed rank); ended"
                                                for r, d in enumerate(done) if not d})
                        return errors, err.with_note(eng.RESTART_NOTE)
                if time.monotonic() - start > limit:
                    return errors, eng.RanksTimeout(limit, [r for r, d in enumerate(done) if not d], what)
        except KeyboardInterrupt:
            running = [r for r, p in enumerate(parts) if not p.ready()]
            eng.interrupt([self.pids[r] for r in running])
            stopped = ar.wait(_INTERRUPT_GRACE_S)
            if stopped:
                return [], KeyboardInterrupt(f"{what} interrupted: SIGINT sent to ranks {running}, which stopped")
            still = [r for r, p in enumerate(parts) if not p.ready()]
            return [], KeyboardInterrupt(f"{what} interrupted: ranks {still} did not stop on SIGINT (e.g. waiting "
                                         "in a collective). " + eng.RESTART_NOTE)

    def _raise_for(self, ar, errors: list[int], fault: BaseException | None) -> None:
        """After :meth:`_supervise`: on a fault restart and raise it; on rank errors raise WorkerError."""
        if fault is not None:
            if isinstance(fault, KeyboardInterrupt) and "which stopped" in str(fault):
                raise fault
            raise self._restart_with(fault)
        if errors:
            parts = ar.split() if self.world_size > 1 else [ar]
            err = eng.worker_error(parts, errors[0])
            err.other_ranks.update({r: eng.worker_error(parts, r).message.partition("\n")[0][:200]  # no hint twice
                                    for r in errors[1:]})
            if any(s in f"{err.exc_type} {err.message}" for s in eng.GROUP_BROKEN):
                # a collective failed: the group's state is unknown, start afresh
                raise self._restart_with(err.with_note("a collective failed: " + eng.RESTART_NOTE))
            raise err.with_note(None)

    # -- public calls --------------------------------------------------------------------------

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` may be defined in a notebook cell (a function, lambda or closure: sent by value with
        cloudpickle). Arguments and results travel pickled.

        Args:
            timeout: seconds for this call (default: the ranks' ``timeout``).

        Returns:
            list: ``results[r]`` is rank ``r``'s return value.

        Raises:
            LaunchError: ``fn``, an argument, a global it uses or a closure variable cannot be sent
                (an open file, a lock, a socket, a generator, a CUDA tensor), as for ``launch``.
            WorkerError: a rank raised (names the rank, its traceback) or its process died. When a
                rank died, peers were left waiting or a collective failed, all ranks were ended
                first; fresh ones start before the next call.
            RanksTimeout: past ``timeout``; names the ranks not finished; all ranks were ended.
            KeyboardInterrupt: interrupted; SIGINT was sent to the ranks (all ended if they did not stop).
        """
        if not callable(fn):
            raise LaunchError(f"fn must be a function, got {fn!r} of type {type(fn).__name__}.")
        # LaunchError naming the variable, before the ranks are touched; the payload keeps a cell's
        # file name and lines, so a rank's traceback shows the cell's line
        payload = serialise_call(fn, args, kwargs)
        self._check_alive("run")
        ar = self.view.apply_async(eng.call_payload, payload)
        self._raise_for(ar, *self._supervise(ar, timeout, "run"))
        return ar.get(0)

    def execute(self, code: str, timeout: float | None = None, stream: bool | None = None) -> None:
        """Run ``code`` on every rank, as ``%%px`` does, showing each rank's output labelled by rank.

        Same errors as :meth:`run` (``what`` = ``"%%px cell"``).
        """
        self._check_alive("the %%px cell")
        if stream is None:
            stream = not ipp._NONINTERACTIVE
        ar = self.view.execute(code, silent=False, block=False)
        ar._fname = "%px"
        eng.stream_per_rank(ar)
        with ar.stream_output() if stream else contextlib.nullcontext():
            finished = False
            try:
                errors, fault = self._supervise(ar, timeout, "%%px cell")
                finished = fault is None
            finally:
                # every rank's output of a finished cell follows its result on ipyparallel's iopub
                # channel, seconds later on a loaded machine (rank 1's line was lost at 1 s); a rank
                # that faulted never sends it, so then wait only briefly
                ar.wait_for_output(_OUTPUT_WAIT_S if finished else 1)
        if not stream:
            ar.display_outputs()
        self._raise_for(ar, errors, fault)


def _px_magic(line: str, cell: str | None = None):
    """``%%px [--timeout S]``: run the cell on every warm rank (see :meth:`WarmRanks.execute`).

    Other ipyparallel options (``--targets``, ``--noblock``, ``--local`` ...) are passed to
    ipyparallel's own magic, which has no time limit and no restart.
    """
    ranks = current_ranks()
    if ranks is None:
        raise RuntimeError("no warm ranks are running: run `ranks = start_ranks(world_size=2)` first")
    code, opts = (line, "") if cell is None else (cell, line.strip())
    timeout = None
    m = re.fullmatch(r"--timeout[ =](\S+)", opts)
    if m:
        timeout, opts = float(m.group(1)), ""
    if opts:
        if ranks._ipp_px is None:
            raise RuntimeError(f"unsupported %%px options {opts!r}")
        return ranks._ipp_px(line, cell)
    ranks.execute(code, timeout=timeout)

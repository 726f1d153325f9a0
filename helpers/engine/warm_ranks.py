"""Warm ranks: a process group that lives across notebook cells, on ipyparallel engines.

:func:`launch` starts new processes for every call, and nothing of them survives it. Warm ranks
start ``world_size`` persistent ipyparallel engines once (one process per rank) with a process group, and
keep them: names defined in one cell are still there in the next (poke at weights, gradients,
buckets step by step), and a call costs milliseconds::

    from helpers.engine.warm_ranks import start_ranks
    ranks = start_ranks(world_size=2)          # also activates %%px in this notebook

    %%px
    t = torch.tensor([float(rank)]); dist.all_reduce(t); print(t)

    ranks.run(lambda rank, world_size: rank * 10)   # -> [0, 10]
    ranks.push({"lr": 0.1})                          # a kernel value, as a name on every rank
    ranks.pull("t")                                  # every rank's t, in rank order
    ranks.stop()

Predefined on every rank: ``rank`` (its ipyparallel engine id), ``world_size``, ``device``, ``torch``,
``dist``. What this module adds to ipyparallel (engines, ``%%px``, ``[stdout:<rank>]`` output, cloudpickle):

- ``launch``'s input checks, backend rule and threads per rank; a group on ``127.0.0.1`` through a
  ``TCPStore`` rank 0 opens on port 0, with ``timeout=`` the ranks' ``timeout`` + 5 s;
- a time limit on every call: a thin ``%%px`` runs the cell with ``DirectView.execute`` and
  ipyparallel's streaming, but watches the ranks while it waits. A hung collective, a rank that
  raised while its peers wait, a dead rank and "interrupt kernel" (SIGINT to the ranks) end all
  ranks at once and raise ``WorkerError``, :class:`RanksTimeout` or ``KeyboardInterrupt`` within
  seconds; fresh ranks start before the next call. ``%%px`` with other options goes to ipyparallel;
- one default group for good: a rank left without one (a tutorial's ``cleanup()``) gets a new one,
  with a note; a ``%%px`` NameError for a kernel name points to :meth:`WarmRanks.push`;
- the controller's port race handled: ipyparallel chooses ports, then binds them; a try that lost one
  is ended at once and retried with new ports (4 tries; it hung 180 s before);
- nothing left behind: :meth:`WarmRanks.stop`, at exit, on a changed :func:`start_ranks`, and a
  watchdog process (:mod:`helpers.engine.warm_ranks_remote`) if the kernel is SIGKILLed.

References: https://ipyparallel.readthedocs.io/en/latest/tutorial/magics.html , ipyparallel's
``client/magics.py`` (``parallel_execute``).
"""

from __future__ import annotations

import atexit
import contextlib
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import ipyparallel as ipp

from helpers.engine import stacks
from helpers.engine import warm_ranks_remote as remote
from helpers.engine.by_value import serialise_call  # refuses what cannot be sent, naming the variable
from helpers.engine.errors import LaunchInterrupted, NoRanks, RanksStopped
from helpers.engine.fork_server import environment
from helpers.engine.inputs import check_timeout, check_world_size
from helpers.engine.launcher import LaunchError, WorkerError, resolve_backend
from helpers.engine.warm_ranks_start_stop import RankProcesses

RanksTimeout = remote.RanksTimeout  # raised by run and %%px past their timeout

__all__ = ["RanksTimeout", "WarmRanks", "current_ranks", "start_ranks"]

_POLL_S = 0.05  # how often a wait checks the ranks (seconds)
_ERROR_GRACE_S = 2.0  # after one rank raised, how long its peers get to finish (seconds)
_INTERRUPT_GRACE_S = 3.0  # after SIGINT, how long the ranks get to stop (seconds)
_OUTPUT_WAIT_S = 30.0  # the most a finished %%px cell waits for its ranks' output (seconds; returns when all is in)
_PX_CELLS_KEPT = 200  # %%px cells remembered for where-stuck reports (their code, by file name)


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


def start_ranks(world_size: int = 2, backend: str | None = None, timeout: float = 60.0, *,
                env: dict[str, str] | None = None, activate: bool = True) -> WarmRanks:
    """Start ``world_size`` warm ranks with a default process group, or return the running ones if
    nothing changed (arguments, ``os.environ``); else the old ranks are stopped first.

    Args:
        world_size, backend: as for ``launch`` (:func:`helpers.engine.resolve_backend`).
        timeout: seconds a :meth:`WarmRanks.run` call or a ``%%px`` cell may take (a call's
            ``timeout=`` overrides it); the group's collective timeout is this plus 5 s.
        env: extra environment variables for the ranks (set before torch is imported there).
        activate: register the ``%%px``/``%px`` magics in the calling IPython session.

    Raises:
        LaunchError: bad ``world_size``, ``backend`` or ``timeout`` (before anything starts).
        RuntimeError: the controller, the ranks or the group did not come up (a process exited, or
            180 s passed; a port taken is retried up to 4 times); everything was ended, and the
            message says whether that was checked.
    """
    global _CURRENT, _ATEXIT_REGISTERED
    world_size = check_world_size(world_size)  # launch()'s own checks and messages
    backend = resolve_backend(backend, world_size)
    timeout = check_timeout(timeout, none=False)
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

    Create with :func:`start_ranks`. Attributes: ``world_size``, ``backend``, ``timeout`` (seconds),
    ``stopped``, ``restarts`` (fresh ranks started after a fault), ``regroups`` (default groups made
    again after user code destroyed one), and ``procs`` (:class:`RankProcesses`); of these, ``devices``
    (``["cpu", ...]`` or ``["cuda:0", ...]``), ``pids`` (in rank order), ``client`` and ``view``
    (ipyparallel ``Client`` and ``DirectView`` over all ranks, in rank order), ``start_attempts``.
    """

    pids = property(lambda self: self.procs.pids)
    devices = property(lambda self: self.procs.devices)
    client = property(lambda self: self.procs.client)
    view = property(lambda self: self.procs.view)
    start_attempts = property(lambda self: self.procs.start_attempts)

    def __init__(self, world_size: int, backend: str, timeout: float, env: dict, activate: bool, key):
        self.world_size, self.backend, self.timeout = world_size, backend, timeout
        self.procs = RankProcesses(world_size, backend, timeout, env)
        self._activate_magics, self._key = activate, key
        self.stopped = self._restart_pending = False
        self.restarts = self.regroups = 0
        self._ipp_px = None
        self.px_cells: dict[str, tuple[str, str, int]] = {}  # %%px cells' code by file name (_note_cell)

    def __repr__(self):
        state = ("stopped" if self.stopped else "restarting on the next call" if self._restart_pending
                 else f"pids {self.pids}")
        return f"<WarmRanks world_size={self.world_size} backend={self.backend!r} timeout={self.timeout:g} s, {state}>"

    def _start(self) -> None:
        try:
            self.procs.start()
        except BaseException:
            self.stopped = True
            raise
        if self._activate_magics:
            self._activate()

    def stop(self) -> None:
        """Stop the ranks: kill their processes, the controller and the watchdog. Safe to call twice."""
        if not self.stopped:
            self.stopped = True
            self.procs.shutdown()

    def restart(self) -> None:
        """Stop the ranks and start fresh ones, same settings (names on them are lost); after a fault it
        runs by itself before the next call."""
        self.procs.shutdown()
        self.stopped = self._restart_pending = False
        self.restarts += 1
        self._start()

    def dead_ranks(self) -> dict[int, str]:
        """``{rank: description}`` of ranks whose process is gone (killed, exited)."""
        return self.procs.dead_ranks()

    def _activate(self) -> None:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is None or self.view is None:
            return
        self.view.activate()  # ipyparallel's %px, %%px, %autopx, %pxresult, %pxconfig
        self._ipp_px = ip.magics_manager.magics["cell"].get("px")
        ip.register_magic_function(_px_magic, magic_kind="line_cell", magic_name="px")

    # -- health ------------------------------------------------------------------------------

    def _check_alive(self, what: str) -> None:
        if self.stopped:
            raise RanksStopped("these warm ranks were stopped (ranks.stop()), so nothing ran: run the cell with "
                               "`ranks = start_ranks(...)` again, then this one")
        if self._restart_pending:
            # a notice, not an error: stdout (stderr shows as a red box in a notebook)
            print(f"(starting fresh warm ranks after the last fault: about "
                  f"{self.procs.startup_seconds or 0:.0f} s)", flush=True)
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
                           f"the process of rank {rank} (pid {self.pids[rank]}) "
                           + (f"was found dead when {what} started" if before else f"died before {what} finished")
                           + " (a signal such as SIGKILL, or os._exit()). "
                           + remote.RESTART_NOTE, "", others)

    def _restart_with(self, error: BaseException) -> BaseException:
        """End the ranks now (no half-dead group) and start fresh ones on the next call; ``error``, to raise."""
        self.procs.shutdown()
        self._restart_pending = True
        return error

    def _note_cell(self, code: str) -> None:
        """Remember a ``%%px`` cell's code under its frames' file name (:func:`~helpers.engine.stacks.px_cell_name`),
        labelled ``Cell In[n]`` when it is the running notebook cell's body, else ``%%px code``."""
        from IPython import get_ipython

        try:
            shell = get_ipython()
            # stored before it runs, at its count (IPython 9 adds 1 to execution_count before, 8 after)
            hist = shell.history_manager.input_hist_raw if shell is not None else [""]
            magic, _, body = hist[-1].partition("\n")
            if magic.startswith("%%px") and body.rstrip() == code.rstrip():
                cell = (f"Cell In[{len(hist) - 1}]", code, 1)
            else:
                cell = ("%%px code", code, 0)
            name = stacks.px_cell_name(code)
        except Exception:  # noqa: BLE001 - only a report's labels: never in the way of the cell
            return
        self.px_cells.pop(name, None)
        self.px_cells[name] = cell
        while len(self.px_cells) > _PX_CELLS_KEPT:
            del self.px_cells[next(iter(self.px_cells))]

    def _stuck(self, ranks: list[int]) -> tuple[dict[int, str], dict[str, tuple[str, str, int]]]:
        """``(stacks, cells)`` for a timed-out or interrupted call, before the ranks are ended."""
        return self.procs.stacks_of(ranks), dict(self.px_cells)

    # -- waiting for the ranks -----------------------------------------------------------------

    def _supervise(self, ar, timeout: float | None, what: str, poll=None) -> tuple[list[int], BaseException | None]:
        """Wait for ``ar`` (one message per rank) watching the ranks, ``poll()`` after each wait.
        ``(ranks_with_errors, fault)``; ``fault`` (raised after a restart): a rank died, the time ran
        out, peers still ran after a rank raised, or an interrupt."""
        parts = ar.split() if self.world_size > 1 else [ar]
        limit = self.timeout if timeout is None else check_timeout(timeout)
        start = time.monotonic()
        first_error = None
        try:
            while True:
                ar.wait(_POLL_S)
                if poll is not None:
                    poll()
                done = [p.ready() for p in parts]
                errors = [r for r, p in enumerate(parts) if done[r] and not p.successful()]
                if all(done):  # a rank that died mid-task ends as ipyparallel's EngineError: report the death
                    dead = self.dead_ranks() if errors else {}
                    return errors, (self._dead_error(dead, what) if dead else None)
                dead = self.dead_ranks()
                if dead:
                    return errors, self._dead_error(dead, what)
                if errors:
                    first_error = first_error or time.monotonic()
                    if time.monotonic() - first_error > _ERROR_GRACE_S:
                        err = remote.worker_error(parts, errors[0])
                        err.other_ranks.update({r: "had not finished (waiting for the failed rank); ended"
                                                for r, d in enumerate(done) if not d})
                        return errors, err.with_note(remote.RESTART_NOTE)
                if time.monotonic() - start > limit:  # where each unfinished rank is stuck, before they end
                    late = [r for r, d in enumerate(done) if not d]
                    return errors, remote.RanksTimeout(limit, late, what, *self._stuck(late))
        except KeyboardInterrupt:
            running = [r for r, p in enumerate(parts) if not p.ready()]
            remote.interrupt([self.pids[r] for r in running])
            stopped = ar.wait(_INTERRUPT_GRACE_S)
            if stopped:
                return [], LaunchInterrupted(f"{what} interrupted: SIGINT sent to ranks {running}, which stopped")
            still = [r for r, p in enumerate(parts) if not p.ready()]
            return [], LaunchInterrupted(f"{what} interrupted: ranks {still} did not stop on SIGINT (e.g. waiting "
                                         "in a collective). " + remote.RESTART_NOTE, *self._stuck(still))

    def _supervise_with_output(self, ar, timeout: float | None, what: str, poll=None):
        """:meth:`_supervise`, then wait for the ranks' output (seconds after a result on a loaded machine;
        briefly after a fault)."""
        finished = False
        try:
            errors, fault = self._supervise(ar, timeout, what, poll)
            finished = fault is None
        finally:
            ar.wait_for_output(_OUTPUT_WAIT_S if finished else 1)
        return errors, fault

    def _raise_for(self, ar, errors: list[int], fault: BaseException | None, what: str,
                   has_group: list[bool] | None = None, kernel_names=None) -> None:
        """After :meth:`_supervise`: on a fault restart and raise it; else regroup if need be
        (:meth:`_check_group`) and raise a rank's error (a NameError for a name of ``kernel_names`` says so)."""
        if fault is not None:
            if isinstance(fault, KeyboardInterrupt) and "which stopped" in str(fault):
                raise fault
            raise self._restart_with(fault)
        err = None
        if errors:
            parts = ar.split() if self.world_size > 1 else [ar]
            err = remote.worker_error(parts, errors[0])
            for r in errors[1:]:
                other = remote.worker_error(parts, r)
                same = (other.exc_type, other.message.replace(f"rank {r} ", f"rank {err.rank} ")) == \
                    (err.exc_type, err.message)
                first_line = other.message.partition("\n")[0][:200]  # a hint once, in err itself
                err.other_ranks[r] = f"the same {other.exc_type}" if same else first_line
            if any(s in f"{err.exc_type} {err.message}" for s in remote.GROUP_BROKEN):
                # a collective failed: the group's state is unknown, start afresh
                raise self._restart_with(err.with_note("a collective failed: " + remote.RESTART_NOTE))
        self._check_group(what, has_group)
        if err is None:
            return
        err = remote.kernel_name_error(err, kernel_names or {}) or err
        raise err.with_note(remote.INIT_TWICE_NOTE if "initialize the default process group twice" in err.message
                            else None)

    def _check_group(self, what: str, has_group: list[bool] | None = None) -> None:
        """A rank left without a default group (``has_group``: each rank's ``dist.is_initialized()``, asked if
        ``None``) gets a new one on the same ranks, said on stderr (failing that: fresh ranks next call)."""
        deadline = time.monotonic() + self.procs.group_timeout
        if has_group is None:
            try:
                has_group = self.procs.wait_for(self.view.apply_async(remote.has_group), "the ranks' group check",
                                                deadline)
            except Exception:  # noqa: BLE001 - a rank died or hung just after the call: start afresh
                self._restart_with(None)
                return
        lost = [r for r, ok in enumerate(has_group) if not ok]
        if not lost:
            return
        try:
            self.procs.wait_for(self.view.apply_async(remote.leave_group), "the ranks leaving the old group", deadline)
            self.procs.join_group(deadline)
            self.regroups += 1
            outcome = ("so a new one was made on the same ranks: their names are kept; make again what used the "
                       "old group (a DDP model)")
        except Exception as e:  # noqa: BLE001 - then fresh ranks
            self._restart_with(None)
            outcome = f"and making a new one failed ({type(e).__name__}): fresh ranks start on the next call"
        who = f"rank {lost[0]} has" if len(lost) == 1 else "ranks " + ", ".join(map(str, lost)) + " have"
        print(f"(warm ranks: {who} no default process group after this {what} (`dist.destroy_process_group()`, "
              f"e.g. a tutorial's `cleanup()`), {outcome}. Warm ranks keep one group: leave `init_process_group` "
              "and `destroy_process_group` (`setup()`, `cleanup()`) out of code you run on them.)",
              file=sys.stderr, flush=True)

    # -- public calls --------------------------------------------------------------------------

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list:
        """Call ``fn(rank, world_size, *args, **kwargs)`` on every rank (a cell's ``fn`` goes by value);
        ``results[r]`` from rank ``r``. Output appears as it arrives, as ``[rank r]`` lines.

        Args:
            timeout: seconds for this call (default: the ranks' ``timeout``).

        Raises:
            LaunchError: something cannot be sent, as for ``launch``.
            WorkerError: a rank raised, returned what cannot be pickled back, or died; when a rank
                died, peers waited or a collective failed, all ranks were ended (fresh ones next call).
            RanksTimeout: past ``timeout``; names the ranks not finished; all ranks were ended.
            KeyboardInterrupt: SIGINT was sent to the ranks (all ended if they did not stop).
        """
        if not callable(fn):
            raise LaunchError(f"fn must be a function, got {fn!r} of type {type(fn).__name__}.")
        # LaunchError naming the variable, before the ranks are touched; the payload keeps a cell's
        # file name and lines, so a rank's traceback shows the cell's line
        payload = serialise_call(fn, args, kwargs)
        self._check_alive("run")
        ar = self.view.apply_async(remote.call_payload, payload)
        output = remote.RankOutput(ar)
        try:
            errors, fault = self._supervise_with_output(ar, timeout, "run", poll=output.poll)
        finally:  # what the ranks printed, also before a fault
            output.poll(final=True)
        if errors or fault:
            self._raise_for(ar, errors, fault, "run")
        pairs = ar.get(0)  # (result, has a default group) per rank: warm_ranks_remote.call
        self._raise_for(ar, [], None, "run", has_group=[g for _, g in pairs])
        return [result for result, _ in pairs]

    def push(self, values: dict[str, Any], timeout: float | None = None) -> None:
        """Define names on every rank: ``ranks.push({"lr": lr})`` sends the kernel's ``lr`` for ``%%px`` cells.

        Raises:
            LaunchError: a name is not an identifier, or a value cannot be sent (named, as ``run`` does).
            WorkerError, RanksTimeout: as :meth:`run`.
        """
        if not isinstance(values, dict) or not all(isinstance(k, str) and k.isidentifier() for k in values):
            raise LaunchError(f"push takes a dict of variable names to values, e.g. ranks.push({{'lr': lr}}); "
                              f"got {values!r:.200}.")
        serialise_call(dict, (), values)  # LaunchError naming the value, before the ranks are touched
        self._check_alive("push")
        ar = self.view.push(values, block=False)
        errors, fault = self._supervise(ar, timeout, "push")
        if errors or fault:
            self._raise_for(ar, errors, fault, "push")

    def pull(self, name: str, timeout: float | None = None) -> list:
        """Every rank's value of the variable ``name`` (from ``%%px`` cells or :meth:`push`), in rank order.
        Raises WorkerError: a rank has no such name (NameError), or as :meth:`run`."""
        if not isinstance(name, str) or not name.isidentifier():
            raise LaunchError(f"pull takes one variable name, e.g. ranks.pull('loss'); got {name!r:.200}.")
        self._check_alive("pull")
        ar = self.view.pull(name, block=False)
        errors, fault = self._supervise(ar, timeout, "pull")
        if errors or fault:
            try:
                self._raise_for(ar, errors, fault, "pull")
            except WorkerError as e:
                if e.exc_type != "NameError":
                    raise
                raise e.with_note(f"no rank has a variable {name!r}: define it in a %%px cell, or send "
                                  f"it from the kernel with ranks.push({{{name!r}: value}})") from None
        return ar.get(0)

    def execute(self, code: str, timeout: float | None = None, stream: bool | None = None) -> None:
        """Run ``code`` on every rank, as ``%%px`` does, showing each rank's output labelled by rank.

        Output reads in rank order. ``stream`` (default: on unless ``IPP_NONINTERACTIVE``): output
        shows as it arrives and, once the cell ends (also by a fault), is put in rank order; else it
        shows at the end (``display_outputs(groupby="engine")``). Errors: as :meth:`run`.
        """
        self._check_alive("the %%px cell")
        if stream is None:
            stream = not ipp._NONINTERACTIVE
        self._note_cell(code)  # its frames on the ranks carry a file name made from the code
        ar = self.view.execute(code, silent=False, block=False)
        ar._fname = "%px"
        in_rank_order = remote.stream_per_rank(ar)
        with ar.stream_output() if stream else contextlib.nullcontext():
            errors, fault = self._supervise_with_output(ar, timeout, "%%px cell")
        if stream:
            in_rank_order()
        else:
            remote.display_in_rank_order(ar)
        self._raise_for(ar, errors, fault, "%%px cell", kernel_names=remote.kernel_namespace())


def _px_magic(line: str, cell: str | None = None):
    """``%%px [--timeout S]``: run the cell on every warm rank (:meth:`WarmRanks.execute`); other
    options go to ipyparallel's own magic (no time limit, no restart)."""
    code, opts = (line, "") if cell is None else (cell, line.strip())
    timeout = None
    m = re.fullmatch(r"--timeout[ =](\S+)", opts)
    if m:
        try:
            timeout, opts = float(m.group(1)), ""
        except ValueError:
            raise LaunchError(f"%%px --timeout takes seconds, got {m.group(1)!r}: e.g. %%px --timeout 60") from None
        check_timeout(timeout)
    ranks = current_ranks()
    if ranks is None:
        raise NoRanks("no warm ranks are running: run `ranks = start_ranks(world_size=2)` first")
    if opts:
        if ranks._ipp_px is None:
            raise RuntimeError(f"unsupported %%px options {opts!r}")
        return ranks._ipp_px(line, cell)
    ranks.execute(code, timeout=timeout)

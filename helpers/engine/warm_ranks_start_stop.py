"""Warm ranks' processes (:class:`RankProcesses`, held by :class:`.warm_ranks.WarmRanks`): start the
ipyparallel controller, the ranks' ipyparallel engines and the process group, retry a start whose port another
process took, stop everything and check that nothing is left.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import logging.handlers
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ipyparallel as ipp
import psutil

from helpers.engine import stacks
from helpers.engine import warm_ranks_remote as remote
from helpers.engine.fork_server import socket_folder, start_method
from helpers.engine.launcher import threads_per_rank
from helpers.engine.processes import descendants, end_processes, in_sessions, is_live
from helpers.engine.warm_ranks_forked import ForkedRankSetLauncher

_START_TIMEOUT_S = 180.0  # ipyparallel engines + torch import + process group (seconds; 2 busy cores)
_START_ATTEMPTS = 4  # starts tried when another process took a port ipyparallel's controller had chosen
_START_POLL_S = 0.1  # how often a start checks the controller's and ranks' output and processes (seconds)


def _output_of(launcher) -> str:
    """What an ipyparallel launcher's process has written so far (its output file). Not
    ``launcher.get_output()``: that caches the text at its first call, and removes the file on stop."""
    if getattr(launcher, "_output", None) is not None:
        return launcher._output
    try:
        with open(launcher.output_file, errors="replace") as f:
            return f.read()
    except (OSError, AttributeError, TypeError):
        return ""


def _left_message(left: list) -> str:
    """The end of a failed start's message: what was checked to be left running."""
    if not left:
        return "its controller and rank processes were ended, and none is left running (checked)"
    pids = ", ".join(str(p.pid) for p in left)
    return f"these of its processes could not be ended: pids {pids}; end them with `kill -9 {pids.replace(',', '')}`"



class RankProcesses:
    """The controller, the rank processes and the group of one set of warm ranks. Attributes:
    ``cluster``, ``client``, ``view`` (ipyparallel's, all ranks in rank order), ``pids``, ``devices``,
    ``profile_dir``, ``start_attempts``, ``startup_seconds``; ``group_timeout`` (seconds: the ranks'
    ``timeout`` plus 5)."""

    def __init__(self, world_size: int, backend: str, timeout: float, env: dict):
        self.world_size, self.backend, self.env = world_size, backend, env
        self.group_timeout = timeout + 5.0
        self.cluster = self.client = self.view = self.profile_dir = self.watchdog = None
        self.pids: list[int] = []
        self.devices: list[str] = []
        self.started: list = []  # the process trees as they were once started
        self.start_attempts = 0
        self.startup_seconds = None
        self.ipp_log: logging.Logger | None = None
        self.ipp_held: logging.handlers.BufferingHandler | None = None

    def start(self) -> None:
        """Start, trying again with new ports when one was taken. Raises RuntimeError (everything of the
        start ended; the message says whether that was checked) or KeyboardInterrupt."""
        t0 = time.perf_counter()
        for attempt in range(1, _START_ATTEMPTS + 1):
            self.start_attempts = attempt
            try:
                self._start_once()
                self._release_ipp_log(show=True)
                break
            except BaseException as e:
                taken = None if isinstance(e, KeyboardInterrupt) else self._port_taken()
                self._release_ipp_log(show=not taken)
                left = self.shutdown()
                if taken and not left and attempt < _START_ATTEMPTS:
                    continue  # a port was taken between ipyparallel choosing it and binding it: new ports
                if isinstance(e, KeyboardInterrupt):
                    raise
                if taken:
                    why = (f"on {attempt} tries, another process took a port ipyparallel's controller had "
                           f"chosen before it could bind it ({taken}: Address already in use)")
                else:
                    why = f"{type(e).__name__}: {remote.ANSI.sub('', str(e))}"
                raise RuntimeError(f"warm ranks did not start ({why}); {_left_message(left)}") from e
        self.startup_seconds = time.perf_counter() - t0

    def _start_once(self) -> None:
        """One try at starting the controller, the ranks' ipyparallel engines and the group. Every wait
        watches the processes and the controller's output (:meth:`wait_for`): a port taken or a process
        gone ends it at once."""
        # ipyparallel's reports held back while starting (a lost port is retried silently), then to stderr
        self.ipp_log = logging.Logger("helpers.engine.warm_ranks ipyparallel", logging.WARNING)
        self.ipp_held = logging.handlers.BufferingHandler(capacity=10_000)
        self.ipp_log.addHandler(self.ipp_held)
        self.profile_dir = tempfile.mkdtemp(prefix="ddp-lab-ranks-")
        self._start_watchdog()  # now: a kernel killed while the controller starts leaves nothing either
        deadline = time.monotonic() + _START_TIMEOUT_S
        # rank processes forked from the fork server (torch imported there once), unless env must be set before torch
        forked = not self.env and start_method() == "forkserver"
        forked = {"engine_launcher_class": ForkedRankSetLauncher} if forked else {}
        self.cluster = ipp.Cluster(
            **forked, controller_args=remote.CONTROLLER_ARGS,
            n=self.world_size, profile_dir=self.profile_dir, cluster_id="ddp-lab",
            controller_ip="127.0.0.1", delay=0.0, engine_timeout=int(_START_TIMEOUT_S),
            log=self.ipp_log, shutdown_atexit=False, load_profile=False, config=remote.ipengine_config(self.env))
        self.cluster.start_cluster_sync(n=self.world_size)
        self.client = self.cluster.connect_client_sync()
        # interactive=False: no progress bar in the cell
        engines = self.client.wait_for_engines(self.world_size, timeout=_START_TIMEOUT_S, interactive=False,
                                               block=False)
        self.wait_for(engines, "the ranks registering", deadline)
        ids = sorted(self.client.ids)
        assert ids == list(range(self.world_size)), f"ipyparallel engine ids {ids}"
        self.view = self.client[ids]
        self.view.use_cloudpickle()  # cell-defined functions, closures, classes by value
        self.pids = self.wait_for(self.view.apply_async(os.getpid), "the ranks answering", deadline)
        self.started = self.processes()
        self.join_group(deadline)
        self.wait_for(self.view.apply_async(remote.register_stacks, self.profile_dir), "the ranks' stack dumps",
                      deadline)
        for r in ids:
            self.wait_for(self.client[r].push({"rank": r, "world_size": self.world_size}, block=False),
                          "setting rank and world_size", deadline)
        self.wait_for(self.view.execute(remote.PRELUDE, block=False), "the prelude (import torch)", deadline)

    def join_group(self, deadline: float) -> None:
        """Every rank joins a new default group, through a TCPStore rank 0 opens on port 0."""
        group_timeout = self.group_timeout
        port = self.wait_for(self.client[0].apply_async(remote.open_store, self.world_size, group_timeout),
                             "rank 0 opening the group's store", deadline)
        joins = [self.client[r].apply_async(remote.join_group, r, self.world_size, self.backend, port, group_timeout,
                                            threads_per_rank(self.world_size))
                 for r in range(self.world_size)]
        self.devices = [self.wait_for(j, "the ranks joining the process group", deadline) for j in joins]

    def wait_for(self, waiting, what: str, deadline: float):
        """The result of ``waiting`` (an AsyncResult or a Future), checking every :data:`_START_POLL_S` s
        that no port was taken and no process exited (else RuntimeError); TimeoutError past ``deadline``."""
        while True:
            if isinstance(waiting, ipp.AsyncResult):
                if waiting.wait(_START_POLL_S):
                    return waiting.get(0)
            else:
                concurrent.futures.wait([waiting], timeout=_START_POLL_S)
                if waiting.done():
                    return waiting.result()
            taken = self._port_taken()
            if taken:
                raise RuntimeError(f"{taken}: Address already in use")
            gone = self._gone_while_starting()
            if gone:
                raise RuntimeError(f"{gone} while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} took longer than {_START_TIMEOUT_S:g} s")

    def _release_ipp_log(self, show: bool) -> None:
        """What ipyparallel logged during the start to stderr (``show``) or dropped; then straight to stderr."""
        held = self.ipp_held
        if self.ipp_log is None or held is None:
            return
        self.ipp_log.removeHandler(held)
        stderr = logging.StreamHandler(sys.stderr)
        if show:
            for record in held.buffer:
                stderr.handle(record)
        held.close()
        self.ipp_held = None
        self.ipp_log.addHandler(stderr)

    def _launchers(self) -> list:
        """ipyparallel's launchers of the controller and every rank's ipyparallel engine (none once stopped)."""
        if self.cluster is None:
            return []
        launchers = [self.cluster.controller] if self.cluster.controller is not None else []
        for es in self.cluster.engines.values():
            launchers += list(es.launchers.values())
        return launchers

    def _port_taken(self) -> str | None:
        """The address (``tcp://127.0.0.1:PORT``) a process of the start could not bind (its output), or ``None``."""
        for launcher in self._launchers():
            m = remote.PORT_TAKEN.search(_output_of(launcher))
            if m:
                return m.group(1) or "a port"
        return None

    def _gone_while_starting(self) -> str | None:
        """"the ipyparallel controller exited (...)" when a process of the start has ended, else None."""
        for launcher in self._launchers():
            proc = getattr(launcher, "process", None)
            if proc is not None and not is_live(proc):
                controller = launcher is self.cluster.controller
                who = "the ipyparallel controller" if controller else "a rank's ipyparallel engine"
                last = [line for line in _output_of(launcher).splitlines() if line.strip()][-1:]
                return f"{who} (pid {proc.pid}) exited" + (f" ({last[0].strip()[:300]})" if last else "")
        return None

    def _start_watchdog(self) -> None:
        folders = [self.profile_dir, *filter(None, [socket_folder()])]  # removed if the kernel dies
        self.watchdog = subprocess.Popen(
            [sys.executable, "-c", remote.WATCHDOG, str(os.getpid()), *folders],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # not in the kernel's process group: it must outlive a killpg

    def _launched(self) -> list:
        """The controller's and every rank's process as ipyparallel's launchers started them."""
        return [el.process for el in self._launchers() if getattr(el, "process", None) is not None]

    def _marked(self) -> list:
        """This process's descendants whose ``IPP_PROFILE_DIR`` is this set's profile folder."""
        found = []
        if not self.profile_dir:
            return found
        for p in descendants(os.getpid()):
            with contextlib.suppress(psutil.Error):
                if p.environ().get("IPP_PROFILE_DIR") == self.profile_dir:
                    found.append(p)
        return found

    def processes(self) -> list:
        """The controller and rank process trees (psutil.Process), found from the launchers."""
        roots = self._launched()
        roots += [psutil.Process(p) for p in self.pids if psutil.pid_exists(p)]
        procs = {p.pid: p for p in self.started if p.is_running()}  # also any re-parented since

        for p in roots:
            with contextlib.suppress(psutil.Error):
                procs[p.pid] = p
                for c in p.children(recursive=True):
                    procs[c.pid] = c
        return list(procs.values())

    def shutdown(self) -> list:
        """Kill the controller, the rank processes and the watchdog; remove ipyparallel's folder. Returns the
        processes of these ranks still running afterwards, looked for again (normally none)."""
        procs = self.processes()  # and what the ranks started, even re-parented (each rank has its session)
        procs += [p for p in [*self._marked(), *in_sessions(set(self.pids))] if p.pid not in {q.pid for q in procs}]
        # ended on purpose: ipyparallel would log each exit and the controller's whole log as warnings
        if self.ipp_log is not None:
            self.ipp_log.disabled = True
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close(linger=0)
        left = end_processes(procs, terminate=False, timeout=5.0)  # SIGKILL: rank processes hold nothing worth a grace
        left += [p for p in self._marked() if is_live(p) and p.pid not in {q.pid for q in left}]
        if self.cluster is not None:
            self.cluster.controller = None  # already dead: ipyparallel has nothing left to stop
            self.cluster.engines = {}
        if self.watchdog is not None:
            with contextlib.suppress(Exception):
                self.watchdog.kill()
                self.watchdog.wait(5)
        if self.profile_dir:
            shutil.rmtree(self.profile_dir, ignore_errors=True)
        self.cluster = self.client = self.view = self.watchdog = self.profile_dir = None
        self.pids, self.started = [], []
        return left

    def stacks_of(self, ranks: list[int]) -> dict[int, str]:
        """Each of ``ranks``' Python stack (SIGUSR1, :func:`helpers.engine.stacks.collect`; ``{}`` if
        interrupted again), for a timed-out or interrupted call before the ranks are ended."""
        try:
            return stacks.collect(self.profile_dir, {r: self.pids[r] for r in ranks}) if self.profile_dir else {}
        except KeyboardInterrupt:  # a second interrupt: skip the diagnosis, never the clean-up
            return {}

    def dead_ranks(self) -> dict[int, str]:
        """``{rank: description}`` of ranks whose process is gone (killed, exited)."""
        return {r: remote.exit_description(self.cluster, pid)
                for r, pid in enumerate(self.pids) if not is_live(pid)}

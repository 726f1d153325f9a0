"""Warm ranks' processes (ipyparallel engines) forked from the fork server: ``import torch`` is not paid again per rank.

ipyparallel starts each engine as a fresh interpreter, which then imports torch (seconds per rank).
:class:`ForkedRankSetLauncher` forks it from :mod:`helpers.engine.fork_server` instead: a
``forkserver`` ``multiprocessing.Process`` running ``ipyparallel.engine.app.main`` with the arguments,
environment, output file and session ``LocalEngineLauncher`` would give. It inherits what a launch's
rank does (:data:`~helpers.engine.fork_server.PRELOAD`, the caller's environment of now), none of the
kernel's state. Not with ``start_ranks(env=...)``: those variables must be set before torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.process
import os
import sys

import psutil
from ipyparallel.cluster import launcher

from helpers.engine.fork_server import close_inherited_pipe, fork_server, fresh_random_state, main_without_file

__all__ = ["RANK_PROCESS_NAME", "ForkedRankLauncher", "ForkedRankSetLauncher"]

#: A forked rank's process name (``/proc/<pid>/comm``, what ``ps`` and ``psutil.Process.name()``
#: show; at most 15 characters): its command line is the fork server's, so this tells it apart.
RANK_PROCESS_NAME = "ipyparallel-eng"
_PR_SET_NAME = 15  # from <linux/prctl.h>


def _rank_main(args: list[str], env: dict[str, str], output_file: str, cwd: str | None) -> None:
    """In the forked child: become what ipyparallel's ``Popen`` would have started, then run ipyparallel's engine."""
    close_inherited_pipe()  # the server must notice its parent's death while ranks live
    fresh_random_state()  # not the server's generators: each rank of each start draws its own numbers
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, RANK_PROCESS_NAME.encode(), 0, 0, 0)
    multiprocessing.set_start_method(None, force=True)  # the platform's default, as in a fresh interpreter
    os.setsid()  # ipyparallel's start_new_session=True: no signal to the kernel's group reaches the rank
    out = os.open(output_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (the process's own streams)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    sys.argv = ["ipengine", *args]
    from ipyparallel.engine.app import main

    main()


class ForkedRankLauncher(launcher.LocalEngineLauncher):
    """One rank's ipyparallel engine, forked from the fork server (see the module's docstring); stopped, signalled and
    waited for by pid as ipyparallel's own launcher does, with the exit code the fork server reports."""

    _mp = None

    def start(self):
        if self.state != "before":
            raise launcher.ProcessStateError(f"The process was already started and has state: {self.state}")
        env = os.environ.copy()
        env.update(self.get_env())
        args = list(self.args[len(self.engine_cmd):])
        # main_without_file: a script read on standard input (`python3 - < script.py`) is no file
        # the ipyparallel engine could re-run
        with fork_server(), main_without_file():
            proc = multiprocessing.get_context("forkserver").Process(
                target=_rank_main, args=(args, env, self.output_file, self.work_dir), name=self.identifier)
            proc.start()
        # not joined at this process's exit by multiprocessing (the ranks' own stop ends it)
        multiprocessing.process._children.discard(proc)
        self._mp = proc
        self.pid = proc.pid
        self.process = psutil.Process(proc.pid)
        self.notify_start(proc.pid)
        self._start_waiting()

    def _wait(self):
        exit_code = None
        while not self._stop_waiting.is_set() and self.state == "running":
            if self._mp._popen.wait(timeout=1.0) is not None:
                exit_code = self._mp.exitcode
                break
        self.process._exitcode = exit_code  # where helpers.engine.warm_ranks_remote.exit_description reads it
        stop_data = dict(exit_code=exit_code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))


class ForkedRankSetLauncher(launcher.LocalEngineSetLauncher):
    """ipyparallel's local engine set, each ipyparallel engine a :class:`ForkedRankLauncher`."""

    launcher_class = ForkedRankLauncher

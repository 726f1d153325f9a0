"""The fork server :func:`helpers.engine.launch` forks its ranks from: ``import torch`` once per kernel,
not once per rank per launch.

Python's **forkserver** start method starts a *server* (a fresh interpreter, as ``spawn`` starts) that
imports :data:`PRELOAD` and waits; each rank is a ``fork`` of it, not of the kernel: torch imported,
none of the kernel's state (variables, CUDA context, threads). Python's docs ("Contexts and start
methods"): "The fork server process is single threaded unless system libraries or preloaded imports
spawn threads ... so it is generally safe for it to use os.fork()" (OpenBLAS's pool stops around a
fork with ``pthread_atfork``). PyTorch names ``spawn`` or ``forkserver`` for CUDA in subprocesses
(https://pytorch.org/docs/stable/notes/multiprocessing.html#cuda-in-multiprocessing).

What this module adds to ``multiprocessing.forkserver``:

- **the caller's environment, now**: when ``os.environ`` changed since the server started (a cell
  set ``OMP_NUM_THREADS``), :func:`fork_server` starts a new one, so a rank sees what a ``spawn``-ed
  rank would; :data:`VOLATILE_ENV` and :data:`AGENT_ENV` do not count.
- **a socket path that fits**: where ``TMPDIR`` is too long for a Unix socket (Python 3.10-3.12:
  ``AF_UNIX path too long``), the socket goes in :func:`helpers.engine.socket_folder.socket_dir`.
- **a session of its own** (server and resource tracker): ipykernel's shutdown signals every child
  of its process group, zombies included (``_progressively_terminate_all_children``), and the
  kernel never exited by itself; "interrupt kernel" still reaches the ranks through ``launch``.
- **its lifetime**: an ``atexit`` hook SIGKILLs and reaps the server (on its own it exits seconds
  later, after tearing torch down); a killed caller's server exits by its parent pipe and the
  ranks by their parent-death signal. :func:`stop_fork_server` ends it now.
- **a main script without a file** (``python3 - <<EOF``: ``__main__.__file__`` is ``"<stdin>"``, and
  each rank re-ran it and died, ``FileNotFoundError``): :func:`main_without_file` leaves it out.

Where ``forkserver`` is missing (Windows) or ``ForkServer._stop`` is (private, since 3.8),
:func:`start_method` is ``"spawn"`` and every rank imports torch itself.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from multiprocessing import forkserver, spawn, util
from unittest import mock

from helpers.engine.socket_folder import SUN_PATH_MAX, socket_dir

__all__ = ["AGENT_ENV", "PRELOAD", "VOLATILE_ENV", "close_inherited_pipe", "environment", "fork_server",
           "fork_server_pid", "fresh_random_state", "main_without_file", "socket_folder", "start_method",
           "stop_fork_server"]

#: Modules the server imports once. ``torch._dynamo``: the first ``DDP(...)`` in a process imports it,
#: 2.67 s per rank on 2 cores (0.003 s preloaded). Only third-party libraries: an edit to ``helpers``
#: is seen by the next launch.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torchvision", "cloudpickle", "psutil")

#: Variables that change by themselves between calls (pytest's test name): no change of environment.
VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})

#: The variables the elastic agent sets in every rank: no rank reads the server's values (the agent,
#: :mod:`helpers.mp` and warm ranks set them after the fork), so a change in these keeps the server
#: (a tutorial's ``MASTER_PORT`` cell costs no fresh ``import torch``).
AGENT_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")

_lock = threading.Lock()
_server_env: tuple | None = None  # the environment the running server was started with
_active = 0  # launches using the server right now (stop_fork_server refuses meanwhile)


def start_method() -> str:
    """``"forkserver"`` where Python offers it and it can be restarted, else ``"spawn"``."""
    if "forkserver" in multiprocessing.get_all_start_methods() and hasattr(forkserver.ForkServer, "_stop"):
        return "forkserver"
    return "spawn"


def environment(ignore: frozenset | tuple = ()) -> tuple:
    """``os.environ`` as a sorted tuple of ``(name, value)`` without :data:`VOLATILE_ENV`, ``ignore``, and
    ``TORCHINDUCTOR_CACHE_DIR`` when it holds torch's default (``import torch._dynamo`` writes it,
    ``cache_dir_utils.cache_dir()``; a fresh process computes the same): "the same environment"."""
    env = {k: v for k, v in os.environ.items() if k not in VOLATILE_ENV and k not in ignore}
    cache = sys.modules.get("torch._inductor.runtime.cache_dir_utils")  # loaded by whoever set the variable
    if cache is not None and env.get("TORCHINDUCTOR_CACHE_DIR") == os.path.abspath(cache.default_cache_dir()):
        del env["TORCHINDUCTOR_CACHE_DIR"]
    return tuple(sorted(env.items()))


#: ``multiprocessing``'s socket names (``connection.arbitrary_address``): ``listener-`` and 8
#: characters, in a per-process folder ``pymp-`` and 8 characters (``util.get_temp_dir``).
_LISTENER_NAME = len("listener-") + 8
_PYMP_NAME = len("pymp-") + 8


def _socket_folder_that_fits() -> None:
    """Before Python binds the server's socket in its per-process temp folder (``pymp-*``, made on
    first use in ``TMPDIR`` and kept in ``current_process()._config["tempdir"]``): if that path
    would be too long, make the folder in :func:`helpers.engine.socket_folder.socket_dir` instead, removed when
    this process exits, as Python removes its own. CPython 3.14's ``util.get_temp_dir`` does this
    itself (https://github.com/python/cpython/issues/132124).

    Raises:
        OSError: no temp folder short enough (:func:`helpers.engine.socket_folder.socket_dir`).
    """
    config = multiprocessing.current_process()._config
    folder = config.get("tempdir")
    if folder is not None and len(os.fsencode(folder)) + 1 + _LISTENER_NAME < SUN_PATH_MAX:
        return
    base = socket_dir(_PYMP_NAME + 1 + _LISTENER_NAME)
    if folder is None and base == tempfile.gettempdir():
        return  # Python makes its folder in TMPDIR, and the socket fits there
    folder = tempfile.mkdtemp(prefix="pymp-", dir=base)
    util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
    config["tempdir"] = folder


def socket_folder() -> str | None:
    """The server's socket folder (``pymp-*``, made now if need be), for a launch's reaper; ``None`` under spawn."""
    if start_method() != "forkserver":
        return None
    with _lock:
        _socket_folder_that_fits()
        return util.get_temp_dir()


def _no_tracker_in_our_process_group() -> None:
    """Stop ``multiprocessing``'s resource tracker if it runs in this process's Unix process group (started
    by other code, e.g. a ``multiprocessing.Queue``): ipykernel's shutdown signals it and it ignores
    SIGTERM. The server's start brings a new one up in a session of its own; the stopped one cleans up."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    pid = getattr(tracker, "_pid", None)
    if os.name != "posix" or pid is None:
        return
    try:
        if os.getpgid(pid) != os.getpgrp():
            return
    except OSError:
        return  # gone: the server's start brings a new one up
    with contextlib.suppress(OSError, ChildProcessError):
        tracker._stop()


#: pid -> Popen of what :func:`_in_a_session_of_their_own` started (multiprocessing reaps them: :func:`_reaped`).
_STARTED: dict[int, subprocess.Popen] = {}


def _in_a_session_of_their_own():
    """For the block, what ``multiprocessing`` starts with ``util.spawnv_passfds`` (the fork server, the
    resource tracker) starts in a new session: ``subprocess.Popen(..., start_new_session=True)``."""
    def spawnv_passfds(path, args, passfds):
        proc = subprocess.Popen(list(args), executable=path, pass_fds=tuple(sorted(map(int, passfds))),
                                close_fds=True, start_new_session=True)
        _STARTED[proc.pid] = proc
        return proc.pid

    if os.name != "posix":
        return contextlib.nullcontext()
    return mock.patch.object(util, "spawnv_passfds", spawnv_passfds)


def _reaped(pid: int, exit_code: int) -> None:
    """``pid`` was reaped: its Popen gets the exit code (no warning at exit, no wait on a reused pid)."""
    proc = _STARTED.pop(pid, None)
    if proc is not None and proc.returncode is None:
        proc.returncode = exit_code


def _running_pid() -> int | None:
    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return None
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere: Python's own ensure_running would fail on it
        done, status = pid, 0
    if not done:
        return pid
    _reaped(pid, os.waitstatus_to_exitcode(status))
    # gone (killed by someone): forget it, as ForkServer.ensure_running does for a dead server
    with contextlib.suppress(OSError, TypeError):
        os.close(server._forkserver_alive_fd)
    server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    return None


def fork_server_pid() -> int | None:
    """The pid of the running fork server, or ``None`` if none runs."""
    with _lock:
        return _running_pid()


def main_without_file():
    """For the block, processes ``multiprocessing`` starts are not asked to re-run a main script that has
    no file (``init_main_from_path`` of ``<stdin>``); a real file is re-run as before."""
    original = spawn.get_preparation_data

    def get_preparation_data(name):
        data = original(name)
        if not os.path.exists(data.get("init_main_from_path") or "."):
            del data["init_main_from_path"]
        return data

    return mock.patch.object(spawn, "get_preparation_data", get_preparation_data)


class fork_server:
    """``with fork_server() as pid:`` starts the server (again, after an environment change) for one
    launch and gives its pid, the ranks' parent (``None`` under ``spawn``); :func:`stop_fork_server`
    refuses during the block.

    Raises:
        OSError: the server could not be started.
    """

    def __enter__(self) -> int | None:
        global _server_env, _active, _owner
        if start_method() != "forkserver":
            self.used = False
            return None
        with _lock:
            env = environment(ignore=AGENT_ENV)
            pid = _running_pid()
            if pid is not None and _server_env != env:  # no launch uses it: launches are serialised
                _stop_unlocked()
                pid = None
            if pid is None:
                _socket_folder_that_fits()
                forkserver.set_forkserver_preload(list(PRELOAD))
                _no_tracker_in_our_process_group()
                with _in_a_session_of_their_own():
                    forkserver.ensure_running()
                _server_env = env
                pid = _running_pid()
                _owner = (os.getpid(), pid)
            _active += 1
            self.used = True
            return pid

    def __exit__(self, *exc) -> bool:
        global _active
        if self.used:
            with _lock:
                _active -= 1
        return False


_owner: tuple[int, int] | None = None  # (this process's pid, the pid of the server it started last)


def _end_at_exit() -> None:
    """At a normal exit: SIGKILL and reap the server this process started, before multiprocessing's
    exit hook (registered earlier, so run later) removes its socket folder. A no-op in a process that
    did not start it (a rank) and while a ``multiprocessing`` child still runs (its exit hook joins it)."""
    if _owner is None or _owner[0] != os.getpid() or _running_pid() != _owner[1]:
        return
    if multiprocessing.active_children():
        return
    with contextlib.suppress(OSError):
        os.kill(_owner[1], signal.SIGKILL)
    with contextlib.suppress(OSError):
        _stop_unlocked(exit_code=-signal.SIGKILL)


atexit.register(_end_at_exit)


def _stop_unlocked(exit_code: int = 0) -> None:
    global _server_env
    pid = _running_pid()
    if pid is not None:
        forkserver._forkserver._stop()  # closes its "alive" pipe; the server exits; waits for it
        _reaped(pid, exit_code)
    _server_env = None


def close_inherited_pipe() -> None:
    """In a rank forked from the server: close its copy of the pipe the server watches, or the server
    would outlive its parent while a rank lives (and the rank, watching the server, too)."""
    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def fresh_random_state() -> None:
    """In a process forked from the server: seed the generators it copied (torch's CPU one, numpy's,
    ``random``) from the OS, as a fresh interpreter does; else every rank would draw the same numbers.
    CUDA's are made, fresh, on first use (the server never initialises CUDA)."""
    import random

    random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def stop_fork_server() -> bool:
    """End the fork server now (it also ends by itself when this process exits).

    Returns:
        bool: whether a server was running.

    Raises:
        RuntimeError: a launch is using it right now.
    """
    with _lock:
        if _active:
            raise RuntimeError("a launch is using the fork server: stop it after the launch returns")
        running = _running_pid() is not None
        _stop_unlocked()
        return running

"""The fork server :func:`helpers.engine.launch` starts its ranks from: ``import torch`` once per
kernel, not once per rank per launch.

``import torch`` takes seconds, and a ``spawn``-ed rank pays it every time. Python's third start
method, **forkserver**, pays it once: the first launch starts a *server* process, a fresh
interpreter started like ``spawn`` (``python -c 'from multiprocessing.forkserver import main;
...'``), which imports the modules in :data:`PRELOAD` (torch, and what DDP imports on first use)
and waits. Each rank is then a
``fork`` of that server, not of the kernel: it has torch already imported, but none of the
kernel's state (no notebook variables, no CUDA context, none of the kernel's threads), so what
``spawn`` protects against still cannot happen, and a cell's functions still travel by value
with cloudpickle. Python's docs (https://docs.python.org/3/library/multiprocessing.html,
"Contexts and start methods"): "The fork server process is single threaded unless system
libraries or preloaded imports spawn threads as a side-effect so it is generally safe for it to
use os.fork(). No unnecessary resources are inherited." (numpy, which torch imports, starts
its OpenBLAS thread pool; OpenBLAS shuts it down around a fork with ``pthread_atfork``, as it
does for every ``fork``-based DataLoader worker.) PyTorch's docs name ``spawn`` or
``forkserver`` as the start methods that can use CUDA in subprocesses
(https://pytorch.org/docs/stable/notes/multiprocessing.html#cuda-in-multiprocessing).

What this module adds to Python's fork server (``multiprocessing.forkserver``):

- **the caller's environment, now**: a forked rank inherits the server's environment, i.e. the
  caller's at the moment the server started. If ``os.environ`` has changed since (a cell set
  ``TORCH_DISTRIBUTED_DEBUG`` or ``OMP_NUM_THREADS``), :func:`fork_server` stops the server and
  starts a new one with the environment of now (a fresh ``import torch`` for that launch), so a
  rank always sees what a ``spawn``-ed rank would see. Variables in :data:`VOLATILE_ENV` do
  not count as a change, nor do those in :data:`AGENT_ENV`, which every rank gets anew.
- **a socket path that fits**: Python binds the server's Unix socket at
  ``<TMPDIR>/pymp-XXXXXXXX/listener-XXXXXXXX``; where ``TMPDIR`` is too long for a socket path
  (Python 3.10 to 3.12 fail with ``OSError: AF_UNIX path too long``), :func:`fork_server` puts it
  in a folder that fits (:func:`helpers.engine.socket_folder.socket_dir`), as CPython 3.14 does itself.
- **a session (so a Unix process group) of its own**: ipykernel answers a shutdown request by
  signalling every child in its Unix process group until none is left, zombies included
  (``_progressively_terminate_all_children`` in ipykernel/kernelbase.py, about 29 s of
  back-offs); a server it SIGTERMed stayed a zombie and multiprocessing's resource tracker
  ignores SIGTERM, so a kernel that had launched did not exit by itself, jupyter_client SIGTERMed
  it after 2.5 s, and its atexit hooks never ran (its ``pymp-*`` folder stayed in the temp
  directory). :func:`fork_server` starts the server, and the resource tracker if none runs yet,
  in a new session. The ranks forked from the server are in its group too: "interrupt kernel"
  reaches them through :func:`helpers.engine.launch`, which ends them when the caller gets
  ``KeyboardInterrupt``; a signal to the caller's process group (a terminal's Ctrl-C, a
  ``killpg``) no longer reaches the server itself.
- **its lifetime**: the server is a child of the caller and lives as long as the caller does
  (a kernel, a script): when the caller exits normally, an ``atexit`` hook SIGKILLs and reaps it
  (on its own the server exits on end-of-file from its parent's pipe, but only after tearing
  torch down: seconds after the caller, on a busy machine, and a notebook runner counts it as
  left behind); when the caller is killed (SIGKILL, also to its whole process group) the server
  exits by itself, those seconds later (Python's server watches a pipe from its parent), and the
  ranks forked from it then die by their parent-death signal.
  It is the one long-lived process a launch leaves, like ``multiprocessing``'s resource
  tracker; :func:`stop_fork_server` ends it now.

- **a main script without a file**: for a script piped on stdin (``python3 - <<EOF``),
  ``__main__.__file__`` is ``"<stdin>"``, and Python's preparation data asks every new process to
  re-run that "file" as ``__mp_main__`` (``init_main_from_path``): each rank died with
  ``FileNotFoundError: '<cwd>/<stdin>'``. :func:`main_without_file` leaves that request out when
  the path does not exist (functions of ``__main__`` go by value with cloudpickle anyway).
  ``python3 -c`` has no ``__file__`` and needs nothing.

Where ``forkserver`` is not available (Windows) or this Python's ``ForkServer`` cannot be
stopped (a private method, ``ForkServer._stop``, present since Python 3.8), :func:`start_method`
is ``"spawn"`` and every rank imports torch itself.
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

from helpers.engine.socket_folder import SUN_PATH_MAX, socket_dir

__all__ = ["AGENT_ENV", "PRELOAD", "VOLATILE_ENV", "close_inherited_pipe", "environment", "fork_server",
           "fork_server_pid", "fresh_random_state", "main_without_file", "socket_folder", "start_method",
           "stop_fork_server"]

#: Modules the server imports once, so that forked ranks have them. ``torch``: seconds.
#: ``torch._dynamo``: the first ``DistributedDataParallel(...)`` in a process imports it (with
#: sympy), 2.4-2.7 s per rank on a 2-core machine (measured: ``DDP(nn.Linear(2, 2))`` in a fresh
#: process with a gloo group, 2.67 s; 0.003 s with it preloaded). ``torchvision`` (the MNIST
#: data): 0.15 s once ``torch._dynamo`` is loaded. Only third-party libraries: this project's own
#: modules are imported by each rank, so an edit to ``helpers`` is seen by the next launch.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torchvision", "cloudpickle", "psutil")

#: Environment variables that change by themselves between calls (pytest sets the current test
#: name): a change in these is not "another environment" (see :func:`environment`).
VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})

#: The variables the elastic agent sets in every worker (``RANK``, ..., ``MASTER_ADDR``,
#: ``MASTER_PORT``). No rank reads the server's values of these: a launch's rank gets the agent's
#: (elastic's ``_wrap`` updates ``os.environ`` after the fork), :mod:`helpers.mp` clears them in
#: the rank and sets the caller's values of the moment of the call, and a warm rank's engine gets
#: the caller's whole environment of now (:mod:`helpers.engine.warm_ranks_forked`). So a change in
#: these alone keeps the server: the tutorials' cell that sets ``MASTER_ADDR``/``MASTER_PORT``
#: before ``spawn`` costs no fresh ``import torch``.
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
    """``os.environ`` as a sorted tuple of ``(name, value)``, without :data:`VOLATILE_ENV` (and the
    names in ``ignore``): what "the same environment" means for :func:`helpers.engine.start_ranks`;
    the fork server ignores :data:`AGENT_ENV` too.

    Also without ``TORCHINDUCTOR_CACHE_DIR`` when it holds torch's own default: ``import
    torch._dynamo`` (which ``DistributedDataParallel(...)`` triggers) writes that into
    ``os.environ`` (``torch/_inductor/runtime/cache_dir_utils.py``, ``cache_dir()``), and a fresh
    process computes the same value itself, so it is no change (seen in notebooks 01 and 06a: one
    more server, a fresh ``import torch``, per kernel).
    """
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
    """The folder of the server's socket (``pymp-*``, made now if need be; see
    :func:`_socket_folder_that_fits`), which a launch's reaper removes if this process is killed;
    ``None`` where the ranks are spawned."""
    if start_method() != "forkserver":
        return None
    with _lock:
        _socket_folder_that_fits()
        return util.get_temp_dir()


def _no_tracker_in_our_process_group() -> None:
    """Stop ``multiprocessing``'s resource tracker if it runs in this process's Unix process group,
    so that the server's start brings a new one up in a session of its own
    (:func:`_in_a_session_of_their_own`).

    A tracker started before the first launch by other code (plain ``torch.multiprocessing.spawn``
    in a cell, a ``multiprocessing.Queue``) is in the kernel's group: ipykernel's shutdown signals it
    (it ignores SIGTERM), the kernel does not exit by itself, jupyter_client SIGTERMs it and its exit
    hooks never run, so its ``pymp-*`` folder, the server's socket folder, stayed in the temp
    directory. The stopped tracker cleans up what was registered with it, as at any exit.
    """
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


#: pid -> the Popen of each process started by :func:`_in_a_session_of_their_own`, kept so that
#: subprocess never reaps them (multiprocessing waits for them) until :func:`_reaped` says so.
_STARTED: dict[int, subprocess.Popen] = {}


@contextlib.contextmanager
def _in_a_session_of_their_own():
    """While the block runs, the processes ``multiprocessing`` starts with ``util.spawnv_passfds``
    (the fork server, the resource tracker) start in a new session, hence a new Unix process group:
    ``subprocess.Popen`` with the same executable, arguments and passed descriptors, and
    ``start_new_session=True``. Used around ``forkserver.ensure_running``, under ``_lock`` (a
    process another thread starts with ``util.spawnv_passfds`` meanwhile gets the same)."""
    if os.name != "posix":
        yield
        return
    original = util.spawnv_passfds

    def spawnv_passfds(path, args, passfds):
        proc = subprocess.Popen(list(args), executable=path, pass_fds=tuple(sorted(map(int, passfds))),
                                close_fds=True, start_new_session=True)
        _STARTED[proc.pid] = proc
        return proc.pid

    util.spawnv_passfds = spawnv_passfds
    try:
        yield
    finally:
        util.spawnv_passfds = original


def _reaped(pid: int, exit_code: int) -> None:
    """``pid`` was reaped by ``os.waitpid`` (ours or multiprocessing's): give its Popen, if any,
    the exit code, so that it neither warns at exit that it is still running nor waits for a pid
    the system may have given to another process."""
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


@contextlib.contextmanager
def main_without_file():
    """While the block runs, the processes ``multiprocessing`` starts (forkserver or spawn) are not
    asked to re-run a main script that has no file (``init_main_from_path`` of ``<stdin>``, which
    fails in every one of them); a real file is re-run as before. Used around a launch, which runs
    one at a time per process."""
    original = spawn.get_preparation_data

    def get_preparation_data(name):
        data = original(name)
        path = data.get("init_main_from_path")
        if path is not None and not os.path.exists(path):
            del data["init_main_from_path"]
        return data

    spawn.get_preparation_data = get_preparation_data
    try:
        yield
    finally:
        spawn.get_preparation_data = original


class fork_server:
    """Context manager for one launch: ``with fork_server() as pid:`` starts (or restarts, after
    an environment change) the server and gives its pid, the parent of the ranks forked while
    the block runs; :func:`stop_fork_server` refuses during the block. ``pid`` is ``None`` when
    the launch must use ``spawn`` (:func:`start_method` says so). Used by
    :func:`helpers.engine.launch`, which runs one launch at a time per process.

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
    """At this process's normal exit: SIGKILL the fork server this process started and reap it,
    before multiprocessing's own exit hook removes the server's socket folder (``atexit`` runs
    hooks last-registered first; ``multiprocessing.util`` registered its hook on import, before
    this module's). A no-op in a process that did not start the running server (a rank, a plain
    ``os.fork`` child) and while a ``multiprocessing`` child of this process still runs (its exit
    hook joins it, and the server then exits by itself on end-of-file, as without this hook)."""
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
    """In a rank forked from the server: close the rank's copy of the pipe the server watches
    (every process forked from it gets one). Otherwise the server would not notice its parent's
    death while a rank lives, and the rank, whose parent-death signal watches the server, would
    not die either. A no-op in a ``spawn``-ed rank."""
    server = forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def fresh_random_state() -> None:
    """In a process forked from the server: seed the random generators it copied, as a fresh
    interpreter seeds them.

    A forked child inherits the server's generator states, so without this every rank of every
    launch (and every warm rank of every start) would draw the same numbers. A process started by
    ``torch.multiprocessing.spawn`` or torchrun seeds torch's CPU generator and numpy's global
    ``RandomState`` from the operating system; so does this (``torch.default_generator.seed()``,
    ``numpy.random.seed()``). Python's ``random`` reseeds itself after every fork
    (``os.register_at_fork`` in ``random.py``); it is seeded here again all the same. CUDA's
    generators are left alone: the server never initialises CUDA, so a rank creates them, freshly
    seeded, on first use. ``torch.manual_seed(s)`` in the rank's code then gives exactly what it
    gives under torchrun.
    """
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

"""Process plumbing, in one place: free ports and loopback-only stores, ending a process tree
(SIGTERM, a grace period, SIGKILL), the backend rule (``nccl`` with one CUDA GPU per rank, else
``gloo``), and the default group and entry point a ``launch`` worker uses under ``torchrun``."""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import platform
import socket
import time
from collections.abc import Callable, Iterable

import psutil

from helpers.engine.fork_server import fork_server_pid

__all__ = [
    "BACKENDS",
    "default_backend",
    "descendants",
    "end_processes",
    "free_port",
    "in_sessions",
    "init_process_group_from_env",
    "is_live",
    "leftover_children",
    "listen_on_loopback",
    "loopback_interface",
    "main_from_env",
    "resolve_backend",
    "tcp_store",
]

#: Backends the project accepts (``None`` chooses one with :func:`default_backend`).
BACKENDS = ("gloo", "nccl")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (bind port 0, release it; another process may take it before
    use). Prefer letting the listener bind port 0 itself where it can (``launch`` does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def loopback_interface(system: str | None = None) -> str:
    """The loopback interface's name on ``system`` (default: this machine's): ``"lo0"`` on macOS and the
    BSDs, else ``"lo"``; what ``GLOO_SOCKET_IFNAME`` names for a job on ``127.0.0.1``."""
    system = platform.system() if system is None else system
    return "lo0" if system in ("Darwin", "FreeBSD", "OpenBSD", "NetBSD") else "lo"


def tcp_store(host_name: str, port: int, world_size: int | None = None, is_master: bool = False, **kw):
    """``torch.distributed.TCPStore(host_name, port, world_size, is_master, **kw)``, whose server
    (``is_master``) listens on ``host_name``'s address only: torch's own binds every interface
    (``::``) unless given ``master_listen_fd``, a socket already bound (documented in TCPStore's
    docstring). ``port`` 0: the OS picks one (read ``.port``).

    Raises:
        torch.distributed.DistNetworkError: the port is taken there (``Address already in use``).
    """
    import torch.distributed as dist

    if is_master and kw.get("master_listen_fd") is None:
        family = socket.AF_INET6 if ":" in host_name else socket.AF_INET
        try:
            sock = socket.create_server((host_name, port), family=family)  # SO_REUSEADDR, as torch's
        except OSError as e:  # torch's error type and words for a failed bind, which its callers catch
            name = errno.errorcode.get(e.errno, "") if e.errno else ""
            raise dist.DistNetworkError(f"The server socket has failed to listen on {host_name}:{port}. "
                                        f"name: {name}, message: {e.strerror or e}") from None
        port, kw["master_listen_fd"] = sock.getsockname()[1], sock.detach()  # the store closes it
    return dist.TCPStore(host_name, port, world_size, is_master, **kw)


def listen_on_loopback() -> None:
    """In a rank of a run on this machine: gloo on the loopback interface (``GLOO_SOCKET_IFNAME``)
    and the store rank 0 opens in ``init_process_group`` (env:// or tcp://) through :func:`tcp_store`,
    so bound to ``MASTER_ADDR``'s address only (``localhost``: ``127.0.0.1``). torchrun's rank would
    listen on every interface; docs/OWN_CODE.md says what differs."""
    import importlib

    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()
    # the module (``torch.distributed.rendezvous`` as an attribute is the function of that name);
    # TCPStore is the name its _create_c10d_store calls
    importlib.import_module("torch.distributed.rendezvous").TCPStore = tcp_store


def _process(proc: int | psutil.Process) -> psutil.Process:
    """``proc`` as a ``psutil.Process`` (a pid is looked up now; raises ``psutil.NoSuchProcess``)."""
    return proc if isinstance(proc, psutil.Process) else psutil.Process(proc)


def descendants(proc: int | psutil.Process) -> list[psutil.Process]:
    """Every descendant of ``proc`` (a pid or a ``psutil.Process``: a reused pid counts as gone), read now;
    ``[]`` if it no longer exists or cannot be read."""
    try:
        return _process(proc).children(recursive=True)
    except psutil.Error:
        return []


def leftover_children() -> list[psutil.Process]:
    """This process's descendants, less the two that live as long as it does by design (the resource
    tracker, the fork server): what "no process left behind" checks."""
    server = fork_server_pid()
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.pid != server and "resource_tracker" not in " ".join(p.cmdline()):
                found.append(p)
    return found


def in_sessions(sids: set[int]) -> list[psutil.Process]:
    """The processes (other than this one) whose session id (``os.getsid``) is in ``sids``: what a
    session leader started, even once re-parented (a rank's ``subprocess`` or ``fork``)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(OSError):
            if p.pid != os.getpid() and os.getsid(p.pid) in sids:
                found.append(p)
    return found


def is_live(proc: int | psutil.Process) -> bool:
    """``True`` while ``proc`` (a pid or a ``psutil.Process``) runs: it exists and is not a zombie
    (a zombie has ended; only its exit status waits to be read). For a ``psutil.Process``, a pid
    reused by another process since that object was made counts as ended (psutil's start-time check)."""
    try:
        p = _process(proc)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait(procs: list, timeout: float) -> list:
    """Wait up to ``timeout`` seconds until none of ``procs`` runs (our own children are reaped;
    a zombie whose parent is another process counts as ended). Returns the ones still running."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if is_live(p)]
    while alive:
        _, alive = psutil.wait_procs(alive, timeout=max(0.0, min(0.1, deadline - time.monotonic())))
        alive = [p for p in alive if is_live(p)]
        if time.monotonic() >= deadline:
            break
    return alive


def end_processes(procs: Iterable[psutil.Process], grace_s: float = 3.0, *, terminate: bool = True,
                  timeout: float | None = None) -> list[psutil.Process]:
    """SIGTERM each of ``procs`` (``terminate=False``: SIGKILL at once), wait ``grace_s`` seconds, SIGKILL
    the rest in the order given, wait ``timeout`` (default ``grace_s``); the processes still running
    (normally none). psutil checks start times: a recycled pid is never signalled."""
    alive = [p for p in procs if is_live(p)]
    if terminate:
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.terminate()
                p.resume()  # SIGCONT: a stopped process (state T) acts on its SIGTERM only once continued
        alive = _wait(alive, grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return _wait(alive, grace_s if timeout is None else timeout)


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_backend(ranks_per_node: int) -> str:
    """The backend rule: ``"nccl"`` when CUDA has at least ``ranks_per_node`` GPUs (one per rank
    on this machine), else ``"gloo"`` (CPU)."""
    return "nccl" if _gpu_count() >= ranks_per_node else "gloo"


def resolve_backend(backend: str | None, world_size: int, error: type[Exception] = ValueError) -> str:
    """``backend`` checked for ``world_size`` ranks here (``None``: :func:`default_backend`).

    Raises:
        error (``ValueError`` unless given): unknown backend, or ``"nccl"`` without one GPU per rank.
    """
    if backend is None:
        return default_backend(world_size)
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise error(f"unknown backend {backend!r}; use one of {BACKENDS} or None to choose automatically.")
    backend = backend.lower()
    gpus = _gpu_count()
    if backend == "nccl" and gpus < world_size:
        raise error(
            f"backend 'nccl' needs one CUDA GPU per rank: world_size={world_size} but this machine has "
            f"{gpus} GPU(s). Use backend='gloo' (runs on CPU) or backend=None to choose automatically."
        )
    return backend


def init_process_group_from_env(backend: str | None = None, timeout_s: float | None = None) -> str:
    """Initialise the default group from torchrun's environment; the backend used. ``None``:
    :func:`default_backend` for ``LOCAL_WORLD_SIZE`` ranks; under nccl the GPU is ``cuda:<LOCAL_RANK>``."""
    import torch
    import torch.distributed as dist

    if backend is None:
        backend = default_backend(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    kw = {}
    if timeout_s is not None:
        kw["timeout"] = datetime.timedelta(seconds=max(1.0, float(timeout_s)))
    dist.init_process_group(backend=backend, **kw)
    return backend


def main_from_env(fn: Callable, *args, backend: str | None = None, **kwargs):
    """``fn(rank, world_size, *args, **kwargs)``'s result in a process started by ``torchrun``, inside a
    default group made from its environment: a ``launch`` worker unchanged on a cluster
    (``torchrun --standalone --nproc-per-node=2 -m helpers.some_module``)."""
    import torch.distributed as dist

    init_process_group_from_env(backend, None)
    try:
        return fn(dist.get_rank(), dist.get_world_size(), *args, **kwargs)
    finally:
        dist.destroy_process_group()

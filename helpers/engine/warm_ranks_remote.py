"""The process side of warm ranks (:mod:`helpers.engine.warm_ranks`): the options the controller and the ranks'
ipyparallel engines start with, what runs in each rank, how a rank's errors are read, and the watchdog that ends
the rank processes if the kernel dies.

Functions here are sent to the ranks by reference (every rank imports ``helpers``).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import re
import signal
import sys
import time
import types
from collections.abc import Callable

import ipyparallel as ipp
from traitlets.config import Config

from helpers.engine import processes as procs
from helpers.engine.errors import RESTART_NOTE, RanksTimeout  # noqa: F401 - remote.RanksTimeout, remote.RESTART_NOTE
from helpers.engine.launcher import WorkerError, worker_device
from helpers.engine.rank_output import CappedLines, rank_lines
from helpers.engine.start_method import with_hint

#: Controller options (ipyparallel/controller/): schedulers as threads; a heartbeat every 250 ms, not 3000 (the hub
#: registers an ipyparallel engine at a heartbeat: 2 up in 2.5 s, not 6 s, on 2 cores); 120 misses (30 s) = dead;
#: warnings and errors only in its log (traitlets spells the level WARN: WARNING is refused and it exits 1).
CONTROLLER_ARGS = ["--usethreads", "--HeartMonitor.period=250", "--HeartMonitor.max_heartmonitor_misses=120",
                    "--log-level=WARN"]
#: The ranks' ipyparallel engines too log warnings and errors only: what ipyparallel prints when one dies is then
#: its last words, not its log of every request. No KernelNanny (``IPEngine.enable_nanny``,
#: ipyparallel/engine/app.py): it is one more process per rank (about 1 CPU-s to start, measured) that relays
#: signals and reports an ipyparallel engine's exit to the hub; the rank processes are children of this kernel,
#: so :meth:`WarmRanks._supervise` signals their pids itself and finds a dead rank by its pid.
IPENGINE_ARGS = ["--log-level=WARN", "--IPEngine.enable_nanny=False"]


def ipengine_config(env: dict[str, str]) -> Config:
    """The ranks' ipyparallel engine launcher options: :data:`IPENGINE_ARGS`, and ``env`` (the caller's extra variables)
    in the environment each rank process starts with (``BaseLauncher.environment``,
    ipyparallel/cluster/launcher.py), so that they are set before anything is imported there."""
    return Config({"LocalEngineSetLauncher": {"engine_args": list(IPENGINE_ARGS), "environment": dict(env)}})

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

#: What the controller (or a rank's ipyparallel engine) prints when a port it had chosen was taken by another process
#: before it bound it: pyzmq's ``ZMQError: Address already in use (addr='tcp://127.0.0.1:PORT')``.
PORT_TAKEN = re.compile(r"Address already in use(?: \(addr='([^']*)'\))?")

#: The hint for torch's "trying to initialize the default process group twice!" on warm ranks.
INIT_TWICE_NOTE = ("warm ranks already have a default process group: `rank`, `world_size` and `dist` are ready "
                   "on every rank. Leave `dist.init_process_group(...)` (a tutorial's `setup()`) and "
                   "`dist.destroy_process_group()` (its `cleanup()`) out of code you run on them")

#: Errors that leave the process group unusable (a peer gone, a collective timed out).
GROUP_BROKEN = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
                 "timed out", "DistBackendError", "DistNetworkError", "NCCL")


# ----------------------------------------------------------------------------------------------
# in the ranks (sent by reference: every rank imports helpers)
# ----------------------------------------------------------------------------------------------

_STORE = None  # rank 0's TCPStore server, kept alive for the life of the group


def open_store(world_size: int, timeout_s: float) -> int:
    """Rank 0: open the group's TCPStore on 127.0.0.1 only, on a port the OS picks; return the port."""
    global _STORE

    _STORE = procs.tcp_store("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                       timeout=datetime.timedelta(seconds=timeout_s))
    return _STORE.port


def join_group(rank: int, world_size: int, backend: str, port: int, timeout_s: float, threads: int) -> str:
    """Every rank: set the torchrun variables, threads and device, join the default group."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME=procs.loopback_interface())
    import torch
    import torch.distributed as dist

    if threads and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = _STORE if rank == 0 else dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                                   timeout=datetime.timedelta(seconds=timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return str(worker_device())


def register_stacks(run_dir: str) -> None:
    """Every rank, once at start: dump its Python stacks to ``run_dir/stacks/<rank>.txt`` on SIGUSR1
    (:func:`helpers.engine.stacks.register`), so that a timed-out or interrupted call can say where
    each rank is stuck (:func:`helpers.engine.stacks.collect`)."""
    from helpers.engine import stacks

    stacks.register(run_dir, int(os.environ["RANK"]))


PRELUDE = (
    "import torch\n"
    "import torch.distributed as dist\n"
    "from helpers.engine.launcher import worker_device as _ddp_lab_device\n"
    "device = _ddp_lab_device()\n"
    "del _ddp_lab_device\n"
)


def call(fn, args, kwargs):
    """Every rank: ``(fn(rank, world_size, *args, **kwargs), whether the rank still has its default group)``.

    Raises:
        TypeError: the result holds what cannot be pickled back to the kernel (a generator, a
            lock, an open file, a socket), with the message ``launch`` gives for the same.
    """
    rank = int(os.environ["RANK"])
    result = fn(rank, int(os.environ["WORLD_SIZE"]), *args, **kwargs)
    check_result(rank, result)
    return result, has_group()


def check_result(rank: int, result) -> None:
    """Refuse a result that belongs to this process (:func:`helpers.engine.by_value`'s kinds, CUDA tensors
    aside: those pickle), before ipyparallel's pickler fails on it with a bare TypeError."""
    import cloudpickle

    from helpers.engine.by_value import unsendable

    for where, kind, value in unsendable("the result", result):
        if "tensor" in kind or "nn.Module" in kind:
            continue
        try:
            cloudpickle.dumps(value)
            continue
        except Exception as e:  # noqa: BLE001 - what pickling says, as launch reports it
            why = f"{type(e).__name__}: {e}"
        inside = "" if where == "the result" else f"{where} is {kind}; "
        raise TypeError(f"rank {rank} returned a {type(result).__name__} that cannot be pickled back to the "
                        f"caller ({inside}{why}); return plain data or CPU tensors.")


def has_group() -> bool:
    """Every rank: whether the default process group is still there (user code may destroy it)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def leave_group() -> None:
    """Every rank: destroy what is left of the default group, before :func:`open_store` and
    :func:`join_group` make a new one on the same ranks."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def call_payload(payload: bytes):
    """Every rank: :func:`call` of ``(fn, args, kwargs)`` from :func:`helpers.engine.by_value.serialise_call`'s
    payload (code sent by value keeps its cell's file name and lines, for the traceback)."""
    import cloudpickle

    fn, args, kwargs = cloudpickle.loads(payload)
    return call(fn, args, kwargs)


# ----------------------------------------------------------------------------------------------
# the watchdog: kills the rank processes and controller, and removes their folder, if the kernel dies without atexit
# ----------------------------------------------------------------------------------------------

WATCHDOG = r"""
import os, shutil, sys, time, psutil
parent, profile_dir, *also = int(sys.argv[1]), *sys.argv[2:]  # also: the fork server's socket folder
def ours(p):  # ipyparallel's environment names the folder; a forked rank (and its children) writes its output there
    return p.environ().get("IPP_PROFILE_DIR") == profile_dir or any(
        f.path.startswith(profile_dir + os.sep) for f in p.open_files())
while os.getppid() == parent:  # from the start's first moment until the kernel dies (we are re-parented)
    if not os.path.isdir(profile_dir):  # stopped
        sys.exit(0)
    time.sleep(0.5)
for _ in range(3):  # a process started as the kernel died is found on a later round
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and ours(p):
                for q in [p, *p.children(recursive=True)]:
                    q.kill()  # psutil refuses if the pid was reused by another process
        except psutil.Error:
            pass
    time.sleep(0.5)
for folder in (profile_dir, *also):  # ipyparallel's files (connection info, logs), the kernel's pymp-*
    shutil.rmtree(folder, ignore_errors=True)
"""


def worker_error(parts, rank: int) -> WorkerError:
    """Rank ``rank``'s failure in ``parts`` (one ipyparallel AsyncResult per rank) as a WorkerError."""
    try:
        parts[rank].get(0)
    except ipp.RemoteError as e:
        tb = e.traceback
        tb = ANSI.sub("", "\n".join(tb) if isinstance(tb, list) else (tb or ""))
        message = with_hint(ANSI.sub("", str(e.evalue)))
        if "cannot be pickled back to the caller" in message:
            tb = ""  # check_result's own frames: nothing of the learner's code
        elif "serialize_object" in tb and e.ename in ("TypeError", "PicklingError", "AttributeError"):
            # ipyparallel could not pickle the result: say so as launch does, without its frames
            message = (f"rank {rank} returned a value that cannot be pickled back to the caller "
                       f"({e.ename}: {message}); return plain data or CPU tensors.")
            tb = ""
        return WorkerError(rank, e.ename, message, tb)
    except Exception as e:  # noqa: BLE001 - e.g. an EngineError from the controller
        return WorkerError(rank, type(e).__name__, ANSI.sub("", str(e)), "")
    return WorkerError(rank, "unknown", "no error recorded", "")


def kernel_name_error(err: WorkerError, kernel_names) -> WorkerError | None:
    """``err`` (a ``%%px`` cell's) rewritten when it is a NameError for a name that exists in the
    kernel (``kernel_names``: the kernel's user namespace): say where the name lives and how to send
    it; ``None`` otherwise."""
    m = re.match(r"name '(\w+)' is not defined", err.message) if err.exc_type == "NameError" else None
    if m is None or m.group(1) not in kernel_names:
        return None
    name = m.group(1)
    message = (f"name {name!r} is not defined on the ranks. `{name}` is a variable of this notebook's kernel; "
               f"a %%px cell runs on the ranks, which have their own variables. Send it to every rank first: "
               f"ranks.push({{{name!r}: {name}}})")
    return WorkerError(err.rank, "NameError", message, err.traceback, err.other_ranks)


def interrupt(pids: list[int]) -> None:
    """Send SIGINT to each rank process in ``pids``, what "interrupt kernel" does to a kernel (an ipyparallel
    engine without a KernelNanny, see :data:`IPENGINE_ARGS`, is signalled directly); a pid already gone is skipped."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGINT)


def exit_description(cluster, pid: int) -> str:
    """How rank process ``pid`` of ``cluster`` (an ``ipp.Cluster``) ended: "killed by SIGKILL", "exited with code 0"."""
    code = None
    deadline = time.monotonic() + 3.0  # ipyparallel's waiter thread reaps the rank process (slow on busy cores)
    while code is None and time.monotonic() < deadline and cluster is not None:
        for es in cluster.engines.values():
            for el in es.launchers.values():  # still listed: psutil caches what wait() reaped
                got = getattr(el.process, "_exitcode", None)
                if el.pid == pid and isinstance(got, int):
                    code = got
            for data in (es.stop_data or {}).get("engines", {}).values():  # already noticed
                if data.get("pid") == pid and isinstance(data.get("exit_code"), int):
                    code = data["exit_code"]
        if code is None:
            time.sleep(0.05)
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    if code is not None:
        return f"exited with code {code}"
    return "exited"


def stream_per_rank(ar) -> Callable[[], None]:
    """Make ``ar.stream_output()`` (``ar``: a ``%%px`` cell's AsyncResult) keep one display per rank;
    return a function that, once streaming ended, rewrites the displays with the output in rank order.

    ipyparallel 9 ids each rank's display by the ``msg_id`` of the iopub message's ``parent_header``,
    and replays output received before ``stream_output()`` without one: every replay got the same id,
    and ``[stdout:1]`` replaced ``[stdout:0]``. Here each replay gets its rank's ``msg_id``. A rank's
    error is left to the cell's ``WorkerError`` (reported once)."""
    callback = ar._iopub_streaming_output_callback  # ipyparallel/client/asyncresult.py
    shown: dict[str, tuple] = {}  # display id -> (rank, stream name, msg future), in order of creation
    output = RankOutput(ar, texts={})  # each rank's streams capped, as ranks.run shows them
    sent: dict[tuple[int, str], int] = {}  # outside a kernel: characters of each capped text printed

    def unsent(eid: int, name: str) -> str:
        text = output.texts[(eid, name)].getvalue() if (eid, name) in output.texts else ""
        start, sent[(eid, name)] = sent.get((eid, name), 0), len(text)
        return text[start:]

    def with_parent(eid, msg_future, msg):
        if msg["header"]["msg_type"] == "error":
            return  # a rank's error is shown once, in the WorkerError the cell raises, not per rank here too
        if not msg.get("parent_header"):
            msg = {**msg, "parent_header": {"msg_id": msg_future.msg_id}}
        if msg["header"]["msg_type"] == "stream":  # the display id ipyparallel's callback gives it
            name = msg["content"]["name"]
            shown.setdefault(f"{msg['parent_header'].get('msg_id', '')}-{name}", (eid, name, msg_future))
            output.poll()
            if not _in_kernel():  # ipyparallel prints the message's text: the capped text's new lines instead
                msg = {**msg, "content": {**msg["content"], "text": unsent(eid, name)}}
            elif getattr(output.capped.get((eid, name)), "file", None) is not None:  # past the cap: the capped text
                md = {**msg_future.output.metadata, name: output.texts[(eid, name)].getvalue()}
                msg_future = types.SimpleNamespace(output=types.SimpleNamespace(metadata=md))
        return callback(eid, msg_future, msg)

    def in_rank_order() -> None:
        from IPython.display import publish_display_data

        capped = cap_streams(ar, output)
        if not _in_kernel():  # ipyparallel printed the streams: what is left of each (a last line, the tail)
            for eid, name in sorted(output.texts):
                ar._display_stream(unsent(eid, name), f"[{name}:{eid}] ", file=getattr(sys, name))
            return
        wanted = sorted(shown.values(), key=lambda s: (s[0], s[1] != "stdout"))
        for display_id, now, (eid, name, msg_future) in zip(list(shown), list(shown.values()), wanted):
            if now != (eid, name, msg_future) or (eid, name) in capped:
                publish_display_data({"text/plain": f"[{name}:{eid}] " + msg_future.output.metadata[name]},
                                     transient={"display_id": display_id}, update=True)

    ar._iopub_streaming_output_callback = with_parent
    return in_rank_order


def _in_kernel() -> bool:
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None) is not None


def kernel_namespace() -> dict:
    """The calling IPython session's user namespace (the notebook's variables), or ``{}``."""
    from IPython import get_ipython

    ip = get_ipython()
    return ip.user_ns if ip is not None else {}


class RankOutput:
    """What the ranks of ``ar`` (the ipyparallel AsyncResult of a :meth:`WarmRanks.run` call) write,
    relayed into the caller's streams as :func:`helpers.engine.launch` relays its ranks' output
    (:func:`helpers.engine.rank_output.rank_lines`): line by line, prefixed ``[rank r]``, stdout to
    ``sys.stdout``, stderr to ``sys.stderr``, capped as there (:class:`CappedLines`). :meth:`poll`
    prints the whole lines that arrived since the last call (the ranks' streams grow as ipyparallel
    receives them); ``final=True`` also prints an unfinished last line and the capped streams' ends.
    ``texts``: a dict that gets each stream's capped text, unprefixed, instead (a ``%%px`` cell's)."""

    def __init__(self, ar, texts: dict | None = None):
        self.ar, self.texts = ar, texts
        self.printed: dict[tuple[int, str], int] = {}  # (rank, stream name) -> characters printed
        self.capped: dict[tuple[int, str], CappedLines] = {}

    def poll(self, final: bool = False) -> None:
        texts = self.texts
        for rank, child in sorted(zip(self.ar._targets, self.ar._children), key=lambda rc: rc[0]):
            for name in ("stdout", "stderr"):
                text = child.output.metadata[name]
                start, self.printed[(rank, name)] = self.printed.get((rank, name), 0), len(text)
                out = getattr(sys, name) if texts is None else texts.setdefault((rank, name), io.StringIO())
                capped = CappedLines(rank, name, out, ends="call" if texts is None else "cell",
                                     fmt=rank_lines if texts is None else _plain_lines)
                self.capped.setdefault((rank, name), capped).feed(text[start:])
        for key in sorted(self.capped) if final else ():
            self.capped[key].feed("", final=True)


def _plain_lines(rank: int, lines: list[str]) -> str:
    return "".join(f"{line}\n" for line in lines)


def cap_streams(ar, output: RankOutput | None = None) -> set[tuple[int, str]]:
    """Once ``ar`` (a ``%%px`` cell's AsyncResult) ended: each rank's stream in its metadata (what
    ipyparallel shows), when past :class:`CappedLines`' cap, replaced by its capped text; returns
    the ``(rank, stream name)`` replaced."""
    output = output or RankOutput(ar, texts={})
    output.poll(final=True)
    capped = {key for key, c in output.capped.items() if c.file is not None}
    for rank, child in zip(ar._targets, ar._children):
        for name in ("stdout", "stderr"):
            if (rank, name) in capped:
                child.output.metadata[name] = output.texts[(rank, name)].getvalue()
    return capped


def display_in_rank_order(ar) -> None:
    """Show what each rank of ``ar`` (a ``%%px`` cell's AsyncResult, not streamed) printed, rank 0
    first: ipyparallel's ``display_outputs(groupby="engine")``, which refuses a result not ready
    (a timeout, an interrupt), so then each rank's stdout and stderr so far."""
    cap_streams(ar)
    if ar.ready():
        ar.display_outputs(groupby="engine")
        return
    for eid, child in zip(ar._targets, ar._children):
        for name in ("stdout", "stderr"):
            ar._display_stream(child.output.metadata[name], f"[{name}:{eid}] ", file=getattr(sys, name))

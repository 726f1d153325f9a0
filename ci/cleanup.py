"""Clean-up after a notebook: find and end every process a notebook's kernel started.

When a cell is cut short (timeout, interrupt) the kernel's whole process tree (e.g. DDP workers)
is killed before papermill shuts the kernel down; after shutdown, any process that was seen in
the kernel's tree, or that is still a descendant of the runner (on Linux the runner is a "child
subreaper" while it runs, so orphaned grandchildren are re-parented to it and found), is given
a few seconds to exit, then killed (:func:`helpers.engine.internal.end_processes`). Used by
:mod:`ci.execution`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import psutil
from jupyter_client.manager import AsyncKernelManager

from helpers.checkout import pythonpath_first
from helpers.engine.internal import descendants, end_processes, is_live, is_reaper
from helpers.ipc_kernel import ipc_kernel_manager

#: Pass to ``papermill.execute_notebook(..., kernel_manager_class=IPCKernelManager)``.
IPCKernelManager = ipc_kernel_manager(AsyncKernelManager)


def _proc_key(p) -> tuple[int, float]:
    try:
        return (p.pid, p.create_time())
    except Exception:  # noqa: BLE001 - gone or inaccessible
        return (p.pid, -1.0)


def describe(p) -> str:
    """``pid N (command line)`` of a psutil.Process, for error messages."""
    try:
        cmd = " ".join(p.cmdline()) or p.name()
    except Exception:  # noqa: BLE001
        cmd = "?"
    return f"pid {p.pid} ({cmd if len(cmd) <= 120 else cmd[:117] + '...'})"


def _reap_zombie_children() -> None:
    """Reap re-parented orphans that died (they are our children while we are a subreaper)."""
    me = psutil.Process()
    for child in descendants(me):
        try:
            if child.ppid() == me.pid and child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError, OSError):
            pass


def _wait_gone(procs: list, timeout: float) -> list:
    """Wait until none of ``procs`` is running (a zombie counts as gone); returns the rest."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if is_live(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        _reap_zombie_children()
        alive = [p for p in alive if is_live(p)]
    _reap_zombie_children()
    return alive


def kill_all(procs: list, timeout: float = 5.0) -> list:
    """SIGKILL ``procs`` (parents before children, the order given) and wait; returns survivors.

    The killing is :func:`helpers.engine.internal.end_processes` (the one process-tree ender); then the
    orphans this subreaper adopted while their parents died are reaped."""
    survivors = end_processes(procs, terminate=False, timeout=timeout)
    _reap_zombie_children()
    return survivors


@contextlib.contextmanager
def child_subreaper() -> Iterator[bool]:
    """On Linux, make this process adopt orphaned descendants while the block runs."""
    if not sys.platform.startswith("linux"):
        yield False
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        previous = ctypes.c_int(0)
        libc.prctl(37, ctypes.byref(previous), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
        enabled = libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        yield False
        return
    try:
        yield enabled
    finally:
        if enabled and not previous.value:
            libc.prctl(36, 0, 0, 0, 0)


@dataclass
class Watch:
    """Per-notebook state shared by the papermill hooks and the kernel manager."""

    baseline: set = field(default_factory=set)
    kernel: Any = None
    seen: dict = field(default_factory=dict)
    current_cell: int | None = None  # index (in the executed notebook) of a running cell
    last_cell_started: int | None = None
    t_first_cell: float | None = None
    t_last_cell_done: float | None = None
    killed_on_abort: list[str] = field(default_factory=list)

    @classmethod
    def start(cls) -> "Watch":
        me = psutil.Process()
        return cls(baseline={_proc_key(p) for p in descendants(me)})

    def set_kernel(self, pid: int | None) -> None:
        if pid:
            with contextlib.suppress(psutil.Error):
                self.kernel = psutil.Process(pid)

    def snapshot_kernel_tree(self) -> list:
        if self.kernel is None:
            return []
        tree = descendants(self.kernel)
        for p in tree:
            self.seen.setdefault(_proc_key(p), p)
        return tree

    def kill_kernel_tree(self) -> None:
        """SIGKILL the kernel's descendants (not the kernel). A launch's run-folder reaper is spared:
        it removes the folder once the kernel is gone (:func:`helpers.engine.run_dir.run_folder`), which a
        kernel killed mid-launch never does itself; it counts as left behind if it is still there
        after the leftover grace."""
        tree = [p for p in self.snapshot_kernel_tree() if is_live(p) and not is_reaper(p)]
        if tree:
            self.killed_on_abort.extend(describe(p) for p in tree)
            kill_all(tree)

    # nbclient hooks (called with keyword arguments)
    def on_cell_start(self, cell=None, cell_index=None, **_: Any) -> None:
        if self.t_first_cell is None:
            self.t_first_cell = time.monotonic()

    def on_cell_execute(self, cell=None, cell_index=None, **_: Any) -> None:
        self.current_cell = cell_index
        self.last_cell_started = cell_index

    def on_cell_executed(self, cell=None, cell_index=None, **_: Any) -> None:
        self.current_cell = None
        self.t_last_cell_done = time.monotonic()
        self.snapshot_kernel_tree()

    def leftovers(self, grace: float) -> list:
        """Processes started during this notebook that are still running after ``grace``."""
        _reap_zombie_children()
        candidates = {k: p for p in descendants(psutil.Process()) if (k := _proc_key(p)) not in self.baseline}
        for key, p in self.seen.items():
            candidates.setdefault(key, p)
        if self.kernel is not None:
            candidates.setdefault(_proc_key(self.kernel), self.kernel)
        return _wait_gone(list(candidates.values()), grace)


def kernel_manager_class(watch: Watch):
    """An :class:`IPCKernelManager` that records the kernel pid and, when a cell was cut short, kills
    the kernel's process tree (DDP workers included) before shutting the kernel down. The kernel
    imports this copy's ``helpers`` (its root first on ``PYTHONPATH``), whatever the Python has installed."""

    class TreeKillingKernelManager(IPCKernelManager):
        async def start_kernel(self, **kw: Any) -> None:
            kw["env"] = pythonpath_first(Path(__file__).resolve().parent.parent, kw.get("env") or os.environ)
            await super().start_kernel(**kw)
            prov = self.provisioner
            pid = getattr(prov, "pid", None) or getattr(getattr(prov, "process", None), "pid", None)
            watch.set_kernel(pid)

        async def shutdown_kernel(self, now: bool = False, restart: bool = False) -> None:
            if not restart:
                watch.snapshot_kernel_tree()
                if watch.current_cell is not None:
                    # A cell never finished (timeout / interrupt): its workers may be blocked
                    # in a collective; kill them first, then the kernel without a grace period.
                    watch.kill_kernel_tree()
                    now = True
            await super().shutdown_kernel(now=now, restart=restart)

    return TreeKillingKernelManager


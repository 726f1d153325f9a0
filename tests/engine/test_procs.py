"""helpers.engine.processes: the one home of process plumbing (free ports, ending process trees, the backend
rule). Real processes and sockets."""

import os
import signal
import socket
import subprocess
import sys

import psutil
import pytest
import torch

from helpers.engine import processes as procs

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(120)]


def test_free_port_is_bindable():
    port = procs.free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("system,name", [("Linux", "lo"), ("Darwin", "lo0"), ("FreeBSD", "lo0")])
def test_loopback_interface_per_platform(system, name):
    assert procs.loopback_interface(system) == name


def test_loopback_interface_exists_here_and_holds_127_0_0_1():
    """The name for this machine is one of its interfaces, with 127.0.0.1 on it (what gloo needs
    of ``GLOO_SOCKET_IFNAME`` for a job on loopback)."""
    addrs = psutil.net_if_addrs()
    name = procs.loopback_interface()
    assert name in addrs, f"{name!r} is not an interface here: {sorted(addrs)}"
    assert "127.0.0.1" in {a.address for a in addrs[name]}, addrs[name]


def _child(ignore_term: bool) -> psutil.Process:
    code = ("import signal, sys, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
            + "print('ready', flush=True)\ntime.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.stdout.close()
    return psutil.Process(p.pid)


def _exit_status(p: psutil.Process) -> int:
    """How an ended child of this process ended: end_processes reaped it (psutil.wait_procs sets
    ``returncode``) or it is a zombie, reaped here. A signal ``S`` gives ``-S``."""
    code = getattr(p, "returncode", None)
    return int(p.wait(timeout=10)) if code is None else int(code)


def test_end_processes_terminates_then_kills():
    polite, stubborn = _child(False), _child(True)
    assert procs.end_processes([polite, stubborn], grace_s=1.0) == []
    # the exit statuses say which signal ended each: SIGTERM first (the polite one ended on it);
    # the stubborn one ignored it and needed the SIGKILL after the grace period
    assert (_exit_status(polite), _exit_status(stubborn)) == (-signal.SIGTERM, -signal.SIGKILL)


def test_end_processes_kill_at_once_and_already_gone():
    p = _child(False)
    assert procs.end_processes([p], terminate=False, timeout=5) == []
    assert _exit_status(p) == -signal.SIGKILL  # terminate=False: no SIGTERM first
    assert procs.end_processes([p]) == []  # already ended: nothing to do, no error


def test_descendants_lists_children_and_grandchildren():
    code = ("import subprocess, sys\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "print(c.pid, flush=True)\nc.wait()\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    handle = psutil.Process(p.pid)
    try:
        grandchild = int(p.stdout.readline())
        assert {c.pid for c in procs.descendants(p.pid)} == {grandchild}
        assert {c.pid for c in procs.descendants(handle)} == {grandchild}  # a psutil.Process too
        assert procs.is_live(p.pid) and procs.is_live(handle)
        assert {p.pid, grandchild} <= {c.pid for c in procs.descendants(os.getpid())}  # recursive
    finally:
        assert procs.end_processes([psutil.Process(p.pid), *procs.descendants(p.pid)], grace_s=3.0) == []
        p.stdout.close()
        p.wait(timeout=10)
    assert procs.descendants(p.pid) == []  # gone: an empty list, no error
    assert procs.descendants(handle) == []
    assert not procs.is_live(p.pid) and not procs.is_live(handle) and not procs.is_live(grandchild)


def test_backend_rule():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert procs.default_backend(1) == ("nccl" if gpus >= 1 else "gloo")
    assert procs.resolve_backend(None, 2) == ("nccl" if gpus >= 2 else "gloo")
    assert procs.resolve_backend("GLOO", 2) == "gloo"
    with pytest.raises(ValueError, match="unknown backend"):
        procs.resolve_backend("mpi", 2)
    if gpus < 64:
        with pytest.raises(KeyError, match="nccl"):
            procs.resolve_backend("nccl", 64, error=KeyError)

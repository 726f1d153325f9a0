"""The fork server launch() forks its ranks from (helpers.engine.fork_server): who the ranks' parent is,
that they see the caller's environment of now, that the server lives and dies with its caller,
and that the spawn fallback still runs. Real processes, real gloo groups."""

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from _support import REPO_ROOT
from helpers.engine import fork_server as fs
from helpers.engine import launch
from helpers.engine.processes import is_live

# slow: real processes in (nearly) every test
pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(180), pytest.mark.slow]

PROBE = "DDP_LAB_FORK_SERVER_PROBE"


def _parent_and_probe(rank, world_size):
    import os

    import torch
    return {"ppid": os.getppid(), "probe": os.environ.get(PROBE), "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS")}


@pytest.mark.matrix
@pytest.mark.skipif(fs.start_method() != "forkserver", reason="no forkserver start method here")
@pytest.mark.skipif(sys.platform != "linux", reason="reads the server's /proc/<pid>/maps, which only Linux has")
def test_ranks_are_forked_from_one_server_that_is_our_child():
    got = launch(_parent_and_probe, 2)
    server = fs.fork_server_pid()
    assert server is not None and {g["ppid"] for g in got} == {server}
    proc = psutil.Process(server)
    assert proc.ppid() == os.getpid()
    assert "multiprocessing.forkserver" in " ".join(proc.cmdline())
    with open(f"/proc/{server}/maps") as maps:
        assert "libtorch" in maps.read(), "the server must have imported torch"
    assert launch(_parent_and_probe, 2)[0]["ppid"] == server, "an unchanged environment reuses the server"


def _main_has_caller_only(rank, world_size):
    import sys
    return hasattr(sys.modules["__main__"], "caller_only")


@pytest.mark.skipif(fs.start_method() != "forkserver", reason="no forkserver start method here")
def test_ranks_have_none_of_the_callers_main_names(monkeypatch):
    """A notebook cell's names live in the kernel's ``__main__``; ranks forked from the server, which
    never ran the caller's code, do not have them (a fork of the caller would)."""
    import __main__
    monkeypatch.setattr(__main__, "caller_only", "defined by the caller", raising=False)
    assert launch(_main_has_caller_only, 2) == [False, False]


@pytest.mark.skipif(fs.start_method() != "forkserver", reason="no forkserver start method here")
def test_ranks_see_the_environment_of_now(monkeypatch):
    """A variable set (or removed) after the server started reaches the next launch's ranks,
    through a restarted server; OMP_NUM_THREADS too, which OpenMP reads once, when torch loads."""
    monkeypatch.setenv(PROBE, "set before")
    first = launch(_parent_and_probe, 2)
    assert {g["probe"] for g in first} == {"set before"}
    monkeypatch.delenv(PROBE)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    second = launch(_parent_and_probe, 2)
    assert {(g["probe"], g["omp"], g["threads"]) for g in second} == {(None, "1", 1)}, second
    assert second[0]["ppid"] != first[0]["ppid"], "a changed environment must restart the server"


def _master_and_parent(i, *rest):
    import os
    return os.getppid(), os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")


@pytest.mark.skipif(fs.start_method() != "forkserver", reason="no forkserver start method here")
def test_master_address_and_port_set_after_the_server_started_keep_it(monkeypatch):
    """The tutorials' cell sets MASTER_ADDR/MASTER_PORT before spawn: the agent's variables are set
    anew in every rank, so that change needs no fresh server (no second ``import torch``), and each
    rank still sees what it would have: the caller's values of now under helpers.mp, the agent's
    under launch."""
    import helpers.mp as mp
    from helpers.engine import free_port

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    server = launch(_parent_and_probe, 1)[0]["ppid"]
    for port in (str(free_port()), str(free_port())):
        monkeypatch.setenv("MASTER_ADDR", "localhost")
        monkeypatch.setenv("MASTER_PORT", port)
        assert mp.spawn(_master_and_parent, nprocs=2) == [(server, "localhost", port)] * 2
        got = launch(_master_and_parent, 2)  # the agent's address (127.0.0.1) and port
        assert {g[0] for g in got} == {server} and {g[1] for g in got} == {"127.0.0.1"}, got
    monkeypatch.setenv(PROBE, "any other variable")
    assert launch(_parent_and_probe, 1)[0]["ppid"] != server, "any other change restarts the server"


def test_spawn_fallback_runs(monkeypatch):
    """Where forkserver is unavailable, every rank is spawned by the launching process itself."""
    monkeypatch.setattr(fs, "start_method", lambda: "spawn")
    got = launch(_parent_and_probe, 2)
    assert {g["ppid"] for g in got} == {os.getpid()}


@pytest.mark.skipif(fs.start_method() != "forkserver", reason="no forkserver start method here")
def test_a_server_killed_by_someone_else_is_replaced_and_stop_ends_it():
    launch(_parent_and_probe, 1)
    server = psutil.Process(fs.fork_server_pid())
    server.send_signal(signal.SIGKILL)  # e.g. a clean-up script that ends every python process
    server.wait(10)  # reaped here, as psutil.wait_procs would: Python's own ensure_running then fails
    assert launch(_parent_and_probe, 2)[0]["ppid"] not in (None, server.pid)
    replacement = fs.fork_server_pid()
    assert fs.stop_fork_server() is True and not psutil.pid_exists(replacement)
    assert fs.stop_fork_server() is False and fs.fork_server_pid() is None


@pytest.mark.skipif(fs.start_method() != "forkserver", reason="no forkserver start method here")
def test_server_ends_when_its_process_exits():
    """... and, in the same fresh process, the variable torch writes into os.environ by itself
    (``import torch._dynamo``, which DDP's constructor does, sets TORCHINDUCTOR_CACHE_DIR to its
    default) does not count as a changed environment: the next launch reuses the server."""
    code = textwrap.dedent("""
        import os
        from helpers.engine.fork_server import fork_server_pid
        from helpers.engine import launch
        if __name__ == "__main__":
            launch(lambda rank, world_size: rank, 2)
            first = fork_server_pid()
            before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            import torch._dynamo
            after = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            launch(lambda rank, world_size: rank, 2)
            print("SERVER", fork_server_pid(), first, before, after, flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=120, env={**env, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    pid, first, before, after = out.stdout.split("SERVER")[1].split()
    assert before == "None" and after != "None", "import torch._dynamo should have set TORCHINDUCTOR_CACHE_DIR"
    assert pid == first, "torch's own TORCHINDUCTOR_CACHE_DIR default must not restart the server"
    pid = int(pid)
    try:
        psutil.Process(pid).wait(15)
    except psutil.NoSuchProcess:
        pass
    assert not is_live(pid)


def test_socket_dir_falls_back_where_the_temp_directory_is_too_long(monkeypatch):
    """A temp directory that leaves room for the socket's name is used as it is; one that does not
    is replaced by a system temp folder, which does. In a folder of /tmp: short, whatever TMPDIR is."""
    import tempfile

    from helpers.engine.socket_folder import SUN_PATH_MAX, SYSTEM_TEMP_DIRS, socket_dir

    with tempfile.TemporaryDirectory(dir=SYSTEM_TEMP_DIRS[0]) as short:
        monkeypatch.setattr("tempfile.tempdir", short)
        assert socket_dir(10) == short
        long_dir = os.path.join(short, "t" * (SUN_PATH_MAX - len(short)))
        os.mkdir(long_dir)
        monkeypatch.setattr("tempfile.tempdir", long_dir)
        got = socket_dir(10)
        assert got != long_dir and len(got) + 1 + 10 < SUN_PATH_MAX and os.access(got, os.W_OK)


@pytest.mark.matrix
@pytest.mark.skipif(fs.start_method() != "forkserver", reason="no forkserver start method here")
def test_a_temp_directory_too_long_for_a_socket_still_starts_the_server(tmp_path):
    """Python 3.10-3.12 bind the server's socket at <TMPDIR>/pymp-XXXXXXXX/listener-XXXXXXXX and
    fail with "AF_UNIX path too long" when TMPDIR is long (a cluster job's scratch folder): the
    server starts, its socket folder is a short one, and it is removed when the process exits. A
    fresh process (its multiprocessing temp folder is chosen once per process); no preloaded
    modules, so the check costs no ``import torch``."""
    from helpers.engine.socket_folder import SUN_PATH_MAX

    long_tmp = tmp_path / ("t" * max(1, SUN_PATH_MAX - len(str(tmp_path)) - 20))
    long_tmp.mkdir()
    code = textwrap.dedent("""
        import multiprocessing, os
        from helpers.engine import fork_server as fs
        fs.PRELOAD = ()
        with fs.fork_server():
            rank = multiprocessing.get_context("forkserver").Process(target=os.getpid)
            rank.start()
            rank.join(60)
        print("RESULT", rank.exitcode, multiprocessing.util.get_temp_dir(), flush=True)
        fs.stop_fork_server()
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(long_tmp), "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    exitcode, folder = out.stdout.split("RESULT")[1].split()
    assert exitcode == "0", "the process forked from the server should have run"
    assert not folder.startswith(str(long_tmp)) and len(folder) + len("/listener-12345678") < SUN_PATH_MAX
    assert not os.path.exists(folder), "the socket folder should be removed when its process exits"
    assert not list(long_tmp.iterdir())


@pytest.mark.skipif(fs.start_method() != "forkserver", reason="no forkserver start method here")
def test_a_kernel_that_started_the_server_shuts_down_by_itself(tmp_path, monkeypatch):
    """ipykernel answers a shutdown request by signalling every child in its own Unix process group
    until none is left, zombies included; a fork server it SIGTERMed stayed a zombie and the
    resource tracker ignores SIGTERM, so jupyter_client SIGTERMed the kernel before its atexit
    hooks ran, and its ``pymp-*`` folder stayed in the temp directory. Now the server and the
    tracker are in a session (so a Unix process group) of their own: ipykernel finds nothing to signal, and the
    kernel, given the time jupyter_client gives it (here 20 s before SIGTERM, its default 2.5 s
    being short for a busy machine), exits by itself, having SIGKILLed and reaped the server
    (which would otherwise outlive it by the seconds torch takes to tear down) and removed the
    server's socket folder. The server preloads only a module whose exit takes 60 s (an atexit
    sleep, standing in for torch's teardown on a busy machine): no ``import torch``."""
    import uuid

    from _support import Kernel

    kernel_tmp = tmp_path / "tmp"
    kernel_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(kernel_tmp))
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "ddp_lab_slow_exit.py").write_text("import atexit, time\natexit.register(time.sleep, 60)\n")
    k = Kernel(uuid.uuid4().hex)
    k.km.shutdown_wait_time = 20.0
    server = None
    try:
        reply, out = k.cell(textwrap.dedent("""
            import multiprocessing.resource_tracker as rt
            import os, psutil
            from multiprocessing import forkserver
            import sys
            from helpers.engine import fork_server as fs
            sys.path.insert(0, MODULES)
            fs.PRELOAD = ("ddp_lab_slow_exit",)
            with fs.fork_server() as server:
                pass
            # what ipykernel would signal at shutdown: children in the kernel's Unix process group
            mine = [c.pid for c in psutil.Process().children(recursive=True) if os.getpgid(c.pid) == os.getpgrp()]
            print("SIGNALLED", mine, "TRACKER", os.getpgid(rt._resource_tracker._pid) != os.getpgrp())
            print("SERVER", server, "FOLDER", os.path.dirname(forkserver._forkserver._forkserver_address))
        """).replace("MODULES", repr(str(modules))))
        assert reply["status"] == "ok", out
        assert "SIGNALLED [] TRACKER True" in out, out
        words = out.split()
        server, folder = int(words[words.index("SERVER") + 1]), words[words.index("FOLDER") + 1]
        assert os.path.isdir(folder) and os.path.basename(folder).startswith("pymp-"), folder
        pid, process = k.pid, k.km.provisioner.process
        k.close()  # jupyter_client's graceful shutdown: request, wait 20 s, then SIGTERM
        assert not is_live(pid)
        assert process.wait(5) == 0, f"the kernel did not exit by itself (exit code {process.returncode})"
        assert not psutil.pid_exists(server), "the fork server outlived its kernel"
        assert not os.path.exists(folder), "the kernel's atexit hooks should have removed the server's socket folder"
        assert not [p.name for p in kernel_tmp.iterdir() if p.name.startswith("pymp-")]
    finally:
        if k.km.has_kernel:
            k.km.shutdown_kernel(now=True)
        if server is not None and psutil.pid_exists(server):  # this test failed: leave nothing
            psutil.Process(server).kill()


@pytest.mark.skipif(fs.start_method() != "forkserver", reason="no forkserver start method here")
def test_a_kernel_that_used_plain_spawn_before_launching_shuts_down_by_itself(tmp_path, monkeypatch):
    """Plain ``torch.multiprocessing.spawn`` in a cell starts multiprocessing's resource tracker in
    the kernel's own process group; ipykernel's shutdown then signalled it (it ignores SIGTERM), the
    kernel did not exit by itself, jupyter_client SIGTERMed it and its exit hooks never ran, so a
    later launch's ``pymp-*`` folder (the fork server's socket) stayed in the temp directory. Now the
    server's start moves the tracker into a session of its own (a new tracker). The folder is in the
    kernel's TMPDIR, or in /tmp where a socket path there would be too long (a long ``TMPDIR``)."""
    import uuid

    from _support import Kernel

    kernel_tmp = tmp_path / "tmp"
    kernel_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(kernel_tmp))
    k = Kernel(uuid.uuid4().hex)
    k.km.shutdown_wait_time = 20.0  # what a busy machine needs, as in the test above
    try:
        reply, out = k.cell(textwrap.dedent("""
            import torch.multiprocessing
            from helpers.engine import launch
            torch.multiprocessing.spawn(print, nprocs=2)   # an importable function: plain spawn runs it
            print("launched", launch(lambda rank, world_size: rank, 2))
            from multiprocessing import forkserver
            print("FOLDER", __import__("os").path.dirname(forkserver._forkserver._forkserver_address))
        """), timeout=240)
        assert reply["status"] == "ok" and "launched [0, 1]" in out, out
        folder = out.split("FOLDER")[1].split()[0]
        assert os.path.basename(folder).startswith("pymp-") and os.path.isdir(folder), folder
        process = k.km.provisioner.process
        k.close()  # jupyter_client's graceful shutdown: request, wait 20 s, then SIGTERM
        assert process.wait(5) == 0, f"the kernel did not exit by itself (exit code {process.returncode})"
        assert not os.path.exists(folder), "the kernel's exit hooks should have removed the server's socket folder"
        assert not [p.name for p in kernel_tmp.iterdir() if p.name.startswith("pymp-")]
    finally:
        if k.km.has_kernel:
            k.km.shutdown_kernel(now=True)

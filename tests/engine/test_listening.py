"""Nothing the course starts on one machine listens beyond loopback (issue 50): the sockets this
process and its descendants listen on, sampled (psutil) all through a launch, helpers.mp.spawn of
the DDP tutorial's code, warm ranks, simulate, the doctor, the runner and lesson 07a's torchrun jobs
(there: only on the address the job names, 127.0.0.1)."""

import contextlib
import ipaddress
import subprocess
import sys
import threading

import psutil
import pytest
import tutorial_edits as edits

from _support import REPO_ROOT, write_notebook
from helpers import mp
from helpers.engine import faults, free_port, launch, loopback_interface, simulate, start_ranks
from helpers.engine.cluster import run_job

pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(400), pytest.mark.slow]


class Listening:
    """``(process name, address, port)`` of every listening inet socket of this process and its
    descendants, read every 0.1 s while the block runs."""

    def __enter__(self):
        self.seen, self.done = set(), threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()
        return self

    def watch(self):
        me = psutil.Process()
        while not self.done.wait(0.1):
            for p in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    self.seen |= {(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections("inet")
                                  if c.status == psutil.CONN_LISTEN}

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()

    def check(self):
        """Assert that every listener was on loopback, and that there was one (the sampling saw the run)."""
        beyond = sorted(s for s in self.seen if not ipaddress.ip_address(s[1].split("%")[0]).is_loopback)
        assert not beyond, f"listening beyond loopback: {beyond}"
        assert self.seen, "nothing seen listening: the sampling missed the run"


def test_ddp_tutorial_under_helpers_mp():
    """The tutorial's own cells (MASTER_ADDR "localhost", its init_process_group("gloo")) with
    docs/OWN_CODE.md's edits, its cleanup() a second later; its store listens on 127.0.0.1 only."""
    ns = {"__name__": "__main__"}
    for cell in edits.DDP_TUTORIAL.edited()[:-1]:
        exec(compile(cell.replace(edits.DDP_TUTORIAL.port, str(free_port())), "<cell>", "exec"), ns)
    exec("import time\nclean = cleanup\ndef cleanup():\n    time.sleep(1)  # the store open long enough to be seen\n"
         "    clean()\n", ns)
    with Listening() as seen:
        ns["run_demo"](ns["demo_basic"], 2)
    seen.check()


def _warm_ranks():
    ranks = start_ranks(2, timeout=120, activate=False)
    try:
        assert ranks.run(faults.ok) == [0, 1]
    finally:
        ranks.stop()


@pytest.mark.parametrize("run", [
    pytest.param(lambda: launch(faults.sleep_then_all_reduce, 2, seconds=1.5), id="launch"),
    pytest.param(_warm_ranks, id="warm-ranks"),
    pytest.param(lambda: subprocess.run([sys.executable, "-m", "helpers.doctor", "--only", "ports,launch,mp,cell code"],
                                        cwd=REPO_ROOT, check=True, capture_output=True, timeout=300), id="doctor"),
])
def test_loopback_only(run):
    with Listening() as seen:
        run()
    seen.check()


def test_simulate():
    with Listening() as seen:
        assert simulate(faults.ok, 8) == list(range(8))
    assert not seen.seen, seen.seen  # threads of this process, on a HashStore: nothing listens


def test_runner(tmp_path):
    """ci/run_notebooks.py on a one-cell notebook that launches 2 ranks from its kernel."""
    write_notebook(tmp_path / "notebooks" / "01_launch.ipynb", "from helpers.engine import faults, launch\n"
                   "launch(faults.sleep_then_all_reduce, 2, seconds=seconds)", params="seconds = 1.5")
    (tmp_path / "lessons.toml").write_text('[[lesson]]\nstem = "01_launch"\ntitle = "t"\noutcome = "pass"\n'
                                           '[lesson.smoke]\nseconds = 1.5\n[lesson.full]\nseconds = 1.5\n')
    with Listening() as seen:
        subprocess.run([sys.executable, str(REPO_ROOT / "ci" / "run_notebooks.py"), "01_launch",
                        "--notebooks-dir", str(tmp_path / "notebooks"), "--manifest", str(tmp_path / "lessons.toml"),
                        "--output-dir", str(tmp_path / "build")], check=True, capture_output=True, timeout=300)
    seen.check()


def test_mp_ranks_use_loopback_whatever_the_kernel_environment_says(monkeypatch):
    """docs/OWN_CODE.md: gloo on the loopback interface even with another GLOO_SOCKET_IFNAME in the
    kernel (here one this machine lacks, which gloo would refuse), MASTER_ADDR/PORT as the code set them."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "cafe0")
    port = str(free_port())
    ns = {"__name__": "__main__"}
    exec("import os, torch, torch.distributed as dist\n"
         "def fn(i, port):\n"
         "    os.environ.update(MASTER_ADDR='localhost', MASTER_PORT=port)\n"
         "    dist.init_process_group('gloo', rank=i, world_size=2)\n"
         "    t = torch.ones(1)\n"
         "    dist.all_reduce(t)\n"
         "    dist.destroy_process_group()\n"
         "    return os.environ['GLOO_SOCKET_IFNAME'], os.environ['MASTER_ADDR'], t.item()\n", ns)
    assert mp.spawn(ns["fn"], args=(port,), nprocs=2) == [(loopback_interface(), "localhost", 2.0)] * 2


@pytest.mark.parametrize("nodes", [1, 2])
def test_torchrun_jobs_of_lesson_07a(nodes):
    """``run_job`` (notebook 07a): torchrun on one node, and two "nodes" at the address named (127.0.0.1)."""
    with Listening() as seen:
        job = run_job([], module="launch_workers", nodes=nodes, nproc_per_node=2 // nodes, timeout=120,
                      env={"PYTHONPATH": str(REPO_ROOT / "tests")})
    assert [a.returncode for a in job.agents] == [0] * nodes, job.agents[0].tail()
    seen.check()

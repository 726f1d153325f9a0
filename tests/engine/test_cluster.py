"""helpers.engine.cluster and helpers.comm_hooks' formulas (notebooks 07a, 07b; 07b counts the real bytes):
torchrun commands and failure reports, network namespaces removed on error, a job's timeout,
communication hook byte counts. The engine takes the entry module as ``module=``; the course's
entry, ``torchrun ... -m helpers.mnist_torchrun``, runs by its own name.

The torchrun jobs themselves (one node against ``launch``, two nodes on loopback and in two
network namespaces, a node failure, ``--max-restarts``) are asserted by notebook 07a's cells,
which the suite runs in the smoke profile (tests/course/test_notebooks.py): real agents as
subprocesses, nothing left behind. They are not run a second time here. This file starts one
real agent, whose rendezvous never completes, to check the timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import helpers.engine.cluster as cluster
import helpers.mnist_torchrun as entry
from helpers.comm_hooks import HookSpec, expected_bytes_per_step, powersgd_compresses
from helpers.engine import free_port, loopback_interface
from helpers.engine.cluster import (
    AgentRun,
    NetnsUnavailable,
    TwoNodeNetwork,
    cluster_commands,
    failure_report,
    netns_available,
    run_agents,
    torchrun_command,
)

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 20
ARGS = ["--max-steps", STEPS, "--no-progress", "--backend", "gloo"]


def _why(job) -> str:
    return "\n".join(f"--- node {a.node}: exit {a.returncode}, timed out {a.timed_out}\n{a.tail(40)}"
                     for a in job.agents)


# ------------------------------------------------------------------------------ commands, docs


def test_commands_are_in_the_entry_docstring_and_docs():
    doc_lines = {line.strip() for line in entry.__doc__.splitlines()}
    docs = (ROOT / "docs" / "CLUSTER.md").read_text()
    docs_lines = {line.strip() for line in docs.splitlines()}
    commands = entry.cluster_commands()
    assert commands == cluster_commands(module="helpers.mnist_torchrun")
    assert entry.MODULE == entry.__name__, "torchrun must run the entry by its own module name"
    for title, text in commands.items():
        assert "-m helpers.mnist_torchrun " in text, (title, text)
        for line in text.splitlines():
            assert line.strip() in doc_lines, f"{title}: {line!r} missing from helpers/mnist_torchrun's docstring"
            assert line.strip() in docs_lines, f"{title}: {line!r} missing from docs/CLUSTER.md"


def test_the_engine_names_no_entry_module():
    """The engine's job functions take the entry module as a required keyword."""
    with pytest.raises(TypeError, match="module"):
        cluster_commands()
    with pytest.raises(TypeError, match="module"):
        torchrun_command([], standalone=True)
    with pytest.raises(TypeError, match="module"):
        cluster.run_job([])
    assert cluster_commands(module="my.entry", args="")["single node"].endswith("-m my.entry")
    assert not (ROOT / "helpers" / "engine" / "cluster" / "__main__.py").exists()


def test_the_entry_runs_by_its_own_name_and_says_it_needs_torchrun():
    """``python -m helpers.mnist_torchrun`` outside torchrun runs ``main()``, which says how to start it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "helpers.mnist_torchrun", "--max-steps", "1"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done
    assert "helpers.mnist_torchrun runs under torchrun" in done.stderr, done.stderr
    assert "torchrun --standalone --nproc-per-node=2 -m helpers.mnist_torchrun" in done.stderr, done.stderr


def test_torchrun_command_shapes_and_errors():
    single = torchrun_command(["--max-steps", 5], module="helpers.mnist_torchrun", nproc_per_node=2, standalone=True)
    assert single[:3] == [sys.executable, "-m", "helpers.engine.cluster.torchrun"]
    assert "--standalone" in single and "--nproc-per-node=2" in single and "--local-addr=127.0.0.1" in single
    assert single[-4:] == ["-m", "helpers.mnist_torchrun", "--max-steps", "5"]
    assert torchrun_command(["train.py"], module=None, standalone=True)[-1] == "train.py"
    multi = torchrun_command([], module="m", nnodes=2, rdzv_endpoint="127.0.0.1:1234", rdzv_id="x", is_host=False,
                             local_addr="127.0.0.1", max_restarts=3, prefix=["ip", "netns", "exec", "n1"])
    assert multi[:4] == ["ip", "netns", "exec", "n1"]
    for part in ("--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1234", "--rdzv-id=x",
                 "--rdzv-conf=join_timeout=60,is_host=0", "--local-addr=127.0.0.1", "--max-restarts=3"):
        assert part in multi, part
    with pytest.raises(ValueError, match="standalone"):
        torchrun_command([], module="m", standalone=True, rdzv_endpoint="h:1")
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        torchrun_command([], module="m")


def test_failure_report_parses_torchrun_summary():
    text = """
[rank1]: boom
============================================================
helpers.mnist_torchrun FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : localhost
  rank      : 1 (local_rank: 0)
  exitcode  : 1 (pid: 42)
  error_file: /tmp/x/error.json
  traceback : Traceback (most recent call last):
    File "x.py", line 1, in f
  InjectedFailure: injected failure: rank 1, training step 3
============================================================
"""
    r = failure_report(AgentRun(0, [], 1, 1.0, "", text))
    assert (r["rank"], r["local_rank"], r["exitcode"]) == (1, 0, 1)
    assert r["error"].startswith("InjectedFailure: injected failure")
    assert r["text"].startswith("helpers.mnist_torchrun FAILED")
    assert failure_report(AgentRun(0, [], 0, 1.0, "all good", "")) is None


# ------------------------------------------------------------------------------ comm hook formulas


def test_hook_byte_formulas():
    shapes = [(10, 784), (10,)]
    p = 7850
    assert expected_bytes_per_step(shapes, HookSpec("allreduce"), 1) == 4 * p
    for name in ("fp16", "bf16"):
        fp32_bytes = expected_bytes_per_step(shapes, HookSpec("allreduce"), 7)
        assert 2 * expected_bytes_per_step(shapes, HookSpec(name), 7) == fp32_bytes
    for r in (1, 4):
        spec = HookSpec("powersgd", rank=r, start_iter=3)
        assert expected_bytes_per_step(shapes, spec, 3) == 4 * p  # plain all-reduce up to start_iter
        assert expected_bytes_per_step(shapes, spec, 4) == 4 * ((10 + 784) * r + 10)  # P, Q; bias uncompressed
    assert not powersgd_compresses((10, 784), 5)  # (10 + 784) * 5 * 2 = 7940 >= 7840
    assert expected_bytes_per_step(shapes, HookSpec("powersgd", rank=5, start_iter=2), 9) == 4 * p


def test_powersgd_compresses_matches_torch():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    for shape in [(10, 784), (10,), (8, 1, 3, 3), (16, 8, 3, 3), (64, 64), (3, 1000)]:
        n = shape[0]
        m = int(torch.Size(shape).numel()) // n
        for r in (1, 2, 4, 8):
            assert powersgd_compresses(shape, r) == _should_compress(n, m, min(n, m, r), 2)[0], (shape, r)


def test_hook_spec_validation():
    with pytest.raises(ValueError, match="unknown hook"):
        HookSpec("int8")
    with pytest.raises(ValueError, match="rank"):
        HookSpec("powersgd", rank=0)
    with pytest.raises(ValueError, match="start_iter"):
        HookSpec("powersgd", rank=1, start_iter=1)


# ------------------------------------------------------------------------------ torchrun jobs


@pytest.fixture(scope="module")
def netns_ok():
    ok, why = netns_available()
    if not ok:
        pytest.skip(f"network namespaces not available here: {why}")


def test_network_namespaces_refused_clearly_off_linux(monkeypatch):
    """On macOS or Windows the rehearsal says it needs Linux (no `ip` command run, no traceback
    from subprocess); notebook 07a prints that reason and skips its part 3."""
    monkeypatch.setattr(sys, "platform", "darwin")
    ok, why = netns_available()
    assert not ok and "Linux" in why and "darwin" in why, why
    with pytest.raises(NetnsUnavailable, match="needs Linux"):
        with TwoNodeNetwork():
            pass


@pytest.mark.usefixtures("netns_ok")
def test_network_namespaces_are_removed_on_error():
    net = TwoNodeNetwork()
    with pytest.raises(RuntimeError, match="boom"):
        with net:
            assert len(net.exists()) == 2
            raise RuntimeError("boom")
    assert net.exists() == []


@pytest.mark.usefixtures("no_leftover_processes")
def test_timeout_kills_agent_and_workers(tmp_path):
    """One agent of a two-node job waits at the rendezvous forever: the timeout ends it."""
    port = free_port()
    marker = f"ddp-lab-timeout-{port}"
    cmd = torchrun_command(ARGS, module=entry.MODULE, nnodes=2, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=marker,
                           is_host=True, local_addr="127.0.0.1", log_dir=tmp_path / "torchrun-logs")
    (run,) = run_agents([cmd], timeout=8, env={"GLOO_SOCKET_IFNAME": loopback_interface()})
    assert run.timed_out and run.returncode is None
    assert not cluster.processes_matching(marker), "the agent (and any worker) must be gone"

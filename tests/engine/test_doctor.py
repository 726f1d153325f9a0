"""``python3 -m helpers.doctor``, run as a learner runs it (a subprocess): every check ok on this
machine, and a fix line, never a traceback, for each failure injected here for real: no MNIST
(an empty data root), a fixed ``MASTER_PORT`` held by another process, a broken ``import torch``
(a fake ``torch`` package first on ``PYTHONPATH``), a check that hangs, another Python's
``jupyter-lab`` first on PATH."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

import pytest

from _support import REPO_ROOT
from helpers.doctor import CHECKS
from helpers.engine import free_port

TORCH_NEEDED = [c.name for c in CHECKS if "torch" in c.needs]


def doctor(*args: str, pythonpath_first: str | None = None) -> subprocess.CompletedProcess:
    path = [p for p in (pythonpath_first, str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, "-m", "helpers.doctor", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900)


def table(out: str) -> dict[str, tuple[str, str, str]]:
    """``{check name: (status, detail, fix)}`` from the doctor's table (fixed-width columns)."""
    rows: dict[str, tuple[str, str, str]] = {}
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(("ok  ", "FAIL")):
            status, name, detail = line[:4].strip(), line[6:16].strip(), line[18:]
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            fix = nxt.strip()[len("fix: "):] if nxt.strip().startswith("fix: ") else ""
            rows[name] = (status, detail, fix)
    return rows


def report(run: subprocess.CompletedProcess) -> str:
    return f"exit {run.returncode}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr[-3000:]}"


def failed(run: subprocess.CompletedProcess, name: str) -> tuple[str, str]:
    """``(detail, fix)`` of check ``name``, which must have failed, in a run that exits 1 with no
    traceback."""
    status, detail, fix = table(run.stdout).get(name, ("missing", "", ""))
    assert run.returncode == 1 and status == "FAIL", report(run)
    assert "Traceback" not in run.stdout + run.stderr, report(run)
    return detail, fix


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A real tmpfs of ``size`` mounted at ``path`` (skips the test where mounting needs root)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (root and CAP_SYS_ADMIN needed): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture(scope="module")
def full_run():
    # A free port instead of the tutorials' 12355 / 29500: other tests may hold those meanwhile.
    return doctor("--port", str(free_port()))


@pytest.mark.slow(90)
def test_doctor_exits_0_here(full_run):
    rows = table(full_run.stdout)
    assert set(rows) == {c.name for c in CHECKS}, report(full_run)
    assert full_run.returncode == 0 and all(r[0] == "ok" for r in rows.values()), report(full_run)
    assert "this machine can run every notebook" in full_run.stdout
    assert "Traceback" not in full_run.stdout + full_run.stderr, report(full_run)
    for word in ("platform", "CPU cores", "GiB memory"):
        assert word in full_run.stdout
    assert "gloo yes" in rows["torch"][1] and "nccl" in rows["torch"][1]


def test_no_mnist_gives_the_fix(tmp_path):
    run = doctor("--data-root", str(tmp_path), "--only", "mnist")
    detail, fix = failed(run, "MNIST")
    assert "4 of 4 MNIST files missing" in detail and str(tmp_path) in detail, report(run)
    # a root of one's own: the fix is to copy the files there (git checkout restores only the repository's)
    assert "does not exist" in detail, report(run)
    assert f"copy the repository's data/MNIST/raw/*.gz into {tmp_path}" in fix, report(run)
    assert list(tmp_path.iterdir()) == []  # nothing written where nothing can be made


def test_held_port_is_reported_with_its_holder():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        run = doctor("--port", str(port), "--only", "ports,mp")
    detail, fix = failed(run, "ports")
    assert f"port {port}" in detail and f"pid {os.getpid()}" in detail, report(run)
    assert "MASTER_PORT" in fix, report(run)
    # the mp check still runs the tutorial's code, on a free port instead
    mp = table(run.stdout)["mp"]
    assert mp[0] == "ok" and "a free port" in mp[1], report(run)


def test_broken_torch_gives_fix_lines_not_a_traceback(tmp_path):
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text('raise ImportError("a broken torch, for the doctor test")\n')
    run = doctor(pythonpath_first=str(fake))
    detail, fix = failed(run, "torch")
    assert "a broken torch" in detail and "pip install -r requirements.lock" in fix, report(run)
    rows = table(run.stdout)
    for name in TORCH_NEEDED:
        assert rows[name][0] == "FAIL" and "needs torch" in rows[name][1] and rows[name][2], report(run)
    # the kernel inherits the broken torch: its line says so, with a fix
    assert rows["kernel"][0] == "FAIL" and "a broken torch" in rows["kernel"][1] and rows["kernel"][2], report(run)
    assert rows["python"][0] == rows["ports"][0] == rows["JupyterLab"][0] == "ok", report(run)


@pytest.mark.parametrize("ignores_sigint", [False, True], ids=["interrupted", "ignores-interrupt"])
def test_a_hanging_check_is_cut_at_its_time_limit(tmp_path, ignores_sigint):
    """A fake ``jupyterlab`` whose import never returns: the check is interrupted at its time
    limit and reported; one that ignores the interrupt ends the doctor (exit 1) soon after."""
    fake = tmp_path / "fake"
    (fake / "jupyterlab").mkdir(parents=True)
    (fake / "jupyterlab" / "__init__.py").write_text(
        "import signal, time\n"
        + ("signal.signal(signal.SIGINT, signal.SIG_IGN)\n" if ignores_sigint else "")
        + "time.sleep(600)\n")
    run = doctor("--only", "jupyterlab,ports", "--time-limit", "3", pythonpath_first=str(fake))
    detail, fix = failed(run, "JupyterLab")
    assert fix, report(run)
    if ignores_sigint:
        assert "the doctor stopped here" in detail and "checks FAILED" not in run.stdout, report(run)
    else:  # the doctor goes on to its summary
        assert "no answer within 3 s" in detail and "1 of 2 checks FAILED" in run.stdout, report(run)


@pytest.mark.parametrize("first_lines", ["#!{python}", "#!/usr/bin/env {name}",
                                         "#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''"],
                         ids=["shebang", "env", "pip-long-path"])
def test_a_jupyter_lab_of_another_python_first_on_path_gives_the_command(tmp_path, monkeypatch, first_lines):
    """Issue 50: in a venv that sees a system Jupyter, `python3 -m jupyter lab` started the system's
    server (jupyter_core runs the first ``jupyter-lab`` on PATH), which refused the course. Here a
    ``jupyter-lab`` of another Python (an interpreter whose ``sys.prefix`` is elsewhere) comes first
    on PATH: the check fails and says what to type to start this Python's JupyterLab."""
    from helpers.doctor.common import Failed
    from helpers.doctor.kernel import check_jupyterlab

    other = tmp_path / "ddp-lab-other-python"
    other.write_text("#!/bin/sh\necho /an/other/python\n")
    script = tmp_path / "jupyter-lab"
    script.write_text(first_lines.format(python=other, name=other.name) + "\nfrom jupyterlab.labapp import main\n")
    for path in (other, script):
        path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(Failed) as info:
        check_jupyterlab(None)
    detail = info.value.detail
    assert f"would start jupyter-lab {script}, which runs {other}, not this Python" in detail, detail
    assert f"`{sys.executable} -m jupyterlab --config=jupyter_lab_config.json" in info.value.fix, info.value.fix


def test_memory_check_reads_free_memory_and_says_what_to_close(monkeypatch):
    """Issue 44, part 5: the doctor checks free memory (psutil's, real) against what one lesson's
    kernel and ranks need; asked for more than this machine has, it fails with what to close."""
    import psutil

    from helpers.doctor import checks
    from helpers.doctor.common import Failed

    assert "MiB free" in checks.check_memory(None) or psutil.virtual_memory().available < checks.MIN_FREE_MIB * 2**20
    monkeypatch.setattr(checks, "MIN_FREE_MIB", psutil.virtual_memory().total // 2**20 + 1)
    with pytest.raises(Failed) as info:
        checks.check_memory(None)
    assert "MiB free" in info.value.detail and "Shut Down Kernel" in info.value.fix, (info.value.detail, info.value.fix)


def test_small_shm_gives_the_docker_fix(tmp_path):
    """A real 64 MiB tmpfs, Docker's default /dev/shm, where DataLoader workers pass their batches:
    the shm check fails with the fix; the machine's own /dev/shm passes in test_doctor_exits_0_here."""
    with tmpfs(tmp_path / "shm", "64m") as small:
        detail, fix = failed(doctor("--shm", str(small), "--only", "shm"), "shm")
    assert f"{small}: 64 MiB" in detail and "DataLoader workers" in detail, detail
    assert "--shm-size=1g" in fix and "--ipc=host" in fix, fix


def test_bad_port_refused_before_any_check():
    run = doctor("--port", "70000")
    assert run.returncode == 2 and "from 1 to 65535" in run.stderr and "'70000'" in run.stderr, report(run)
    assert "pip install" not in run.stdout + run.stderr and not table(run.stdout), report(run)
    assert "Traceback" not in run.stdout + run.stderr, report(run)


def test_read_only_data_root_gives_a_fix_that_is_not_the_error(tmp_path):
    """The .gz files in a read-only folder (a read-only mount: root writes through chmod)."""
    with tmpfs(tmp_path / "ro", "30m") as root:
        raw = root / "MNIST" / "raw"
        raw.mkdir(parents=True)
        for gz in (REPO_ROOT / "data" / "MNIST" / "raw").glob("*.gz"):
            (raw / gz.name).write_bytes(gz.read_bytes())
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        detail, fix = failed(doctor("--data-root", str(root), "--only", "mnist"), "MNIST")
    assert f"{raw} is read-only" in detail, detail
    assert f"chmod -R u+w {raw}" in fix and f"gunzip -k {raw}/*.gz" in fix, fix
    assert "Errno" not in fix, fix

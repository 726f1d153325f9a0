"""Rank output reaching the caller: each rank's stdout and stderr, line by line, prefixed
``[rank r]``, in the order the rank wrote them, whether or not torch's elastic agent redirects
(it does not on macOS and Windows: ``get_std_cm`` in torch/distributed/elastic/multiprocessing/api.py
returns a null context there)."""

import os
import subprocess
import sys
import textwrap

import pytest

from _support import REPO_ROOT, TESTS_DIR

# slow: real processes in (nearly) every test
pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(300), pytest.mark.slow]

#: Put first on PYTHONPATH, so that every process of the run (the launcher, the fork server, each
#: rank) takes torch's macOS branch of the agent's redirect: ``IS_MACOS`` set once the module loads.
FORCE_MACOS_BRANCH = '''
import importlib.abc
import importlib.util
import sys

NAME = "torch.distributed.elastic.multiprocessing.api"


class ForceMacosBranch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_force(module):
            exec_module(module)
            module.IS_MACOS = True  # get_std_cm: `if IS_WINDOWS or IS_MACOS ...: return nullcontext()`

        spec.loader.exec_module = exec_and_force
        return spec


sys.meta_path.insert(0, ForceMacosBranch())
'''

#: Each case runs between "=== name" lines on the script's stdout; the last line is "RESULTS ...".
SCRIPT = '''
import os
import signal
import sys

import helpers.mp
from helpers.engine import WorkerError, launch


def talk(rank, *_):
    import torch.distributed.elastic.multiprocessing.api as api

    for i in range(5):
        print(f"out {rank} {i}")
        print(f"err {rank} {i}", file=sys.stderr)
    os.system(f"echo shell {rank}; echo shell-err {rank} >&2")  # a subprocess: the descriptors themselves
    print(f"no newline {rank}", end="")
    return api.IS_MACOS


def raises(rank, world_size):
    print(f"before raising {rank}")
    print(f"stderr before raising {rank}", file=sys.stderr)
    if rank == 1:
        raise ValueError("boom")


def killed(rank, world_size):
    print(f"before the kill {rank}")
    if rank == 1:
        sys.stdout.write("half a li")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def case(name):
    print(f"=== {name}", flush=True)
    print(f"=== {name}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    results = {}
    case("launch")
    results["launch"] = launch(talk, 2, timeout=120)
    case("mp.spawn")
    results["mp.spawn"] = helpers.mp.spawn(talk, nprocs=2, timeout=120)
    for fn in (raises, killed):
        case(fn.__name__)
        try:
            launch(fn, 2, timeout=120)
        except WorkerError as e:
            results[fn.__name__] = e.rank
    case("end")
    print("RESULTS", results, flush=True)
'''


def _cases(text: str) -> dict[str, list[str]]:
    """``{case name: its lines}`` from a stream split by ``=== name`` lines."""
    cases, name = {}, None
    for line in text.splitlines():
        if line.startswith("=== "):
            name = line[4:]
            cases[name] = []
        elif name is not None:
            cases[name].append(line)
    return cases


def _rank_lines(lines: list[str], rank: int) -> list[str]:
    prefix = f"[rank {rank}] "
    return [line[len(prefix):] for line in lines if line.startswith(prefix)]


def test_every_line_of_every_rank_without_elastic_redirects(tmp_path):
    """torch's macOS/Windows branch forced (its redirect a null context) in every process: under
    ``launch`` and ``helpers.mp.spawn`` each rank's lines arrive in order, prefixed, stdout on
    stdout and stderr on stderr, each once, also a subprocess's and a last line without a newline;
    a rank that raises and a rank SIGKILLed mid-line show what they wrote before."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FORCE_MACOS_BRANCH)
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    path = os.pathsep.join(filter(None, [str(site), str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(tmp_path / "script.py")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULTS {'launch': [True, True], 'mp.spawn': [True, True], 'raises': 1, 'killed': 1}" in proc.stdout, (
        "every rank must have run with torch's macOS branch forced (IS_MACOS) and each fault must name rank 1:\n"
        + proc.stdout + proc.stderr)
    out, err = _cases(proc.stdout), _cases(proc.stderr)
    for name in ("launch", "mp.spawn"):
        for rank in (0, 1):
            got = _rank_lines(out[name], rank)
            assert got == [*(f"out {rank} {i}" for i in range(5)), f"shell {rank}", f"no newline {rank}"], (
                f"{name}, rank {rank}'s stdout:\n{proc.stdout}")
            got = _rank_lines(err[name], rank)
            assert got == [*(f"err {rank} {i}" for i in range(5)), f"shell-err {rank}"], (
                f"{name}, rank {rank}'s stderr:\n{proc.stderr}")
        unprefixed = [line for line in out[name] + err[name] if "out " in line or "err " in line
                      if not line.startswith("[rank ")]
        assert not unprefixed, f"{name}: rank lines that bypassed the relay: {unprefixed}"
    for rank in (0, 1):
        assert _rank_lines(out["raises"], rank) == [f"before raising {rank}"], proc.stdout
        assert _rank_lines(err["raises"], rank) == [f"stderr before raising {rank}"], proc.stderr
    assert _rank_lines(out["killed"], 0) == ["before the kill 0"], proc.stdout
    assert _rank_lines(out["killed"], 1) == ["before the kill 1", "half a li"], proc.stdout

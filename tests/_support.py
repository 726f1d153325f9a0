"""Shared test utilities (not a test module)."""

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers.engine import leftover_children

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = Path(__file__).resolve().parent


#: Child processes of this test process, less the resource tracker and the fork server.
leftover_processes = leftover_children

#: Set to 1, skips the browser tests outside CI (docs/TESTING.md).
SKIP_ENV = "DDP_LAB_SKIP_BROWSER"

#: Busy processes per core that :func:`busy_cpus` starts: load average 10 on 2 cores (issue 40).
BUSY_PER_CORE = 5


@contextlib.contextmanager
def busy_cpus(per_core: int = BUSY_PER_CORE, n: int | None = None):
    """A loaded machine: ``per_core`` processes per CPU core (or ``n`` in all) running
    ``while True: pass``, killed on exit (before a test's check for processes left behind).
    Yields the processes (``subprocess.Popen``)."""
    n = per_core * (os.cpu_count() or 1) if n is None else n
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield busy
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait()


def as_cell(code: str, **names) -> dict:
    """Run ``code`` as a notebook cell would (its functions and classes live in ``__main__``), with
    ``names`` already defined, as earlier cells would have; returns its namespace."""
    ns = {"__name__": "__main__", **names}
    exec(compile(code, "<cell>", "exec"), ns)
    return ns


def repo_env(**extra) -> dict:
    """This process's environment with the repository root first on ``PYTHONPATH``, and ``extra``."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def write_notebook(path, *cells, params=None):
    """Write a notebook of code ``cells`` (a ``(source, tag)`` pair tags its cell) to ``path``, after a
    ``parameters`` cell when ``params`` (its source) is given."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for cell in ([(params, "parameters")] if params is not None else []) + list(cells):
        source, tag = cell if isinstance(cell, tuple) else (cell, None)
        nb.cells.append(nbformat.v4.new_code_cell(source))
        if tag:
            nb.cells[-1].metadata["tags"] = [tag]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def run_papermill(path, cwd=REPO_ROOT, timeout=300) -> list[str]:
    """papermill runs notebook ``path`` (into ``out.ipynb`` beside it) in a kernel on Unix sockets;
    returns each cell's output text (streams and ``text/plain``)."""
    import papermill

    from ci.cleanup import IPCKernelManager

    out = path.with_name("out.ipynb")
    papermill.execute_notebook(str(path), str(out), kernel_name="python3", cwd=str(cwd), progress_bar=False,
                               execution_timeout=timeout, kernel_manager_class=IPCKernelManager)
    return cell_texts(out)


def cell_texts(path) -> list[str]:
    """Each cell's output text (streams and ``text/plain``) in notebook ``path``."""
    import nbformat

    return ["".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in c.get("outputs", []))
            for c in nbformat.read(path, as_version=4).cells]


def require_browser(test: str) -> str:
    """The Chromium executable for ``test`` (its name in messages). Where ``CI`` is set a missing
    browser fails the test; elsewhere it skips it (reason in pytest's summary), as does
    ``DDP_LAB_SKIP_BROWSER=1``."""
    from ci.site import CHROMIUM_ENV, find_chromium

    in_ci = bool(os.environ.get("CI"))
    if os.environ.get(SKIP_ENV) == "1":
        if in_ci:
            pytest.fail(f"{SKIP_ENV}=1 but CI is set: in CI {test} is mandatory", pytrace=False)
        pytest.skip(f"{SKIP_ENV}=1: {test} is skipped on purpose")
    problems = []
    chromium = find_chromium()
    if chromium is None:
        where = os.environ.get(CHROMIUM_ENV) or "/usr/bin/chromium (or `chromium` on PATH)"
        problems.append(
            f"Chromium not found at {where}. Install it: `sudo apt-get install -y chromium` "
            f"(Debian; on Ubuntu the apt package is a snap, use `snap install chromium`), or "
            f"point {CHROMIUM_ENV} at a Chromium/Chrome executable.")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        problems.append("The Python package `playwright` is missing: `python3 -m pip install -r "
                        "requirements.lock` (do not run `playwright install`: the test drives the "
                        "system Chromium).")
    if problems:
        message = f"{test[0].upper()}{test[1:]} needs a browser:\n- " + "\n- ".join(problems)
        if in_ci:
            pytest.fail(message + "\nCI is set, so this test is mandatory.", pytrace=False)
        pytest.skip(message.replace("\n", " ") + " (mandatory where CI is set)")
    return chromium


# ---- warm ranks (helpers.engine.warm_ranks): kernels and the processes they leave ---------------------------

#: An environment variable a test sets to a fresh value for the processes it starts (a kernel,
#: papermill), so it can find every process they started, even those re-parented after a kill.
RANKS_MARK = "DDP_LAB_TEST_MARK"


def warm_ranks(timeout):
    """Generator for a module-scoped fixture: 2 warm ranks (``start_ranks(2, timeout=timeout)``, no
    ``%%px``), stopped at the end."""
    from helpers.engine import start_ranks

    r = start_ranks(2, timeout=timeout, activate=False)
    yield r
    r.stop()


def marked_warm_ranks(mark, timeout):
    """:func:`warm_ranks` started with ``RANKS_MARK=mark`` in this process's environment, so that
    :func:`marked_processes` finds them; the variable is put back at the end. The changed
    environment restarts this process's fork server, twice (a fresh ``import torch`` each): only
    for a module that looks for its ranks' processes."""
    old = os.environ.get(RANKS_MARK)
    os.environ[RANKS_MARK] = mark
    yield from warm_ranks(timeout)
    if old is None:
        os.environ.pop(RANKS_MARK, None)
    else:
        os.environ[RANKS_MARK] = old


def marked_processes(mark, cmd_contains="ipyparallel"):
    """Processes (anywhere on the machine) whose environment has ``RANKS_MARK=mark`` and whose
    command line or name contains ``cmd_contains`` (engines, nannies, the controller and its schedulers)."""
    found = []
    for p in psutil.process_iter():
        try:
            # the name too: a warm rank process forked from the fork server has the server's command
            # line and the name helpers.engine.warm_ranks_forked.RANK_PROCESS_NAME ("ipyparallel-eng")
            if p.pid != os.getpid() and p.environ().get(RANKS_MARK) == mark \
                    and cmd_contains in " ".join([p.name(), *p.cmdline()]):
                found.append(p)
        except psutil.Error:
            pass
    return found


def wait_until_gone(mark, seconds=20.0, cmd_contains="ipyparallel"):
    """Poll until no marked process is left; return what is still there after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        left = marked_processes(mark, cmd_contains)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


class Kernel:
    """A real IPython kernel (jupyter_client) whose environment carries ``RANKS_MARK=mark`` and
    imports this worktree's ``helpers``, started in ``cwd`` (default: the repository root), as
    JupyterLab starts a notebook's kernel in the notebook's folder. ``cell(code)`` runs a cell:
    ``(reply content, output text)``."""

    def __init__(self, mark, cwd=None):
        from jupyter_client.manager import KernelManager

        from ci.cleanup import ipc_kernel_manager

        self.km = ipc_kernel_manager(KernelManager)(kernel_name="python3")  # no TCP port race
        self.km.start_kernel(env=repo_env(**{RANKS_MARK: mark}), cwd=str(cwd or REPO_ROOT))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    @property
    def pid(self):
        return self.km.provisioner.process.pid

    def cell(self, code, timeout=300):
        out = []

        def hook(msg):
            kind, c = msg["header"]["msg_type"], msg["content"]
            if kind == "stream":
                out.append(c["text"])
            elif kind in ("display_data", "execute_result"):
                out.append(c["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                out.append("\n".join(c["traceback"]) + "\n")

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook, allow_stdin=False)
        return reply["content"], re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", "".join(out))

    def close(self):
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=False)  # a clean shutdown: the kernel runs atexit


def exercise_cells(number: int, title: str, task: str, check: str, solution: str) -> list:
    """``[markdown, learner code, check code, solution code]``: exercise ``number``'s four nbformat v4
    cells as docs/TESTING.md ("Exercises") writes them; ``check`` and ``solution`` are the code
    below each cell's first line (``# Check: exercise N``, the spoiler-free solution line)."""
    from nbformat.v4 import new_code_cell, new_markdown_cell

    from ci.lessons import SOLUTION_FIRST_LINE, SOLUTION_METADATA

    learner = new_code_cell(f"answer_{number} = None  # your answer here", metadata={"tags": ["exercise"]})
    check_cell = new_code_cell(f"# Check: exercise {number}\n{check}",
                               metadata={"jupyter": {"source_hidden": True}, "tags": ["check"]})
    solution_cell = new_code_cell(f"{SOLUTION_FIRST_LINE} {number} (try the exercise first)\n{solution}",
                                  metadata={"jupyter": dict(SOLUTION_METADATA["jupyter"]),
                                            "tags": list(SOLUTION_METADATA["tags"])})
    return [new_markdown_cell(f"### Exercise {number}: {title}\n\n{task}"), learner, check_cell, solution_cell]

"""Notebook 01 in a real JupyterLab, driven through its UI by headless Chromium (Playwright).

What a learner does: start ``jupyter lab``, open ``01_gradients_dp_vs_ddp.ipynb``, choose
Run > Run All Cells, wait. The test checks what they would see: every code cell executed, a
matplotlib figure (an ``<img>`` in an output area), the workers' output prefixed ``[rank 0]``
/ ``[rank 1]`` relayed into the cell, and no error output (no output of type ``error`` in the
notebook model, no rendered stderr holding a traceback). It saves screenshots to
``build/jupyterlab_nb01.png`` (the figure) and ``build/jupyterlab_nb01_ranks.png`` (the
``[rank r]`` output). In the same page (a new tab, as the file browser opens one) it then runs
a scratch notebook that raises (the detectors above must catch it) and one that starts warm
ranks (``helpers.engine.warm_ranks``) and a ``%%px`` cell, and checks both ranks' output is rendered,
labelled ``[stdout:0]`` / ``[stdout:1]`` (``build/jupyterlab_px.png``); each notebook's checks
look only inside its own panel. It shuts the server down through its REST API
and checks that no process it started (server, kernel, DDP workers, browser) is left behind.

Parameters: the browser runs the notebook with :data:`BROWSER_PARAMETERS` (``seed`` 1, two
ranks), injected into the temporary copy as papermill does (its jupytext twin rewritten to
match), so this is the one run of notebook 01 with another seed: no other run in CI (the smoke
tests with seed 0, the main job's full profile with 4 ranks) executes the notebook with the
same parameters, which the test checks.

Started as the README starts it: ``jupyter lab --config=jupyter_lab_config.json
notebooks/<lesson>`` from the course's root, so the root JupyterLab serves holds ``notebooks/``
and ``docs/``. Before running notebook 01 the test waits until JupyterLab has copied the
kernel's ``language_info`` into the notebook, saves it (File > Save's command) and checks the
``.ipynb`` and its ``.py`` twin are byte-identical to what was there before (the repository's
``helpers.jupyter_hooks.pre_save``, loaded by that config: opening a lesson leaves
``git status`` clean). After the run it clicks a glossary link (``../docs/GLOSSARY.md#...``) in
the notebook's first cell and checks the glossary opens (no 404 in the server's log).

Isolation: JupyterLab serves a temporary copy of ``notebooks/`` and ``docs/`` (the notebook in
git is never touched, whatever JupyterLab autosaves; the test checks its bytes did not change)
with temporary settings, workspaces, runtime and config folders, on 127.0.0.1, a free port and
a random token.

Needs Chromium (Debian: ``apt-get install -y chromium``; ``.ci/run`` installs it) and the
``playwright`` Python package (requirements.txt), which drives that Chromium; Playwright's own
browser download (``playwright install``) is never used. ``DDP_LAB_CHROMIUM`` may name another
Chromium executable. Where the environment variable ``CI`` is set the test is mandatory: a
missing browser FAILS it, saying how to install one. Elsewhere it is skipped, with the reason
in pytest's summary; ``DDP_LAB_SKIP_BROWSER=1`` skips it on purpose (not under ``CI``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from _support import leftover_processes
from ci.site import CHROMIUM_ENV, find_chromium
from helpers.engine.processes import free_port, is_live

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = ROOT / "notebooks"
#: The config the README's ``jupyter lab`` command loads (root and pre-save hook).
LAB_CONFIG = ROOT / "jupyter_lab_config.json"
NB_NAME = "01_gradients_dp_vs_ddp.ipynb"
NB_PATH = f"notebooks/{NB_NAME}"  # relative to the served root
GLOSSARY_PATH = "docs/GLOSSARY.md"
#: Injected into the temporary copy; must differ from the notebook's smoke and full parameters.
BROWSER_PARAMETERS = {"seed": 1}
BUILD_DIR = ROOT / "build"
SCREENSHOT = BUILD_DIR / "jupyterlab_nb01.png"
SCREENSHOT_RANKS = BUILD_DIR / "jupyterlab_nb01_ranks.png"

SKIP_ENV = "DDP_LAB_SKIP_BROWSER"
#: Flags for Chromium on a machine without a display, GPU or outside network.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
]

MARKER_ENV = "DDP_LAB_JUPYTERLAB_TEST"
SERVER_START_TIMEOUT_S = 180
RUN_ALL_TIMEOUT_S = 600  # notebook 01 takes 30-90 s on 2 busy cores; the rest is slack
SHUTDOWN_TIMEOUT_S = 60

#: JupyterLab user settings for a deterministic, quiet, offline UI.
LAB_SETTINGS = {
    # every cell attached to the DOM (the default, contentVisibility, may skip offscreen cells)
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    # no news / update requests (no network here) and no toasts over the notebook
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
}

PROBE_NAME = "zz_error_probe.ipynb"  # written into the temporary copy only
PROBE_MESSAGE = "deliberate error from tests/course/test_jupyterlab.py"


def _make_probe_notebook(path: Path) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        'print("before the error")', f"raise ValueError({PROBE_MESSAGE!r})", 'print("not reached")')]
    nbformat.write(nb, str(path))


PX_NAME = "zz_warm_ranks.ipynb"  # written into the temporary copy only
PX_MESSAGE = "hello from warm rank"
PX_TIMEOUT_S = 300  # two engines importing torch on 2 busy cores
SCREENSHOT_PX = BUILD_DIR / "jupyterlab_px.png"


def _make_px_notebook(path: Path) -> None:
    """Warm ranks (helpers.engine.warm_ranks) and one ``%%px`` cell, as a learner would write them."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (
        "from helpers.engine import start_ranks\nranks = start_ranks(world_size=2)",
        f'%%px\nprint(f"{PX_MESSAGE} {{rank}} of {{world_size}}")')]
    nbformat.write(nb, str(path))


# JavaScript run in the page; `window.jupyterapp` exists thanks to --LabApp.expose_app_in_browser.
JS_KERNEL_STATUS = """(name) => {
  const app = window.jupyterapp;
  const w = app && app.shell && app.shell.currentWidget;
  if (!w || !w.context || !w.context.path.endsWith(name)) return null;
  const s = w.sessionContext && w.sessionContext.session;
  return s && s.kernel ? s.kernel.status : null;
}"""

JS_LANGUAGE_VERSION = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const info = w && w.context && w.context.model && w.context.model.getMetadata('language_info');
  return info && info.version ? info.version : null;
}"""

JS_NOTEBOOK_STATE = """() => {
  const app = window.jupyterapp;
  const w = app && app.shell && app.shell.currentWidget;
  if (!w || !w.content || !w.content.model || !w.sessionContext) return null;
  const s = w.sessionContext.session;
  const cells = w.content.model.cells;
  const out = {kernel: s && s.kernel ? s.kernel.status : null, code_cells: 0, executed: 0,
               errors: [], running: 0};
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type !== 'code') continue;
    out.code_cells += 1;
    if (c.executionCount !== null && c.executionCount !== undefined) out.executed += 1;
    for (let j = 0; j < c.outputs.length; j++) {
      const o = c.outputs.get(j).toJSON();
      if (o.output_type === 'error') {
        out.errors.push({cell: i, ename: o.ename, evalue: o.evalue});
      }
    }
  }
  for (const p of w.node.querySelectorAll('.jp-InputPrompt')) {  // this notebook's prompts only
    if (p.textContent.includes('*')) out.running += 1;
  }
  return out;
}"""


# --------------------------------------------------------------------------------------------
# Prerequisites
# --------------------------------------------------------------------------------------------


def require_browser() -> str:
    """The Chromium executable. Where ``CI`` is set a missing browser fails the test; elsewhere
    it skips it (reason in pytest's summary), as does ``DDP_LAB_SKIP_BROWSER=1``."""
    in_ci = bool(os.environ.get("CI"))
    if os.environ.get(SKIP_ENV) == "1":
        if in_ci:
            pytest.fail(f"{SKIP_ENV}=1 but CI is set: in CI the JupyterLab browser test is mandatory", pytrace=False)
        pytest.skip(f"{SKIP_ENV}=1: the JupyterLab browser test is skipped on purpose")
    problems = []
    chromium = find_chromium()
    if chromium is None:
        where = os.environ.get(CHROMIUM_ENV) or "/usr/bin/chromium (or `chromium` on PATH)"
        problems.append(
            f"Chromium not found at {where}. Install it: `sudo apt-get install -y chromium` "
            f"(Debian; on Ubuntu the apt package is a snap, use `snap install chromium`), or "
            f"point {CHROMIUM_ENV} at a Chromium/Chrome executable."
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        problems.append(
            "The Python package `playwright` is missing: `python3 -m pip install -r requirements.lock` "
            "(do not run `playwright install`: the test drives the system Chromium)."
        )
    if problems:
        message = "The JupyterLab browser test needs a browser:\n- " + "\n- ".join(problems)
        if in_ci:
            pytest.fail(message + "\nCI is set, so this test is mandatory.", pytrace=False)
        pytest.skip(message.replace("\n", " ") + " (mandatory where CI is set)")
    return chromium


def inject_browser_parameters(path: Path) -> dict:
    """Write :data:`BROWSER_PARAMETERS` into the notebook at ``path`` (a temporary copy) the way
    papermill does (an ``injected-parameters`` cell after the ``parameters`` cell), after the
    runner's type checks; returns the values the notebook runs with."""
    import jupytext
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    from ci.planning import effective_parameters

    source = NOTEBOOKS_DIR / NB_NAME
    values = effective_parameters(source, "smoke", BROWSER_PARAMETERS)
    for profile in ("smoke", "full"):
        assert values != effective_parameters(source, profile), (
            f"the browser test would run {NB_NAME} with the {profile} profile's parameters, which "
            f"another CI run already executes: change BROWSER_PARAMETERS")
    nb = parameterize_notebook(load_notebook_node(str(path)), dict(BROWSER_PARAMETERS))
    nbformat.write(nb, str(path))
    # the jupytext twin too, written after the .ipynb: JupyterLab (with jupytext) refuses a
    # paired .ipynb that is newer than its .py and differs from it
    twin = path.with_suffix(".py")
    if twin.exists():
        jupytext.write(nb, str(twin), fmt="py:percent")
        # and the .ipynb in the form jupytext reads the pair (the twin's inputs, the .ipynb's
        # metadata and outputs), so that a save in JupyterLab may not change a byte of either
        from jupytext.combine import combine_inputs_with_outputs

        nb = combine_inputs_with_outputs(jupytext.read(str(twin)), nbformat.read(str(path), as_version=4))
        nbformat.write(nb, str(path))
    return values


def test_missing_browser_skips_outside_ci_and_fails_in_ci(monkeypatch, tmp_path):
    """The rule a newcomer and CI rely on (README, "The two commands")."""
    monkeypatch.setenv(CHROMIUM_ENV, str(tmp_path / "no-chromium"))
    monkeypatch.delenv(SKIP_ENV, raising=False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="Chromium not found"):
        require_browser()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set, so this test is mandatory"):
        require_browser()
    monkeypatch.setenv(SKIP_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="mandatory"):
        require_browser()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="on purpose"):
        require_browser()


# --------------------------------------------------------------------------------------------
# JupyterLab server
# --------------------------------------------------------------------------------------------


def _http(url: str, method: str = "GET", timeout: float = 5.0) -> int:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status


def _diff(before: bytes, after: bytes) -> str:
    import difflib

    return "".join(difflib.unified_diff(before.decode().splitlines(True), after.decode().splitlines(True),
                                        "before", "after saved", n=1))[:3000]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class LabServer:
    def __init__(self, tmp: Path):
        self.root = tmp / "course"  # as the repository root: notebooks/ and docs/
        for folder in ("notebooks", "docs"):
            shutil.copytree(ROOT / folder, self.root / folder, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.log_path = tmp / "jupyterlab.log"
        settings = tmp / "lab-settings"
        for rel, value in LAB_SETTINGS.items():
            f = settings / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(value))
        self.env = dict(os.environ)
        self.env.update(
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(tmp / "lab-workspaces"),
            JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
            JUPYTER_CONFIG_DIR=str(tmp / "config"),  # no user jupyter_server_config.* applies
            PYTHONUNBUFFERED="1",
        )
        # inherited by the server, its kernels and their DDP workers: finds orphans too
        self.marker = secrets.token_hex(8)
        self.env[MARKER_ENV] = self.marker
        self.proc: subprocess.Popen | None = None
        self.seen: dict[tuple[int, float], psutil.Process] = {}

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "jupyterlab",
            "--no-browser", "--ip=127.0.0.1", f"--port={self.port}", "--port-retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--config={LAB_CONFIG}",  # as the README: the root is the folder it starts in
            "--LabApp.expose_app_in_browser=True",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",  # no PyPI queries from the extension manager
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI and these machines run as root
            cmd.append("--allow-root")
        cmd.append(NB_PATH)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=str(self.root), start_new_session=True)
        self.remember(self.proc.pid)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {self.proc.returncode} while starting:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                if _http(f"{self.base}/api/status?token={self.token}") == 200:
                    return
            time.sleep(0.5)
        pytest.fail(f"jupyter lab did not answer within {SERVER_START_TIMEOUT_S} s:\n{self.log_tail()}")

    def remember(self, pid: int | None = None) -> None:
        """Record the server and every descendant (kernel, DDP workers) seen so far."""
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(pid or self.proc.pid)
            for p in [top, *top.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault((p.pid, p.create_time()), p)

    def marked(self) -> list[psutil.Process]:
        """Every running process whose environment carries this server's marker."""
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get(MARKER_ENV) == self.marker and is_live(p):
                    found.append(p)
        return found

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def shutdown(self) -> list[str]:
        """Shut down through the REST API; returns descriptions of processes still alive after."""
        if self.proc is None:
            return []
        self.remember()
        problems = []
        if self.proc.poll() is None:
            try:
                _http(f"{self.base}/api/shutdown?token={self.token}", method="POST", timeout=30)
            except (OSError, urllib.error.URLError) as e:
                problems.append(f"POST /api/shutdown failed: {e}")
            try:
                self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                problems.append(f"jupyter lab still running {SHUTDOWN_TIMEOUT_S} s after /api/shutdown")
        alive = {(p.pid, p.create_time()): p for p in self.seen.values() if is_live(p)}
        for p in self.marked():
            with contextlib.suppress(psutil.Error):
                alive.setdefault((p.pid, p.create_time()), p)
        alive = list(alive.values())
        if alive:
            _, alive = psutil.wait_procs(alive, timeout=10)
        for p in alive:
            problems.append(f"left behind: pid {p.pid} {_cmd(p)}")
        return problems

    def kill(self) -> None:
        """Last resort (test failed half-way): end everything the server started."""
        if self.proc is not None:
            self.remember()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            for p in [*self.seen.values(), *self.marked()]:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        with contextlib.suppress(Exception):
            self._log.close()


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:160]
    except psutil.Error:
        return "?"


# --------------------------------------------------------------------------------------------
# The test
# --------------------------------------------------------------------------------------------


def _wait_kernel(page, name: str, status: str, timeout_s: float = 180) -> None:
    """Wait until ``name`` is the current notebook and its kernel's status is ``status``."""
    page.wait_for_function(f"(name) => ({JS_KERNEL_STATUS})(name) === {status!r}", arg=name,
                           timeout=timeout_s * 1000)


def _open_in_this_page(page, name: str) -> None:
    """Open notebook ``name`` in the JupyterLab already loaded in ``page`` (a new tab there, as
    opening it from the file browser does), instead of loading the whole application again in
    a second page: each JupyterLab page costs Chromium several CPU-seconds to start and keeps
    polling the server while it stays open."""
    page.evaluate("async (path) => { await window.jupyterapp.commands.execute('docmanager:open', {path}); }", name)


def _current_panel(page):
    """A locator for the notebook panel shown now (JupyterLab's current widget). The checks of a
    notebook look only inside it: the notebooks opened earlier stay open in hidden tabs of the
    same page, their outputs included."""
    widget_id = page.evaluate("() => window.jupyterapp.shell.currentWidget.id")
    return page.locator(f'[id="{widget_id}"]')


def _run_all_cells_via_menu(page) -> None:
    """Menu bar Run > Run All Cells, clicked as a learner would."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^\s*Run\s*$")).click()
    page.locator(".lm-Menu-item:not(.lm-mod-disabled)", has=page.locator(
        ".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$"))).click()


def _wait_run_all_done(page, timeout_s: float, server: LabServer | None = None) -> dict:
    """Poll the notebook until the kernel is idle, no prompt shows [*], and every code cell
    ran (or an error stopped the run). Returns the last state."""
    deadline = time.monotonic() + timeout_s
    state = None
    idle_since = None
    while time.monotonic() < deadline:
        state = page.evaluate(JS_NOTEBOOK_STATE)
        finished = bool(state) and state["kernel"] == "idle" and state["running"] == 0 and (
            state["executed"] == state["code_cells"] or state["errors"])
        if finished:
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= 1.0:  # stable for a second: outputs rendered
                return state
        else:
            idle_since = None
        if server is not None:
            server.remember()  # catch the kernel's DDP workers while they run
        page.wait_for_timeout(500)
    raise AssertionError(f"Run All Cells did not finish within {timeout_s:.0f} s; last state: {state}")


@pytest.mark.slow(90)
@pytest.mark.timeout(RUN_ALL_TIMEOUT_S + SERVER_START_TIMEOUT_S + PX_TIMEOUT_S + 240)
def test_notebook01_runs_in_jupyterlab_ui(tmp_path: Path):
    chromium = require_browser()
    from playwright.sync_api import sync_playwright

    source = NOTEBOOKS_DIR / NB_NAME
    digest_before = _sha256(source)
    BUILD_DIR.mkdir(exist_ok=True)
    for shot in (SCREENSHOT, SCREENSHOT_RANKS, SCREENSHOT_PX):
        shot.unlink(missing_ok=True)
    baseline = {p.pid for p in leftover_processes()}
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    server = LabServer(tmp_path)
    copy = server.root / NB_PATH
    inject_browser_parameters(copy)
    opened = {p: p.read_bytes() for p in (copy, copy.with_suffix(".py"))}
    n_seen = 0
    try:
        server.start()
        timings["server start"] = time.monotonic() - t0
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 1000})
                page.set_default_timeout(120_000)
                console_errors: list[str] = []
                page.on("pageerror", lambda exc: console_errors.append(str(exc)))
                page.goto(f"{server.base}/lab/tree/{NB_PATH}?reset&token={server.token}")
                _wait_kernel(page, NB_NAME, "idle")
                timings["notebook open, kernel idle"] = time.monotonic() - t0
                server.remember()

                # opened and saved, the lesson is byte-identical: JupyterLab's kernel
                # language_info (with this machine's Python version) does not reach the file
                page.wait_for_function(JS_LANGUAGE_VERSION, timeout=60_000)
                mtime = copy.stat().st_mtime_ns
                page.evaluate("async () => { await window.jupyterapp.commands.execute('docmanager:save'); }")
                assert copy.stat().st_mtime_ns != mtime, "File > Save did not write the notebook"
                for path, before in opened.items():
                    after = path.read_bytes()
                    assert after == before, (f"saving {path.name} in JupyterLab changed it:\n"
                                             + _diff(before, after))

                _run_all_cells_via_menu(page)
                t_run = time.monotonic()
                _wait_kernel(page, NB_NAME, "busy", timeout_s=60)
                server.remember()
                state = _wait_run_all_done(page, RUN_ALL_TIMEOUT_S, server)
                timings["run all cells"] = time.monotonic() - t_run
                server.remember()

                # no error output: in the model (output_type "error") and as rendered tracebacks
                assert not state["errors"], f"cells raised in JupyterLab: {state['errors']}"
                panel = _current_panel(page)
                tracebacks = panel.locator(
                    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]',
                    has_text="Traceback")
                assert tracebacks.count() == 0, (
                    "a traceback is rendered in an output area:\n" + tracebacks.first.inner_text()[:3000])
                assert state["executed"] == state["code_cells"] > 0, f"not every code cell ran: {state}"

                # the figure: an <img> in an output area that actually loaded
                figure = panel.locator(".jp-OutputArea-output img")
                assert figure.count() >= 1, "no figure (<img>) rendered in any output area"
                natural = figure.last.evaluate("img => [img.naturalWidth, img.naturalHeight]")
                assert natural[0] > 100 and natural[1] > 100, f"the figure did not load: {natural}"

                # the workers' output, relayed into the cell with the rank prefix
                ranks = panel.locator(".jp-OutputArea-output", has_text="[rank 0]")
                assert ranks.count() >= 1, "no `[rank 0]` worker output rendered"
                rank_text = ranks.first.inner_text()
                assert "[rank 1]" in rank_text, f"rank 1's output missing:\n{rank_text[:2000]}"

                ranks.first.scroll_into_view_if_needed()
                page.screenshot(path=str(SCREENSHOT_RANKS))
                figure.last.scroll_into_view_if_needed()
                page.wait_for_timeout(300)
                page.screenshot(path=str(SCREENSHOT))
                assert not console_errors, f"uncaught errors in the page: {console_errors}"

                # a glossary link in the lesson's first cell opens the glossary
                link = panel.locator('.jp-RenderedMarkdown a[href*="GLOSSARY.md"]').first
                link.click()
                page.wait_for_function(
                    "(p) => { const w = window.jupyterapp.shell.currentWidget;"
                    " return !!(w && w.context && w.context.path === p); }", arg=GLOSSARY_PATH, timeout=30_000)
                glossary = _current_panel(page)
                glossary.get_by_text("Glossary", exact=False).first.wait_for(timeout=30_000)
                assert "/docs/GLOSSARY.md" not in "".join(
                    ln for ln in server.log_tail(200_000).splitlines() if " 404 " in ln), server.log_tail()

                # self-check: the same detectors do catch an error (a throwaway notebook that raises)
                _make_probe_notebook(server.root / PROBE_NAME)
                _open_in_this_page(page, PROBE_NAME)
                _wait_kernel(page, PROBE_NAME, "idle")
                _run_all_cells_via_menu(page)
                probe = _wait_run_all_done(page, 120)
                server.remember()
                assert [(e["cell"], e["ename"]) for e in probe["errors"]] == [(1, "ValueError")], probe
                assert probe["executed"] < probe["code_cells"], f"cells after the error ran: {probe}"
                probe_tb = _current_panel(page).locator(
                    '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]', has_text="Traceback")
                assert probe_tb.count() == 1 and PROBE_MESSAGE in probe_tb.first.inner_text(), (
                    "the rendered-traceback detector missed the probe's error")

                # warm ranks: a %%px cell in a scratch notebook shows both ranks' output, labelled
                _make_px_notebook(server.root / PX_NAME)
                _open_in_this_page(page, PX_NAME)
                _wait_kernel(page, PX_NAME, "idle")
                t_px = time.monotonic()
                _run_all_cells_via_menu(page)
                px = _wait_run_all_done(page, PX_TIMEOUT_S, server)
                timings["warm ranks + %%px"] = time.monotonic() - t_px
                server.remember()
                assert not px["errors"] and px["executed"] == px["code_cells"], px
                panel = _current_panel(page)
                for r in range(2):
                    out = panel.locator(".jp-OutputArea-output", has_text=f"{PX_MESSAGE} {r} of 2")
                    assert out.count() >= 1, f"rank {r}'s %%px output is not rendered"
                    assert f"[stdout:{r}]" in out.first.inner_text(), out.first.inner_text()[:1000]
                page.screenshot(path=str(SCREENSHOT_PX))
                assert not console_errors, f"uncaught errors in the page: {console_errors}"
            finally:
                browser.close()
        n_seen = len(server.seen)
        problems = server.shutdown()
        assert not problems, "JupyterLab shutdown:\n" + "\n".join(problems) + "\n" + server.log_tail()
    finally:
        server.kill()
        timings["total"] = time.monotonic() - t0
        print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items())
              + f"; processes seen under the server (server, kernels, workers): {n_seen}")

    assert SCREENSHOT.stat().st_size > 10_000 and SCREENSHOT_RANKS.stat().st_size > 10_000
    assert _sha256(source) == digest_before, f"{source} was modified on disk"
    # browser, Playwright's driver, server, kernel and DDP workers all gone
    deadline = time.monotonic() + 10
    left = [p for p in leftover_processes() if p.pid not in baseline]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in leftover_processes() if p.pid not in baseline and is_live(p)]
    assert not left, f"processes left behind: {[(p.pid, _cmd(p)) for p in left]}"

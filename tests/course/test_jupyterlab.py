"""Notebook 01 in a real JupyterLab, driven through its UI by headless Chromium (Playwright).

As a learner: ``jupyter lab --config=jupyter_lab_config.json notebooks/<lesson>`` from the
course's root, open ``01_gradients_dp_vs_ddp.ipynb``, Run > Run All Cells. Checked: opened and
saved, the lesson and its twin keep their bytes (``helpers.jupyter_hooks.pre_save``); every code
cell ran; a figure and the workers' ``[rank 0]`` / ``[rank 1]`` output are rendered; no error
output; a glossary link opens the glossary. Then, in the same page, a scratch notebook that
raises (the detectors must catch it) and one whose ``%%px`` cell shows ``[stdout:0]`` /
``[stdout:1]``. The server is shut down through its REST API; no process it started is left.
Screenshots in ``build/jupyterlab_*.png``. Notebook 01 runs with :data:`BROWSER_PARAMETERS`,
injected as papermill does, other than its defaults (checked). JupyterLab serves temporary
copies of ``notebooks/`` and ``docs/``, with temporary settings, on 127.0.0.1, a free port and a
random token. Chromium: docs/TESTING.md (mandatory where ``CI`` is set, else skipped if missing).
"""

from __future__ import annotations

import contextlib
import difflib
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

import nbformat
import psutil
import pytest

from _support import RANKS_MARK, SKIP_ENV, leftover_processes, marked_processes, require_browser
from ci.site import CHROMIUM_ARGS, CHROMIUM_ENV
from helpers.engine.processes import free_port, is_live

ROOT = Path(__file__).resolve().parents[2]
LAB_CONFIG = ROOT / "jupyter_lab_config.json"  # the README's: root and pre-save hook
NB_NAME = "01_gradients_dp_vs_ddp.ipynb"
NB_PATH = f"notebooks/{NB_NAME}"  # relative to the served root
GLOSSARY_PATH = "docs/GLOSSARY.md"
#: Injected into the temporary copy; must differ from the notebook's defaults (smoke); 01's only
#: parameter is world_size (1, 2 or 4) and the test needs two ranks' output, so it is the full value.
BROWSER_PARAMETERS = {"world_size": 4}
BUILD_DIR = ROOT / "build"
SHOTS = {k: BUILD_DIR / f"jupyterlab_{k}.png" for k in ("nb01", "nb01_ranks", "px")}
#: ci.site's flags and more for a machine without a display, GPU or outside network
BROWSER_ARGS = [*CHROMIUM_ARGS, "--disable-quic", "--disable-sync", "--disable-default-apps",
                "--disable-extensions"]
SERVER_START_TIMEOUT_S, SHUTDOWN_TIMEOUT_S = 180, 60
RUN_ALL_TIMEOUT_S = 600  # notebook 01 takes 30-90 s on 2 busy cores; the rest is slack
PX_TIMEOUT_S = 300  # two engines importing torch on 2 busy cores
#: JupyterLab user settings for a deterministic, quiet, offline UI.
LAB_SETTINGS = {
    # every cell attached to the DOM (the default, contentVisibility, may skip offscreen cells)
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    # no news / update requests (no network here) and no toasts over the notebook
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
}
PROBE_MESSAGE = "deliberate error from tests/course/test_jupyterlab.py"
PX_MESSAGE = "hello from warm rank"
#: scratch notebooks, written into the temporary copy only: one raises, one runs %%px on warm ranks
SCRATCH = {
    # Run All sends every execute request at once; the kernel aborts those queued when the error comes
    # (ipykernel's stop_on_error_timeout=0): the sleep lets the third arrive first on a loaded machine
    "zz_error_probe.ipynb": ['print("before the error")',
                             f"import time\ntime.sleep(1)\nraise ValueError({PROBE_MESSAGE!r})",
                             'print("not reached")'],
    "zz_warm_ranks.ipynb": ["from helpers.engine import start_ranks\nranks = start_ranks(2)",
                            f'%%px\nprint(f"{PX_MESSAGE} {{rank}} of {{world_size}}")'],
}
TRACEBACK = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'

# JavaScript run in the page; `window.jupyterapp` exists thanks to --LabApp.expose_app_in_browser.
#: The notebook shown now: its path, kernel status, language_info's version, code cells, cells
#: executed, errors in the model, prompts showing [*]; null for another widget.
JS_NOTEBOOK_STATE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!w || !w.content || !w.content.model || !w.sessionContext) return null;
  const s = w.sessionContext.session, cells = w.content.model.cells;
  const info = w.content.model.getMetadata('language_info');
  const out = {path: w.context.path, kernel: s && s.kernel ? s.kernel.status : null,
               language: info && info.version ? info.version : null, code_cells: 0, executed: 0,
               errors: [], running: 0};
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type !== 'code') continue;
    out.code_cells += 1;
    if (c.executionCount !== null && c.executionCount !== undefined) out.executed += 1;
    for (let j = 0; j < c.outputs.length; j++) {
      const o = c.outputs.get(j).toJSON();
      if (o.output_type === 'error') out.errors.push({cell: i, ename: o.ename, evalue: o.evalue});
    }
  }
  for (const p of w.node.querySelectorAll('.jp-InputPrompt')) {  // this notebook's prompts only
    if (p.textContent.includes('*')) out.running += 1;
  }
  return out;
}"""


def inject_browser_parameters(path: Path) -> dict:
    """Write :data:`BROWSER_PARAMETERS` into the notebook at ``path`` (a temporary copy) as
    papermill does (an ``injected-parameters`` cell after the ``parameters`` cell), after the
    runner's type checks; returns the values the notebook runs with."""
    import jupytext
    from jupytext.combine import combine_inputs_with_outputs
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    from ci.planning import effective_parameters

    source = ROOT / NB_PATH
    values = effective_parameters(source, "smoke", BROWSER_PARAMETERS)
    assert values != effective_parameters(source, "smoke"), (
        f"the browser test would run {NB_NAME} with its defaults: change BROWSER_PARAMETERS")
    nb = parameterize_notebook(load_notebook_node(str(path)), dict(BROWSER_PARAMETERS))
    nbformat.write(nb, str(path))
    # the twin after the .ipynb (JupyterLab refuses a paired .ipynb newer than its .py that
    # differs from it), then the .ipynb as jupytext reads the pair: a save changes neither
    twin = path.with_suffix(".py")
    jupytext.write(nb, str(twin), fmt="py:percent")
    nb = combine_inputs_with_outputs(jupytext.read(str(twin)), nbformat.read(str(path), 4))
    nbformat.write(nb, str(path))
    return values


def test_missing_browser_skips_outside_ci_and_fails_in_ci(monkeypatch, tmp_path):
    """The rule a newcomer and CI rely on (README, "The two commands")."""
    monkeypatch.setenv(CHROMIUM_ENV, str(tmp_path / "no-chromium"))
    monkeypatch.delenv(SKIP_ENV, raising=False)
    for ci, skip, outcome, match in [
            (None, None, pytest.skip, "Chromium not found"), ("true", "1", pytest.fail, "mandatory"),
            ("true", None, pytest.fail, "CI is set, so this test is mandatory"),
            (None, "1", pytest.skip, "on purpose")]:
        for name, value in (("CI", ci), (SKIP_ENV, skip)):
            if value:
                monkeypatch.setenv(name, value)
            else:
                monkeypatch.delenv(name, raising=False)
        with pytest.raises(outcome.Exception, match=match):
            require_browser("the JupyterLab browser test")


def _http(url: str, method: str = "GET", timeout: float = 5.0) -> int:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:160]
    except psutil.Error:
        return "?"


class LabServer:
    """``jupyter lab`` on a temporary copy of the course; ``seen`` holds every process it started
    (server, kernels, DDP workers); its environment's ``RANKS_MARK`` finds orphans too."""

    def __init__(self, tmp: Path):
        self.root = tmp / "course"  # as the repository root: notebooks/ and docs/
        for folder in ("notebooks", "docs"):
            shutil.copytree(ROOT / folder, self.root / folder,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        self.port, self.token, self.marker = free_port(), secrets.token_hex(16), secrets.token_hex()
        self.log_path = tmp / "jupyterlab.log"
        for rel, value in LAB_SETTINGS.items():
            (tmp / "lab-settings" / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / "lab-settings" / rel).write_text(json.dumps(value))
        self.env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(tmp / "lab-settings"),
                    "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "lab-workspaces"),
                    "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
                    "JUPYTER_CONFIG_DIR": str(tmp / "config"),  # no user config applies
                    "PYTHONUNBUFFERED": "1", RANKS_MARK: self.marker}
        self.proc: subprocess.Popen | None = None
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self.base = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}", "--port-retries=0", f"--IdentityProvider.token={self.token}",
               f"--config={LAB_CONFIG}",  # as the README: the root is the folder it starts in
               "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.extension_manager=readonly"]  # no PyPI queries from the extension manager
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # CI and these machines run as root
            cmd.append("--allow-root")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([*cmd, NB_PATH], stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, cwd=str(self.root), start_new_session=True)
        self.remember()
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"jupyter lab exited with {self.proc.returncode} while starting:\n"
                            + self.log_tail())
            with contextlib.suppress(OSError, urllib.error.URLError):
                if _http(f"{self.base}/api/status?token={self.token}") == 200:
                    return
            time.sleep(0.5)
        pytest.fail(f"jupyter lab did not answer within {SERVER_START_TIMEOUT_S} s:\n{self.log_tail()}")

    def remember(self) -> None:
        """Record the server and every descendant (kernel, DDP workers) seen so far."""
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(self.proc.pid)
            for p in [top, *top.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault((p.pid, p.create_time()), p)

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def shutdown(self) -> list[str]:
        """Shut down through the REST API; returns descriptions of processes still alive after."""
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
        for p in marked_processes(self.marker, ""):
            with contextlib.suppress(psutil.Error):
                alive.setdefault((p.pid, p.create_time()), p)
        _, alive = psutil.wait_procs(list(alive.values()), timeout=10)
        return problems + [f"left behind: pid {p.pid} {_cmd(p)}" for p in alive]

    def kill(self) -> None:
        """Last resort (test failed half-way): end everything the server started."""
        if self.proc is not None:
            self.remember()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            for p in [*self.seen.values(), *marked_processes(self.marker, "")]:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            self._log.close()


def _wait_idle(page, name: str) -> None:
    """Wait until ``name`` is the current notebook and its kernel is idle."""
    page.wait_for_function(f"(name) => {{ const s = ({JS_NOTEBOOK_STATE})(); return !!s && "
                           "s.path.endsWith(name) && s.kernel === 'idle'; }", arg=name,
                           timeout=180_000)


def _current_panel(page):
    """A locator for the panel shown now (JupyterLab's current widget): the notebooks opened
    earlier stay open in hidden tabs of the same page, their outputs included."""
    return page.locator(f'[id="{page.evaluate("() => window.jupyterapp.shell.currentWidget.id")}"]')


def _run_all(page, timeout_s: float, server: LabServer) -> dict:
    """Menu bar Run > Run All Cells, clicked as a learner would; then poll the notebook until the
    kernel is idle, no prompt shows [*], and every code cell ran (or an error stopped the run),
    stable for a second (outputs rendered). Returns the last state."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^\s*Run\s*$")).click()
    page.locator(".lm-Menu-item:not(.lm-mod-disabled)", has=page.locator(
        ".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$"))).click()
    deadline, state, idle_since = time.monotonic() + timeout_s, None, None
    while time.monotonic() < deadline:
        server.remember()  # catch the kernel's DDP workers while they run
        state = page.evaluate(JS_NOTEBOOK_STATE)
        if state and state["kernel"] == "idle" and state["running"] == 0 and (
                state["executed"] == state["code_cells"] or state["errors"]):
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since >= 1.0:
                return state
        else:
            idle_since = None
        page.wait_for_timeout(500)
    raise AssertionError(f"Run All Cells did not finish within {timeout_s:.0f} s; last state: {state}")


def _run_scratch(page, server: LabServer, name: str, timeout_s: float) -> tuple[dict, object]:
    """Write scratch notebook ``name`` (:data:`SCRATCH`), open it in this page (a new tab, as the
    file browser does: a second page would cost Chromium seconds to start), run all its cells."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in SCRATCH[name]])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, str(server.root / name))
    page.evaluate("async (path) => { await window.jupyterapp.commands.execute("
                  "'docmanager:open', {path}); }", name)
    _wait_idle(page, name)
    return _run_all(page, timeout_s, server), _current_panel(page)


@pytest.mark.slow(90)
@pytest.mark.timeout(RUN_ALL_TIMEOUT_S + SERVER_START_TIMEOUT_S + PX_TIMEOUT_S + 240)
def test_notebook01_runs_in_jupyterlab_ui(tmp_path: Path):
    chromium = require_browser("the JupyterLab browser test")
    from playwright.sync_api import sync_playwright

    source_bytes = (ROOT / NB_PATH).read_bytes()
    BUILD_DIR.mkdir(exist_ok=True)
    for shot in SHOTS.values():
        shot.unlink(missing_ok=True)
    baseline = {p.pid for p in leftover_processes()}
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    server = LabServer(tmp_path)
    copy = server.root / NB_PATH
    inject_browser_parameters(copy)
    opened = {p: p.read_bytes() for p in (copy, copy.with_suffix(".py"))}
    try:
        server.start()
        timings["server start"] = time.monotonic() - t0
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, headless=True, args=BROWSER_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 1000})
                page.set_default_timeout(120_000)
                console_errors: list[str] = []
                page.on("pageerror", lambda exc: console_errors.append(str(exc)))
                page.goto(f"{server.base}/lab/tree/{NB_PATH}?reset&token={server.token}")
                _wait_idle(page, NB_NAME)
                timings["notebook open, kernel idle"] = time.monotonic() - t0

                # opened and saved, the lesson is byte-identical: JupyterLab's kernel
                # language_info (with this machine's Python version) does not reach the file
                page.wait_for_function(f"() => {{ const s = ({JS_NOTEBOOK_STATE})();"
                                       " return s && s.language; }", timeout=60_000)
                mtime = copy.stat().st_mtime_ns
                page.evaluate("async () => { await window.jupyterapp.commands.execute("
                              "'docmanager:save'); }")
                assert copy.stat().st_mtime_ns != mtime, "File > Save did not write the notebook"
                for path, before in opened.items():
                    after = path.read_bytes()
                    diff = difflib.unified_diff(before.decode().splitlines(True),
                                                after.decode().splitlines(True), n=1)
                    assert after == before, f"saving {path.name} changed it:\n{''.join(diff)[:3000]}"

                t_run = time.monotonic()
                state = _run_all(page, RUN_ALL_TIMEOUT_S, server)
                timings["run all cells"] = time.monotonic() - t_run
                # no error output: in the model (output_type "error") and as rendered tracebacks
                assert not state["errors"], f"cells raised in JupyterLab: {state['errors']}"
                panel = _current_panel(page)
                tracebacks = panel.locator(TRACEBACK, has_text="Traceback")
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
                page.screenshot(path=str(SHOTS["nb01_ranks"]))
                figure.last.scroll_into_view_if_needed()
                page.wait_for_timeout(300)
                page.screenshot(path=str(SHOTS["nb01"]))

                # a glossary link in the lesson's first cell opens the glossary
                panel.locator('.jp-RenderedMarkdown a[href*="GLOSSARY.md"]').first.click()
                page.wait_for_function(
                    "(p) => { const w = window.jupyterapp.shell.currentWidget;"
                    " return !!(w && w.context && w.context.path === p); }", arg=GLOSSARY_PATH,
                    timeout=30_000)
                _current_panel(page).get_by_text("Glossary").first.wait_for(timeout=30_000)
                not_found = [ln for ln in server.log_tail(200_000).splitlines() if " 404 " in ln]
                assert "/docs/GLOSSARY.md" not in "".join(not_found), server.log_tail()

                # self-check: the same detectors do catch an error (a throwaway notebook that raises)
                probe, panel = _run_scratch(page, server, "zz_error_probe.ipynb", 120)
                assert [(e["cell"], e["ename"]) for e in probe["errors"]] == [(1, "ValueError")], probe
                assert probe["executed"] < probe["code_cells"], f"cells after the error ran: {probe}"
                probe_tb = panel.locator(TRACEBACK, has_text="Traceback")
                assert probe_tb.count() == 1 and PROBE_MESSAGE in probe_tb.first.inner_text(), (
                    "the rendered-traceback detector missed the probe's error")

                # warm ranks: a %%px cell in a scratch notebook shows both ranks' output, labelled
                t_px = time.monotonic()
                px, panel = _run_scratch(page, server, "zz_warm_ranks.ipynb", PX_TIMEOUT_S)
                timings["warm ranks + %%px"] = time.monotonic() - t_px
                assert not px["errors"] and px["executed"] == px["code_cells"], px
                for r in range(2):
                    out = panel.locator(".jp-OutputArea-output", has_text=f"{PX_MESSAGE} {r} of 2")
                    assert out.count() >= 1, f"rank {r}'s %%px output is not rendered"
                    assert f"[stdout:{r}]" in out.first.inner_text(), out.first.inner_text()[:1000]
                page.screenshot(path=str(SHOTS["px"]))
                assert not console_errors, f"uncaught errors in the page: {console_errors}"
            finally:
                browser.close()
        problems = server.shutdown()
        assert not problems, "JupyterLab shutdown:\n" + "\n".join(problems) + "\n" + server.log_tail()
    finally:
        server.kill()
        print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items())
              + f", total {time.monotonic() - t0:.1f}; processes seen under the server "
              f"(server, kernels, workers): {len(server.seen)}")

    assert all(SHOTS[k].stat().st_size > 10_000 for k in ("nb01", "nb01_ranks"))
    assert (ROOT / NB_PATH).read_bytes() == source_bytes, f"{NB_PATH} was modified on disk"
    # browser, Playwright's driver, server, kernel and DDP workers all gone
    deadline = time.monotonic() + 10
    left = [p for p in leftover_processes() if p.pid not in baseline]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in leftover_processes() if p.pid not in baseline and is_live(p)]
    assert not left, f"processes left behind: {[(p.pid, _cmd(p)) for p in left]}"

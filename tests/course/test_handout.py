"""A course an instructor can hand out (issue 29, part 6): the JupyterLab config the README starts,
its pre-save hook, and docs/TEACHING.md's agendas generated from the measured run times."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import nbformat
import pytest

from ci import agenda, marked
from helpers import jupyter_hooks
from helpers import lessons as manifest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "jupyter_lab_config.json"


def test_readme_starts_jupyterlab_at_the_root_with_the_config():
    """Served root = the repository root (so ../docs/GLOSSARY.md resolves), lesson 00 opened,
    the pre-save hook loaded."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"^python3 -m jupyter lab (.+)$", readme, re.M)
    assert command, "README: no `python3 -m jupyter lab ...` line"
    args = command.group(1).split()
    assert f"--config={CONFIG.name}" in args, args
    assert args[-1] == f"notebooks/{manifest.stems()[0]}.ipynb", "it opens the first lesson"
    config = json.loads(CONFIG.read_text())
    assert config["ServerApp"]["root_dir"] == ".", "the folder it starts in, not the notebook's folder"
    assert config["ServerApp"]["ip"] == "127.0.0.1", "loopback only, whatever a user config says"
    assert config["ContentsManager"]["pre_save_hook"] == "helpers.jupyter_hooks.pre_save"


@pytest.mark.slow(10)
def test_the_readme_jupyterlab_asks_no_news_question(tmp_path):
    """The README's JupyterLab (its config, started from the repository root) shows learners no
    "Would you like to get notified about official Jupyter news?" toast and checks for no update:
    the repository's settings overrides (helpers/jupyterlab/overrides.json, the config's
    ``app_settings_dir``) turn both off. Read back from the running server's settings API, where
    overrides replace the schema's defaults (``fetchNews`` is ``"none"`` there without them: ask)."""
    from helpers.engine import free_port

    port, token = free_port(), "t"
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "HOME": str(tmp_path)}
    cmd = [sys.executable, "-m", "jupyter", "lab", f"--config={CONFIG.name}", "--no-browser", f"--port={port}",
           f"--IdentityProvider.token={token}"] + (["--allow-root"] if os.geteuid() == 0 else [])
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:notification?token={token}"
    try:
        deadline, reply = time.monotonic() + 90, None
        while reply is None and time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    reply = json.load(r)
            except OSError:
                time.sleep(0.5)
        assert reply is not None, f"JupyterLab did not answer on port {port} (exit code {server.poll()})"
        defaults = {k: reply["schema"]["properties"][k]["default"] for k in ("fetchNews", "checkForUpdates")}
        assert defaults == {"fetchNews": "false", "checkForUpdates": False}, defaults
    finally:
        server.terminate()
        server.wait(30)


def test_pre_save_drops_the_python_version_and_keeps_the_twins_jupytext_version(tmp_path):
    committed = ROOT / "notebooks" / f"{manifest.stems()[0]}.ipynb"
    nb = nbformat.read(str(committed), as_version=4)
    nb.metadata["language_info"] = {**jupyter_hooks.LANGUAGE_INFO, "version": "3.12.1"}  # what JupyterLab sends
    model = {"type": "notebook", "content": json.loads(nbformat.writes(nb))}
    jupyter_hooks.pre_save(model=model, path="notebooks/x.ipynb", contents_manager=None)
    saved = nbformat.writes(nbformat.from_dict(model["content"])) + "\n"
    assert saved == committed.read_text(encoding="utf-8"), "a save must write the committed bytes"

    twin = committed.with_suffix(".py").read_text(encoding="utf-8")
    (tmp_path / "t.py").write_text(twin, encoding="utf-8")
    other = re.sub(r"jupytext_version: .*", "jupytext_version: 1.16.0", twin, count=1)
    assert other != twin
    model = {"type": "file", "format": "text", "content": other}
    jupyter_hooks.pre_save(model=model, path="t.py", contents_manager=SimpleNamespace(
        _get_os_path=lambda path: str(tmp_path / path)))  # the one method the hook calls
    assert model["content"] == twin


def test_teaching_agendas_are_generated_from_the_recorded_times():
    """Up to date: test_generate.py's test_every_generated_text_is_up_to_date."""
    text = (ROOT / "docs" / "TEACHING.md").read_text(encoding="utf-8")
    block = marked.between(text, agenda.START, agenda.END)
    assert "**3 hours: the workshop path**" in block and "**The whole course, day 1**" in block and "day 2**" in block
    for stem in manifest.stems():
        assert f"| {stem} |" in block, stem
    assert "python3 -m helpers.doctor" in text and "python3 -m ci.student_copies" in text


def test_agenda_slots_come_from_words_and_exercises(tmp_path):
    """A slot is computed, not typed: more prose or another exercise lengthens it, in 5-min steps."""
    import nbformat

    stem = manifest.stems()[0]
    nb = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    nbformat.write(nb, tmp_path / f"{stem}.ipynb")
    (row,) = agenda.slots([stem], tmp_path)
    assert row["slot_min"] % 5 == 0 and row["slot_min"] >= row["exercises"] * agenda.MIN_PER_EXERCISE > 0
    nb.cells.append(nbformat.v4.new_markdown_cell("### Exercise 9: more\n\n" + "word " * 1000))
    nbformat.write(nb, tmp_path / f"{stem}.ipynb")
    (longer,) = agenda.slots([stem], tmp_path)
    assert longer["exercises"] == row["exercises"] + 1 and longer["slot_min"] >= row["slot_min"] + 10

"""The Python matrix: the smoke subset of the tests (``pytest -m matrix``) on each Python.

Usage (from the repository root)::

    python3 -m ci.matrix [--versions 3.10 3.11 3.12 3.13] [--venvs DIR] [--output docs/MATRIX.md]

For each version: the interpreter running this script if it is that version (its installed
requirements are used as they are), else a venv ``DIR/pyXY`` (default: ``venvs`` beside the
repository), made from pyenv's ``$(pyenv root)/versions/X.Y.*`` or ``pythonX.Y`` on PATH when
missing, with ``requirements.lock`` installed less its ``-e .`` line (``PYTHONPATH`` points at this
repository instead); installed again only when the lock changed. Then that interpreter
runs ``python -m pytest -m matrix -n 0`` with ``PYTHONPATH`` = the repository root, so its
papermill kernels (kernel ``python3``: jupyter_client runs it with the interpreter that runs
papermill) and its ranks are that Python too. Writes a Markdown table (date, Python, torch,
IPython, command, passed/failed/skipped, seconds) to ``--output``; exit 0 only when every version passed.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ["3.10", "3.11", "3.12", "3.13"]
PYTEST = ["-m", "pytest", "-m", "matrix", "-n", "0", "-q", "-p", "no:cacheprovider"]


def find_interpreter(version: str) -> str:
    """An interpreter of ``version`` (``"3.12"``): pyenv's newest patch release, else ``python3.12``."""
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = Path(subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip())
        found = sorted((root / "versions").glob(f"{version}.*/bin/python3"),
                       key=lambda p: [int(x) for x in p.parent.parent.name.split(".") if x.isdigit()])
        if found:
            return str(found[-1])
    exe = shutil.which(f"python{version}")
    if exe:
        return exe
    raise SystemExit(f"error: no Python {version} found (pyenv install {version}, or put python{version} on PATH)")


def ensure_venv(version: str, venvs: Path) -> str:
    """The python of ``venvs/pyXY`` with requirements.lock installed (made or updated as needed)."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == version:
        return sys.executable
    venv = venvs / f"py{version.replace('.', '')}"
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"[{version}] making {venv}", flush=True)
        subprocess.run([find_interpreter(version), "-m", "venv", str(venv)], check=True)
    lines = [line for line in (ROOT / "requirements.lock").read_text().splitlines() if not line.startswith("-e")]
    wanted = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    stamp = venv / "requirements.sha256"
    if not stamp.exists() or stamp.read_text().strip() != wanted:
        print(f"[{version}] pip install -r requirements.lock (less -e .) into {venv}", flush=True)
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("\n".join(lines) + "\n")
        try:
            subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", f.name], check=True)
        finally:
            os.unlink(f.name)
        stamp.write_text(wanted + "\n")
    return str(python)


def run_subset(python: str, extra: list[str]) -> dict:
    """Run the smoke subset under ``python``; counts from pytest's JUnit XML, wall seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "PATH": os.pathsep.join([str(Path(python).parent), os.environ["PATH"]])}  # its jupyter-lab first
        info = subprocess.run([python, "-c", "import platform, importlib.metadata as m; "
                               "print(platform.python_version(), m.version('torch'), m.version('ipython'))"],
                              capture_output=True, text=True, env=env, check=True).stdout.split()
        start = time.monotonic()
        proc = subprocess.run([python, *PYTEST, f"--junitxml={xml}", *extra], cwd=ROOT, env=env)
        seconds = time.monotonic() - start
        suite = ET.parse(xml).getroot() if xml.exists() else None
    suite = suite.find("testsuite") if suite is not None and suite.tag == "testsuites" else suite
    count = (lambda k: int(suite.get(k, 0))) if suite is not None else (lambda k: 0)
    failed = count("failures") + count("errors")
    failures = [f"{c.get('classname')}::{c.get('name')}" for c in (suite if suite is not None else [])
                if c.find("failure") is not None or c.find("error") is not None]
    return {"python": info[0], "torch": info[1], "ipython": info[2], "rc": proc.returncode, "failed": failed,
            "skipped": count("skipped"), "passed": count("tests") - failed - count("skipped"), "seconds": seconds,
            "failures": failures, "command": f"PYTHONPATH=. {python} {' '.join(PYTEST + extra)}"}


def write_report(rows: list[dict], path: Path, total_s: float, argv: list[str]) -> None:
    ok = all(r["rc"] == 0 for r in rows)
    lines = [
        "# Python matrix", "",
        f"Made by `python3 -m ci.matrix{' ' + ' '.join(argv) if argv else ''}` on "
        f"{datetime.date.today().isoformat()}, {platform.system()} {platform.machine()}, {os.cpu_count()} cores: "
        f"**{'all green' if ok else 'NOT green'}** in {total_s:.0f} s (venvs made or updated included).",
        "",
        "The smoke subset is the tests marked `matrix` (`python3 -m pytest --co -q -m matrix` lists them). Each row "
        "ran its own interpreter (its venv: requirements.lock) with `PYTHONPATH` = the repository root; its "
        "notebook kernels and ranks are that interpreter too (`test_kernel_is_the_interpreter_running_the_tests`).", "",
        "| Python | torch | IPython | passed | failed | skipped | seconds | command |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {r['python']} | {r['torch']} | {r['ipython']} | {r['passed']} | {r['failed']} | "
              f"{r['skipped']} | {r['seconds']:.0f} | `{r['command']}` |" for r in rows]
    for r in (r for r in rows if r["rc"] != 0):
        lines += ["", f"Python {r['python']}: pytest exit {r['rc']}; failed: "
                  + (", ".join(f"`{f}`" for f in r["failures"]) or "(no test report)")]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ci.matrix", description=__doc__.split("\n\n")[0],
                                     epilog="Arguments after -- go to pytest.")
    parser.add_argument("--versions", nargs="+", default=VERSIONS, metavar="X.Y")
    parser.add_argument("--venvs", type=Path, default=ROOT.parent / "venvs", help="folder of the pyXY venvs")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "MATRIX.md")
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    start = time.monotonic()
    pythons = [ensure_venv(v, args.venvs) for v in args.versions]  # every install before any test
    rows = []
    for version, python in zip(args.versions, pythons):
        print(f"[{version}] {python}: pytest -m matrix", flush=True)
        rows.append(run_subset(python, extra))
    write_report(rows, args.output, time.monotonic() - start, argv)
    for r in rows:
        print(f"Python {r['python']} torch {r['torch']}: {r['passed']} passed, {r['failed']} failed, "
              f"{r['skipped']} skipped in {r['seconds']:.0f} s")
    print(f"wrote {args.output}")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Drift: the newest versions requirements.txt allows, without the lock, under the fast tests.

Usage (from the repository root)::

    python3 -m ci.drift [--python PYTHON] [-- pytest arguments; default: -m "not slow"]

Makes a throwaway venv of ``PYTHON`` (default: the Python under this one's venv), installs
``requirements.txt`` into it with pip (each package's newest allowed version, as a learner would
get without ``requirements.lock``), runs the tests there (the venv activated, as the README does),
then prints which installed versions differ from the lock's pins for that Python and whether the
tests passed. Exit status: pytest's.
A release of IPython, ipykernel or ipyparallel that breaks the course shows up here before a
lock refresh (``python3 -m ci.lock --upgrade``) takes it (docs/TESTING.md, "The lock and drift").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: In the venv: ``{package: [lock's pin, installed version]}`` where they differ (``null``: none).
COMPARE = r"""
import json, sys
from importlib.metadata import distributions
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon
have = {canon(d.metadata["Name"]): d.version for d in reversed(list(distributions()))}  # the first on sys.path
pins = {}
for line in open(sys.argv[1]):
    if line[:1].isalnum():
        r = Requirement(line.split("#")[0].strip())
        if r.marker is None or r.marker.evaluate():
            pins[canon(r.name)] = str(r.specifier)[2:]
names = (set(pins) | set(have)) - {"pip", "setuptools", "wheel", "ddp-lab"}
print(json.dumps({n: [pins.get(n), have.get(n)] for n in sorted(names) if pins.get(n) != have.get(n)}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ci.drift", description=__doc__.split("\n\n")[0],
                                     epilog="Arguments after -- go to pytest.")
    parser.add_argument("--python", default=getattr(sys, "_base_executable", sys.executable),
                        help="the interpreter of the throwaway venv")
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    extra = extra or ["-m", "not slow"]
    with tempfile.TemporaryDirectory(prefix="ddp-lab-drift-") as tmp:
        subprocess.run([args.python, "-m", "venv", tmp], check=True)
        python = str(Path(tmp) / "bin" / "python")
        print(f"drift: pip install -r requirements.txt (no lock) into a throwaway venv of {args.python}", flush=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", "requirements.txt"],
                       cwd=ROOT, check=True)
        differ = json.loads(subprocess.run([python, "-c", COMPARE, str(ROOT / "requirements.lock")], cwd=ROOT,
                                           capture_output=True, text=True, check=True).stdout)
        version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        activated = {**os.environ, "VIRTUAL_ENV": tmp, "PATH": os.pathsep.join([str(Path(python).parent),
                                                                                os.environ["PATH"]])}
        tests = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra], cwd=ROOT,
                               env=activated)
    print(f"\ndrift on Python {version}: {len(differ)} packages differ from requirements.lock (lock -> newest)")
    for name, (pinned, newest) in differ.items():
        print(f"  {name}: {pinned or 'not in the lock'} -> {newest or 'not installed'}")
    verdict = "passed" if tests.returncode == 0 else f"FAILED (pytest exit {tests.returncode})"
    print(f"tests ({' '.join(extra)}): {verdict}")
    return tests.returncode


if __name__ == "__main__":
    sys.exit(main())

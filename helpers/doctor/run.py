"""The doctor's order of checks, their time limits, the table and ``main``."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable

from helpers import REPO_ROOT
from helpers.doctor import checks, kernel
from helpers.doctor.common import _INTERRUPT_GRACE_S, REINSTALL, TUTORIAL_PORTS, Check, Failed, _error_line

CHECKS = [
    Check("python", checks.check_python, 10),
    Check("torch", checks.check_torch, 120, fix=REINSTALL),
    Check("MNIST", checks.check_mnist, 180, needs=("torch",)),
    Check("ports", checks.check_ports, 20),
    Check("memory", checks.check_memory, 10),
    Check("launch", checks.check_launch, 180, needs=("torch",)),
    Check("mp", checks.check_mp, 180, needs=("torch",)),
    Check("simulate", checks.check_simulate, 120, needs=("torch",)),
    Check("warm ranks", checks.check_warm_ranks, 300, needs=("torch",)),
    Check("JupyterLab", kernel.check_jupyterlab, 60),
    Check("kernel", kernel.check_kernel, 180),
    Check("cell code", kernel.check_cell_code, 240, needs=("torch", "kernel")),
    Check("DataLoader", kernel.check_dataloader, 240, needs=("torch", "kernel")),
    Check("shm", checks.check_shm, 10),
]
_BY_KEY = {c.name.lower().replace(" ", ""): c for c in CHECKS}


# ---- running them ----------------------------------------------------------------------------

class _Deadline:
    """SIGINT to this process when a check runs past ``seconds`` (the helpers end their processes
    on ``KeyboardInterrupt``); if it still runs ``grace`` seconds later, ``on_hang`` ends the
    doctor."""

    def __init__(self, seconds: float, grace: float, on_hang: Callable[[], None]):
        self.seconds, self.grace, self.on_hang, self.fired = seconds, grace, on_hang, False
        self._done = threading.Event()

    def _watch(self) -> None:
        if self._done.wait(self.seconds):
            return
        self.fired = True
        os.kill(os.getpid(), signal.SIGINT)
        if not self._done.wait(self.grace):
            self.on_hang()

    def __enter__(self):
        threading.Thread(target=self._watch, name="doctor-deadline", daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        return False


class Doctor:
    """Runs the checks in order and prints the table (to ``out``)."""

    def __init__(self, data_root: str, ports: list[int], only: set[str] | None, out=None,
                 time_limit: float | None = None, shm: str = "/dev/shm"):
        self.data_root = data_root
        self.shm = shm
        self.time_limit = time_limit
        self.ports = ports
        self.free_fixed_ports = list(ports)
        self.out = out or sys.stdout
        self.kernel: kernel.DoctorKernel | None = None
        self.current: Check | None = None
        self.results: dict[str, tuple[bool, str, str]] = {}
        selected = [c for c in CHECKS if only is None or c.name.lower().replace(" ", "") in only]
        wanted = {c.name for c in selected} | {n for c in selected for n in c.needs if n == "kernel"}
        self.checks = [c for c in CHECKS if c.name in wanted]

    def limit(self, check: Check) -> float:
        """A check's time limit in seconds: its own, capped by ``--time-limit``."""
        return check.timeout_s if self.time_limit is None else min(check.timeout_s, self.time_limit)

    def inner_timeout(self, name: str) -> float:
        """The time limit a check passes to a helper (``launch(timeout=)``...): below its own."""
        limit = self.limit(_BY_KEY[name.lower().replace(" ", "")])
        return max(0.75 * limit, limit - 30.0)

    def line(self, ok: bool, name: str, detail: str, fix: str = "") -> None:
        print(f"{'ok' if ok else 'FAIL':<4}  {name:<10}  {detail}", file=self.out, flush=True)
        if not ok:
            print(f"{'':<4}  {'':<10}  fix: {fix}", file=self.out, flush=True)

    def header(self) -> None:
        print("ddp-lab doctor: can this machine run the notebooks?", file=self.out)
        cores = os.cpu_count() or 1
        try:
            import psutil

            vm = psutil.virtual_memory()
            mem = f"{vm.total / 2**30:.1f} GiB memory ({vm.available / 2**30:.1f} GiB available)"
        except Exception:  # noqa: BLE001
            mem = "memory unknown (psutil missing)"
        print(f"{'':<4}  {'platform':<10}  {platform.platform()}; {cores} CPU cores, {mem}",
              file=self.out, flush=True)

    def _hang(self) -> None:
        """A check did not stop after its SIGINT: kill what this process started, report, exit 1."""
        name = self.current.name if self.current else "?"
        self.line(False, name, "still running after its time limit and an interrupt: the doctor stopped here",
                  "rerun on an idle machine; if it persists, send this output to the instructor")
        with contextlib.suppress(Exception):
            import psutil

            from helpers.engine.internal import end_processes

            end_processes(psutil.Process().children(recursive=True), terminate=False)
        os._exit(1)

    def run_one(self, check: Check) -> None:
        blocked = [n for n in check.needs if n in self.results and not self.results[n][0]]
        if blocked:
            self._record(check, False, f"needs {' and '.join(blocked)}, which failed above",
                         f"fix the {blocked[0]} line first")
            return
        self.current = check
        captured = io.StringIO()  # what the helpers and ranks print; the table stays compact
        t0 = time.monotonic()
        limit = self.limit(check)
        deadline = _Deadline(limit, min(_INTERRUPT_GRACE_S, max(5.0, limit)), self._hang)
        try:
            with deadline, contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")
                detail = check.run(self)
        except KeyboardInterrupt:
            if not deadline.fired:
                raise
            self._record(check, False, f"no answer within {limit:g} s (interrupted; its processes ended)",
                         "close heavy programs and rerun; if it persists, send this output to the instructor")
        except Failed as f:
            self._record(check, False, f.detail, f.fix or check.fix or REINSTALL)
        except Exception as e:  # noqa: BLE001 - a fix line, never a traceback
            self._record(check, False, _error_line(e),
                         check.fix or f"{REINSTALL}, rerun; if it persists, send this output to the instructor")
        else:
            seconds = time.monotonic() - t0
            self._record(check, True, f"{detail} ({seconds:.1f} s)" if seconds >= 1 else detail)
        finally:
            self.current = None

    def _record(self, check: Check, ok: bool, detail: str, fix: str = "") -> None:
        self.results[check.name] = (ok, detail, fix)
        self.line(ok, check.name, detail, fix)

    def run(self) -> int:
        self.header()
        try:
            for check in self.checks:
                self.run_one(check)
        except KeyboardInterrupt:
            print("interrupted", file=self.out, flush=True)
            return 130
        finally:
            if self.kernel is not None:
                with contextlib.redirect_stderr(io.StringIO()):
                    self.kernel.close()
        failed = [n for n, (ok, _, _) in self.results.items() if not ok]
        if failed:
            print(f"{len(failed)} of {len(self.results)} checks FAILED ({', '.join(failed)}): apply the fixes, "
                  "then rerun `python3 -m helpers.doctor`", file=self.out, flush=True)
            return 1
        if len(self.results) < len(CHECKS):  # --only: the others were not run
            print(f"all {len(self.results)} checks run ok ({len(CHECKS) - len(self.results)} not run: drop --only "
                  "to check everything)", file=self.out, flush=True)
            return 0
        print(f"all {len(self.results)} checks ok: this machine can run every notebook", file=self.out, flush=True)
        return 0


def _port(text: str) -> int:
    """``--port``'s value: a TCP port, 1 to 65535 (argparse prints the error and exits 2)."""
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a whole number from 1 to 65535 (e.g. 12355, the DDP "
                                         f"tutorial's MASTER_PORT), got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    """``python3 -m helpers.doctor [--data-root PATH] [--port N ...] [--only NAME,...]``; exit code."""
    parser = argparse.ArgumentParser(prog="python3 -m helpers.doctor",
                                     description="A preflight for workshops: can this machine run every notebook?")
    parser.add_argument("--data-root", default=str(REPO_ROOT / "data"),
                        help="MNIST root (holding MNIST/raw), default: the repository's data/")
    parser.add_argument("--port", type=_port, action="append", dest="ports", metavar="N",
                        help="a fixed MASTER_PORT to check (repeatable); default "
                        f"{' and '.join(map(str, TUTORIAL_PORTS))}")
    parser.add_argument("--only", metavar="NAME,...",
                        help=f"run only these checks: {', '.join(_BY_KEY)} (cell code and DataLoader bring kernel)")
    parser.add_argument("--shm", default="/dev/shm", metavar="PATH",
                        help="the shared memory DataLoader workers use (default /dev/shm)")
    parser.add_argument("--time-limit", type=float, metavar="S",
                        help="cap every check's time limit at S seconds (default: each check's own, 10-300 s)")
    args = parser.parse_args(argv)
    if args.time_limit is not None and args.time_limit <= 0:
        parser.error("--time-limit must be a positive number of seconds")
    only = None
    if args.only:
        only = {n.strip().lower().replace(" ", "") for n in args.only.split(",") if n.strip()}
        unknown = only - set(_BY_KEY)
        if unknown:
            parser.error(f"unknown check(s) {', '.join(sorted(unknown))}; known: {', '.join(_BY_KEY)}")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the deadline's SIGINT is a KeyboardInterrupt
    return Doctor(args.data_root, args.ports or list(TUTORIAL_PORTS), only, time_limit=args.time_limit,
                  shm=args.shm).run()

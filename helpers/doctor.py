"""A preflight for workshops: can this machine run every notebook? ``python3 -m helpers.doctor``

Prints the platform, cores and memory, then one line per check, ``ok`` or ``FAIL`` with a
one-line fix, and exits 0 only when every check is ok (1 otherwise; 130 on Ctrl-C). In the
spirit of ``accelerate test`` and ``python -m torch.utils.collect_env``, but it runs what the
notebooks run, through the project's own helpers:

========== =====================================================================================
python     this Python is in the supported range (``requires-python``); where ``helpers`` is from
torch      ``import torch``; versions; gloo / nccl available; GPUs
MNIST      :func:`helpers.data.ensure_mnist` (four files, SHA-256 verified, decompressed so that
           ``torchvision.datasets.MNIST(root, download=True)`` needs no network); torchvision reads them
ports      the fixed ``MASTER_PORT`` of tutorial code (12355: the DDP tutorial; 29500: torchrun's
           default, dist_tuto) is free (``launch`` and warm ranks pick free ports themselves)
launch     a 2-rank gloo ``all_reduce`` through :func:`helpers.launch.launch`
mp         the DDP tutorial's form (``MASTER_ADDR``/``MASTER_PORT`` set in the rank, its own
           ``init_process_group``) through :func:`helpers.mp.spawn`
warm ranks :func:`helpers.ranks.start_ranks` (2 ranks), an ``all_reduce``, ``stop``, nothing left
JupyterLab ``jupyterlab`` importable
kernel     the notebooks' ``python3`` kernel (ipykernel) starts and imports torch and helpers
cell code  a function defined in a kernel cell (``__main__``) runs on 2 ranks through ``launch``
DataLoader a cell-defined ``Dataset`` with ``DataLoader(num_workers=2, persistent_workers=True)``
           inside 2 ranks: every index once per epoch, two epochs
========== =====================================================================================

Every check is bounded: past its time limit the doctor interrupts it (SIGINT, which the helpers
answer by ending their processes, as "interrupt kernel" does) and reports it; a check that does
not stop even then ends the doctor (exit 1) after its processes are killed. ``torch`` is imported
inside the checks, so a broken torch gives a fix line, not a traceback.

Options: ``--data-root PATH`` (the MNIST root, default ``<repo>/data``), ``--port N`` (a fixed
``MASTER_PORT`` to check, repeatable; default 12355 and 29500; the first one free is the one the
``mp`` check uses), ``--only NAME,...`` (run some checks; ``cell code`` and ``DataLoader`` bring
``kernel``), ``--time-limit S`` (cap every check's time limit).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import re
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from helpers import REPO_ROOT

#: Fixed ``MASTER_PORT`` values of the tutorial code learners paste: the DDP tutorial's
#: ``setup()`` (12355) and torchrun's / dist_tuto's default (29500).
TUTORIAL_PORTS = {12355: "the DDP tutorial's MASTER_PORT", 29500: "torchrun's default port, dist_tuto's"}
WORLD_SIZE = 2
EXPECTED = [3.0, 3.0]  # all_reduce of rank + 1 over 2 ranks
REINSTALL = f"`{Path(sys.executable).name} -m pip install -r requirements.txt` from the repository root"
_INTERRUPT_GRACE_S = 60.0  # after the SIGINT at a check's deadline, how long it gets to stop (seconds)


# ---- results ---------------------------------------------------------------------------------

class Failed(Exception):
    """A check failed: ``detail`` says what happened, ``fix`` what to do (one line each)."""

    def __init__(self, detail: str, fix: str):
        super().__init__(detail)
        self.detail, self.fix = detail, fix


@dataclass
class Check:
    name: str
    run: Callable[[Doctor], str]  # returns the ok line's detail, raises Failed (or anything)
    timeout_s: float
    needs: tuple[str, ...] = ()  # checks that must be ok first
    fix: str = ""  # the fix for an unexpected exception


def one_line(text: str, limit: int = 160) -> str:
    """``text`` without ANSI colours, on one line, at most ``limit`` characters."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", str(text))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_line(e: BaseException) -> str:
    """The most telling line of an exception: for a project ``WorkerError``, the rank's own
    exception (``PicklingError: ...``), else ``Type: message``."""
    text = str(e)
    inner = re.search(r"^\s*(\w+(?:Error|Exception)\b:.*)$", text, re.M)
    first = text.strip().splitlines()[0] if text.strip() else ""
    if inner and type(e).__name__ == "WorkerError":
        return one_line(f"{first} -- {inner.group(1)}")
    return one_line(f"{type(e).__name__}: {first}" if first else type(e).__name__)


# ---- the checks ------------------------------------------------------------------------------

def _allreduce(rank: int, world_size: int) -> float:
    """``all_reduce`` of ``rank + 1`` in the default group (3.0 on each of 2 ranks)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()


def _tutorial_worker(rank: int, world_size: int, port: int) -> float:
    """The DDP tutorial's ``setup()`` / work / ``cleanup()``, as a learner pastes it (gloo)."""
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def check_python(doc: Doctor) -> str:
    spec = _requires_python()
    here = platform.python_version()
    import helpers

    where = f"; helpers from {Path(helpers.__file__).parent.parent}"
    if spec:
        try:
            from packaging.specifiers import SpecifierSet
        except ImportError:  # no packaging: only the lower bound, read by hand
            m = re.match(r">=\s*(\d+)\.(\d+)", spec)
            ok = not m or sys.version_info[:2] >= (int(m.group(1)), int(m.group(2)))
        else:
            ok = here in SpecifierSet(spec)
        if not ok:
            raise Failed(f"Python {here} at {sys.executable}; the project needs {spec}",
                         f"install a Python in {spec} (e.g. with pyenv or python.org), then {REINSTALL} with it")
    return f"{here} at {sys.executable} (supported: {spec or '?'}){where}"


def _requires_python() -> str:
    try:
        text = (REPO_ROOT / "pyproject.toml").read_text()
    except OSError:
        from importlib import metadata

        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.metadata("ddp-lab").get("Requires-Python") or ""
        return ""
    m = re.search(r'^requires-python\s*=\s*"([^"]+)"', text, re.M)
    return m.group(1) if m else ""


def check_torch(doc: Doctor) -> str:
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # ImportError, or anything torch raises while importing
        raise Failed(f"`import torch` failed: {_error_line(e)}",
                     f"{REINSTALL} (installs torch for {sys.executable})") from None
    if not dist.is_available() or not dist.is_gloo_available():
        raise Failed(f"torch {torch.__version__} has no torch.distributed with gloo",
                     f"install the torch of requirements.txt: {REINSTALL}")
    nccl = "yes" if dist.is_nccl_available() else "no"
    try:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        gpu = (f"{n} GPU(s): {', '.join(names)}, CUDA {torch.version.cuda}" if n
               else "no GPU (the notebooks use gloo on the CPU)")
    except Exception as e:  # noqa: BLE001 - a broken driver is information, not a failure
        gpu = f"CUDA unusable ({_error_line(e)}): the notebooks run on the CPU with gloo"
    return f"{torch.__version__}; gloo yes, nccl {nccl}; {gpu}"


def check_mnist(doc: Doctor) -> str:
    from helpers.data import MNIST_FILES, MNISTDataError, ensure_mnist

    raw = Path(doc.data_root) / "MNIST" / "raw"
    try:
        root = ensure_mnist(doc.data_root)
    except MNISTDataError as e:
        missing = [s.name for s in MNIST_FILES.values()
                   if not (raw / s.name).is_file() and not (raw / (s.name + ".gz")).is_file()]
        if missing:
            raise Failed(f"{len(missing)} of 4 MNIST files missing in {raw}",
                         "restore them: `git checkout -- data/MNIST/raw` in the repository (elsewhere: copy the "
                         f"repository's data/MNIST/raw/*.gz into {raw})") from None
        raise Failed(one_line(str(e).split(". ")[0]), one_line(str(e), 300)) from None
    import torchvision

    test = torchvision.datasets.MNIST(root=str(root), train=False, download=False)
    if len(test) != 10_000:
        raise Failed(f"torchvision reads {len(test)} test images from {raw}, expected 10000",
                     "delete the decompressed files (not the .gz) in data/MNIST/raw and rerun the doctor")
    return (f"4 files verified (SHA-256) in {raw}; "
            "torchvision.datasets.MNIST(root, download=True) needs no network")


def _port_holder(port: int) -> str:
    """``pid N (name)`` of the process listening on ``port``, or ``another program``."""
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
    except Exception:  # noqa: BLE001 - macOS needs root for this; the port is held all the same
        pass
    return "another program"


def port_is_free(port: int) -> bool:
    """True when a listener could bind ``port`` on every interface now (as ``TCPStore`` does;
    ``SO_REUSEADDR``: a port in ``TIME_WAIT`` after a finished run counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def check_ports(doc: Doctor) -> str:
    held = [p for p in doc.ports if not port_is_free(p)]
    doc.free_fixed_ports = [p for p in doc.ports if p not in held]
    if held:
        p = held[0]
        what = TUTORIAL_PORTS.get(p, "a fixed MASTER_PORT")
        raise Failed(f"port {p} ({what}) is held by {_port_holder(p)}"
                     + (f"; also held: {', '.join(map(str, held[1:]))}" if held[1:] else ""),
                     f"stop that program, or set MASTER_PORT to another number in tutorial code (e.g. "
                     f"os.environ['MASTER_PORT'] = '{p + 1}'); launch and warm ranks pick free ports themselves")
    names = ", ".join(f"{p} ({TUTORIAL_PORTS[p]})" if p in TUTORIAL_PORTS else str(p) for p in doc.ports)
    return f"free: {names}"


def _helper_failure(e: BaseException, what: str) -> Failed:
    """A failure of the project's own machinery, with the fix that fits its kind."""
    name = type(e).__name__
    if name in ("LaunchTimeout", "RanksTimeout"):
        return Failed(f"{what}: {_error_line(e)}",
                      "ranks talk over 127.0.0.1: allow local connections (firewall, VPN), close heavy programs, rerun")
    if "EADDRINUSE" in str(e) or "address already in use" in str(e).lower():
        return Failed(f"{what}: {_error_line(e)}", "a port was taken meanwhile: rerun the doctor")
    return Failed(f"{what}: {_error_line(e)}",
                  f"{REINSTALL}, rerun; if it persists, send this output to the instructor")


def check_launch(doc: Doctor) -> str:
    from helpers.launch import launch

    try:
        got = launch(_allreduce, WORLD_SIZE, backend="gloo", timeout=doc.inner_timeout("launch"))
    except Exception as e:  # noqa: BLE001
        raise _helper_failure(e, "launch") from None
    if got != EXPECTED:
        raise Failed(f"all_reduce gave {got}, expected {EXPECTED}", f"{REINSTALL}, rerun")
    return f"2-rank gloo all_reduce through helpers.launch.launch: {got}"


def check_mp(doc: Doctor) -> str:
    import helpers.mp as mp
    from helpers.procs import free_port

    fixed = [p for p in doc.free_fixed_ports if port_is_free(p)]
    port, note = (fixed[0], "") if fixed else (free_port(), " (a free port: the fixed ones are held)")
    try:
        got = mp.spawn(_tutorial_worker, args=(WORLD_SIZE, port), nprocs=WORLD_SIZE,
                       timeout=doc.inner_timeout("mp"))
    except Exception as e:  # noqa: BLE001
        raise _helper_failure(e, "helpers.mp.spawn") from None
    if got != EXPECTED:
        raise Failed(f"all_reduce gave {got}, expected {EXPECTED}", f"{REINSTALL}, rerun")
    return f"the DDP tutorial's setup() through helpers.mp.spawn, MASTER_PORT {port}{note}: {got}"


def check_warm_ranks(doc: Doctor) -> str:
    from helpers.procs import leftover_children
    from helpers.ranks import start_ranks

    ranks = None
    try:
        ranks = start_ranks(WORLD_SIZE, backend="gloo", timeout=doc.inner_timeout("warm ranks"), activate=False)
        got = ranks.run(_allreduce)
    except Exception as e:  # noqa: BLE001
        raise _helper_failure(e, "warm ranks") from None
    finally:
        if ranks is not None:
            ranks.stop()
    if got != EXPECTED:
        raise Failed(f"all_reduce gave {got}, expected {EXPECTED}", f"{REINSTALL}, rerun")
    deadline = time.monotonic() + 10
    while (left := [p for p in leftover_children() if "ipyparallel" in " ".join(_cmdline(p))]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        raise Failed(f"stop() left {len(left)} ipyparallel process(es): {', '.join(str(p.pid) for p in left)}",
                     "send this output to the instructor (a bug in helpers.ranks); kill those pids")
    return f"start_ranks({WORLD_SIZE}), all_reduce {got}, stop(), nothing left running"


def _cmdline(p) -> list[str]:
    try:
        return p.cmdline()
    except Exception:  # noqa: BLE001
        return []


def check_jupyterlab(doc: Doctor) -> str:
    try:
        import jupyterlab
        import jupyterlab.labapp  # noqa: F401 - what `jupyter lab` runs
    except Exception as e:  # noqa: BLE001
        raise Failed(f"JupyterLab is not importable: {_error_line(e)}", REINSTALL) from None
    return f"jupyterlab {jupyterlab.__version__} importable (`python3 -m jupyter lab notebooks/`)"


# -- in a real kernel: what a notebook cell does ---------------------------------------------

KERNEL_PROBE = """
import sys, helpers
print("PY", sys.executable)
print("HELPERS", helpers.__file__)
import torch
print("TORCH", torch.__version__)
"""

CELL_WORKER = """
import torch
import torch.distributed as dist
from helpers.launch import launch

def doctor_allreduce(rank, world_size):       # defined in this cell, so in __main__
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return t.item()

print("RESULT", launch(doctor_allreduce, 2, backend="gloo", timeout={timeout}))
"""

CELL_DATALOADER = """
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from helpers.launch import launch

class DoctorPoints(Dataset):                  # a learner's own Dataset, defined in a cell
    def __init__(self, n):
        self.items = [torch.tensor([float(i)]) for i in range(n)]
    def __len__(self):
        return len(self.items)
    def __getitem__(self, i):
        return self.items[i]

def doctor_loader(rank, world_size, n=256, epochs=2):
    data = DoctorPoints(n)
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler, num_workers=2, persistent_workers=True)
    seen = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        mine = [int(v) for batch in loader for v in batch.flatten()]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
        seen.append(sorted(i for part in everyone for i in part))
    return seen

seen = launch(doctor_loader, 2, backend="gloo", timeout={timeout})[0]
assert all(s == list(range(256)) for s in seen), "an index was missed or seen twice in an epoch"
print("RESULT every index once per epoch, 2 epochs")
"""


class DoctorKernel:
    """A ``python3`` kernel (the notebooks' kernelspec) started with jupyter_client, as JupyterLab
    and papermill start it (``ipc`` transport: :func:`ci.cleanup.ipc_kernel_manager`)."""

    def __init__(self, start_timeout: float):
        from jupyter_client.manager import KernelManager

        from ci.cleanup import ipc_kernel_manager

        self.km = ipc_kernel_manager(KernelManager)(kernel_name="python3")
        self.kc = None
        self.km.start_kernel(env=dict(os.environ), cwd=str(REPO_ROOT))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=start_timeout)

    def cell(self, code: str, timeout: float) -> tuple[dict, str]:
        """Run ``code``; ``(reply content, stdout text)``."""
        out = []

        def hook(msg):
            if msg["header"]["msg_type"] == "stream":
                out.append(msg["content"]["text"])

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook, allow_stdin=False)
        return reply["content"], "".join(out)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.kc is not None:
                self.kc.stop_channels()
        with contextlib.suppress(Exception):
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=False)
        with contextlib.suppress(Exception):
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=True)


def _result_line(text: str, key: str) -> str | None:
    for line in text.splitlines():
        if line.startswith(key + " "):
            return line[len(key) + 1:]
    return None


def _cell_error(content: dict) -> str:
    """``Type: the telling line`` of a failed cell (a WorkerError's rank exception)."""
    ename, evalue = content.get("ename", "Error"), content.get("evalue", "")
    inner = re.search(r"^\s*(\w+(?:Error|Exception)\b:.*)$", evalue, re.M)
    first = evalue.strip().splitlines()[0] if evalue.strip() else ""
    if inner and inner.group(1) not in first:
        return one_line(f"{ename}: {first} -- {inner.group(1)}")
    return one_line(f"{ename}: {first}")


def check_kernel(doc: Doctor) -> str:
    try:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    except Exception as e:  # noqa: BLE001
        raise Failed(f"jupyter_client is not importable: {_error_line(e)}", REINSTALL) from None
    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        raise Failed("no `python3` kernel (the notebooks' kernelspec): `jupyter kernelspec list` lacks it",
                     f"`{sys.executable} -m ipykernel install --user`") from None
    try:
        doc.kernel = DoctorKernel(doc.inner_timeout("kernel"))
    except Exception as e:  # noqa: BLE001
        raise Failed(f"the python3 kernel ({spec.argv[0]}) did not start: {_error_line(e)}",
                     f"{REINSTALL}; then `{sys.executable} -m ipykernel install --user`") from None
    content, out = doc.kernel.cell(KERNEL_PROBE, timeout=doc.inner_timeout("kernel"))
    exe = _result_line(out, "PY") or spec.argv[0]
    if content["status"] != "ok":
        fix = (f"the kernel runs {exe}, not this Python: `{sys.executable} -m ipykernel install --user`"
               if exe != sys.executable else REINSTALL)
        raise Failed(f"in the python3 kernel: {_cell_error(content)}", fix)
    import ipykernel

    return f"python3 kernel (ipykernel {ipykernel.__version__}, {exe}) starts, imports torch and helpers"


def _kernel_cell(doc: Doctor, name: str, code: str) -> str:
    timeout = doc.inner_timeout(name)
    content, out = doc.kernel.cell(code.replace("{timeout}", str(int(timeout * 0.8))), timeout=timeout)
    if content["status"] != "ok":
        raise Failed(_cell_error(content), "")
    return _result_line(out, "RESULT") or "?"


def check_cell_code(doc: Doctor) -> str:
    try:
        got = _kernel_cell(doc, "cell code", CELL_WORKER)
    except Failed as f:
        raise Failed(f.detail, f"{REINSTALL}, rerun; if it persists, send this output to the instructor") from None
    if got != str(EXPECTED):
        raise Failed(f"all_reduce gave {got}, expected {EXPECTED}", f"{REINSTALL}, rerun")
    return f"a function defined in a kernel cell, through launch on 2 ranks: {got}"


def check_dataloader(doc: Doctor) -> str:
    try:
        got = _kernel_cell(doc, "DataLoader", CELL_DATALOADER)
    except Failed as f:
        text = f.detail.lower()
        if any(s in text for s in ("pickl", "too many fds", "can't get attribute")):
            fix = ("this copy of the course predates DataLoader workers inside ranks: update it (`git pull`); "
                   "meanwhile pass num_workers=0, or multiprocessing_context='fork' on Linux")
        else:
            fix = f"{REINSTALL}, rerun; if it persists, send this output to the instructor"
        raise Failed(f.detail, fix) from None
    return f"a cell-defined Dataset, num_workers=2 in 2 ranks: {got}"


CHECKS = [
    Check("python", check_python, 10),
    Check("torch", check_torch, 120, fix=REINSTALL),
    Check("MNIST", check_mnist, 180, needs=("torch",)),
    Check("ports", check_ports, 20),
    Check("launch", check_launch, 180, needs=("torch",)),
    Check("mp", check_mp, 180, needs=("torch",)),
    Check("warm ranks", check_warm_ranks, 300, needs=("torch",)),
    Check("JupyterLab", check_jupyterlab, 60),
    Check("kernel", check_kernel, 180),
    Check("cell code", check_cell_code, 240, needs=("torch", "kernel")),
    Check("DataLoader", check_dataloader, 240, needs=("torch", "kernel")),
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
                 time_limit: float | None = None):
        self.data_root = data_root
        self.time_limit = time_limit
        self.ports = ports
        self.free_fixed_ports = list(ports)
        self.out = out or sys.stdout
        self.kernel: DoctorKernel | None = None
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

            from helpers.procs import end_processes

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
        print(f"all {len(self.results)} checks ok: this machine can run every notebook", file=self.out, flush=True)
        return 0


def main(argv: list[str] | None = None) -> int:
    """``python3 -m helpers.doctor [--data-root PATH] [--port N ...] [--only NAME,...]``; exit code."""
    parser = argparse.ArgumentParser(prog="python3 -m helpers.doctor",
                                     description="A preflight for workshops: can this machine run every notebook?")
    parser.add_argument("--data-root", default=str(REPO_ROOT / "data"),
                        help="MNIST root (holding MNIST/raw), default: the repository's data/")
    parser.add_argument("--port", type=int, action="append", dest="ports", metavar="N",
                        help="a fixed MASTER_PORT to check (repeatable); default "
                        f"{' and '.join(map(str, TUTORIAL_PORTS))}")
    parser.add_argument("--only", metavar="NAME,...",
                        help=f"run only these checks: {', '.join(_BY_KEY)} (cell code and DataLoader bring kernel)")
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
    return Doctor(args.data_root, args.ports or list(TUTORIAL_PORTS), only, time_limit=args.time_limit).run()


if __name__ == "__main__":
    sys.exit(main())

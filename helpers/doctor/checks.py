"""The doctor's checks that run in this process: versions, MNIST, ports, launch, mp, warm ranks."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from helpers import REPO_ROOT
from helpers.checkout import mismatch

if TYPE_CHECKING:
    from helpers.doctor.run import Doctor
from helpers.doctor import common
from helpers.doctor.common import EXPECTED, REINSTALL, WORLD_SIZE, Failed, _error_line

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
    kernel_dir, found = _helpers_for_kernels()  # JupyterLab's kernels: this copy's helpers?
    if found is None:
        raise Failed(f"a JupyterLab kernel in {kernel_dir} cannot import helpers: this Python has not installed "
                     "the repository", REINSTALL)
    if mismatch(found, kernel_dir):  # the rule of `import helpers` (a copy inside `found` may use it)
        raise Failed(f"a JupyterLab kernel in {kernel_dir} would import helpers from {found}, another copy of "
                     "the course", f"one venv per copy: in {REPO_ROOT}, `python3 -m venv .venv && "
                     ". .venv/bin/activate && python3 -m pip install -r requirements.lock`")
    return f"{here} at {sys.executable} (supported: {spec or '?'}){where}"


_FIND_HELPERS = "import importlib.util as u; s = u.find_spec('helpers'); print(s.origin if s and s.origin else '')"


def _helpers_for_kernels() -> tuple[Path, Path | None]:
    """``(folder, root)``: the copy of the course whose ``helpers`` a kernel of this Python started in
    ``notebooks/`` (JupyterLab's working folder for a lesson) finds (found, not imported), ``None`` if none."""
    folder = REPO_ROOT / "notebooks" if (REPO_ROOT / "notebooks").is_dir() else REPO_ROOT
    proc = subprocess.run([sys.executable, "-c", _FIND_HELPERS], cwd=folder, capture_output=True, text=True,
                          timeout=60)
    origin = proc.stdout.strip()
    return folder, Path(origin).resolve().parent.parent if proc.returncode == 0 and origin else None


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
            where = "" if raw.is_dir() else " (the folder does not exist)"
            default = raw.resolve() == (REPO_ROOT / "data" / "MNIST" / "raw").resolve()
            fix = ("restore them: `git checkout -- data/MNIST/raw` in the repository" if default else
                   f"copy the repository's data/MNIST/raw/*.gz into {raw}, or drop --data-root to use the repository's")
            raise Failed(f"{len(missing)} of 4 MNIST files missing in {raw}{where}", fix) from None
        if not os.access(raw, os.W_OK):  # the .gz files are there but cannot be decompressed next to themselves
            raise Failed(f"{raw} is read-only: its .gz files must be decompressed there once",
                         f"make it writable (`chmod -R u+w {raw}`, or mount it read-write), or decompress them "
                         f"once as a user who can write there: `gunzip -k {raw}/*.gz`") from None
        raise Failed(common.one_line(str(e).split(". ")[0]), common.one_line(str(e), 300)) from None
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
    """True when a listener could bind ``port`` on every interface now (stricter than a rank's
    store needs: it binds ``MASTER_ADDR``'s address only, :func:`helpers.engine.processes.tcp_store`;
    ``SO_REUSEADDR``: a port in ``TIME_WAIT`` after a finished run counts as free). Binds, never listens."""
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
        what = common.TUTORIAL_PORTS.get(p, "a fixed MASTER_PORT")
        raise Failed(f"port {p} ({what}) is held by {_port_holder(p)}"
                     + (f"; also held: {', '.join(map(str, held[1:]))}" if held[1:] else ""),
                     f"stop that program, or set MASTER_PORT to another number in tutorial code (e.g. "
                     f"os.environ['MASTER_PORT'] = '{p + 1}'); launch and warm ranks pick free ports themselves")
    known = common.TUTORIAL_PORTS
    names = ", ".join(f"{p} ({known[p]})" if p in known else str(p) for p in doc.ports)
    return f"free: {names}"


#: Free memory a lesson needs, in MiB: its kernel and its ranks (measured as their USS with psutil,
#: lesson 00a with its warm ranks and lesson 04 after training, docs/TEACHING.md), with a margin.
MIN_FREE_MIB = 1500


def check_memory(doc: Doctor) -> str:
    """Free memory (``psutil.virtual_memory().available``) for one lesson's kernel and ranks."""
    import psutil

    free = psutil.virtual_memory().available / 2**20
    if free < MIN_FREE_MIB:
        raise Failed(f"{free:,.0f} MiB free; a lesson's kernel and its ranks need about {MIN_FREE_MIB:,} MiB",
                     "close programs you do not need, and shut down the kernels of lessons you finished "
                     "(JupyterLab: Kernel > Shut Down Kernel), then rerun the doctor")
    return f"{free:,.0f} MiB free (a lesson needs about {MIN_FREE_MIB:,} MiB)"


#: Below this size of /dev/shm the shm check fails (Docker's default is 64 MiB).
SHM_MIN_MIB = 256
SHM_FIX = ("give the container more shared memory: `docker run --shm-size=1g ...` (or `--ipc=host`); "
           "docker compose: `shm_size: 1gb`; Kubernetes: an emptyDir with `medium: Memory` at /dev/shm")


def check_shm(doc: Doctor) -> str:
    """/dev/shm (``--shm PATH``): DataLoader workers hand every batch to their rank through it
    (torch's ``file_descriptor`` sharing strategy on Linux), and a Dataset's tensors too when workers
    start by spawn or forkserver. Docker's 64 MiB default kills them ("bus error", "insufficient
    shared memory")."""
    path = Path(doc.shm)
    if not path.exists():
        if sys.platform.startswith("linux"):
            raise Failed(f"{path} does not exist: DataLoader workers (num_workers > 0) need it", SHM_FIX)
        return f"no {path} on {platform.system()}: DataLoader workers share memory another way there"
    st = os.statvfs(path)
    total, free = st.f_blocks * st.f_frsize / 2**20, st.f_bavail * st.f_frsize / 2**20
    sizes = f"{path}: {total:,.0f} MiB, {free:,.0f} MiB free"
    if min(total, free) < SHM_MIN_MIB:
        raise Failed(f"{sizes} (under {SHM_MIN_MIB} MiB): DataLoader workers (num_workers > 0) "
                     "pass their batches through it and die when it is full", SHM_FIX)
    return f"{sizes}, for DataLoader workers"


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


def _allreduce_by(what: str, call) -> list:
    """``call()``, a 2-rank all-reduce through ``what``; :class:`Failed` unless :data:`EXPECTED`."""
    try:
        got = call()
    except Exception as e:  # noqa: BLE001
        raise _helper_failure(e, what) from None
    if got != EXPECTED:
        raise Failed(f"all_reduce gave {got}, expected {EXPECTED}", f"{REINSTALL}, rerun")
    return got


def check_launch(doc: Doctor) -> str:
    from helpers.engine import launch

    got = _allreduce_by("launch", lambda: launch(_allreduce, WORLD_SIZE, backend="gloo",
                                                 timeout=doc.inner_timeout("launch")))
    return f"2-rank gloo all_reduce through helpers.engine.launch: {got}"


#: ranks of the doctor's simulation (a lesson-sized world; threads of this process, milliseconds)
SIMULATED_RANKS = 64


def check_simulate(doc: Doctor) -> str:
    from helpers.engine import SimulationUnavailable, simulate

    try:
        got = simulate(_allreduce, SIMULATED_RANKS, timeout=doc.inner_timeout("simulate"))
    except SimulationUnavailable as e:
        raise Failed(f"simulate: {_error_line(e)}",
                     "lesson 09 needs the torch version requirements.txt pins: reinstall it (the other lessons "
                     "run on launch)") from None
    except Exception as e:  # noqa: BLE001
        raise _helper_failure(e, "simulate") from None
    expected = float(sum(range(1, SIMULATED_RANKS + 1)))
    if got != [expected] * SIMULATED_RANKS:
        raise Failed(f"simulated all_reduce gave {sorted(set(got))}, expected {expected} on every rank",
                     f"{REINSTALL}, rerun")
    return (f"{SIMULATED_RANKS} simulated ranks (threads on torch's threaded process group) through "
            f"helpers.engine.simulate: all_reduce {expected:g} on each")


def check_mp(doc: Doctor) -> str:
    import helpers.mp as mp
    from helpers.engine import free_port

    fixed = [p for p in doc.free_fixed_ports if port_is_free(p)]
    port, note = (fixed[0], "") if fixed else (free_port(), " (a free port: the fixed ones are held)")
    timeout = doc.inner_timeout("mp")
    got = _allreduce_by("helpers.mp.spawn", lambda: mp.spawn(
        _tutorial_worker, args=(WORLD_SIZE, port), nprocs=WORLD_SIZE, timeout=timeout))
    return f"the DDP tutorial's setup() through helpers.mp.spawn, MASTER_PORT {port}{note}: {got}"


def check_warm_ranks(doc: Doctor) -> str:
    from helpers.engine import leftover_children, start_ranks

    started = []

    def call():
        timeout = doc.inner_timeout("warm ranks")
        started.append(start_ranks(WORLD_SIZE, backend="gloo", timeout=timeout, activate=False))
        return started[0].run(_allreduce)

    try:
        got = _allreduce_by("warm ranks", call)
    finally:
        for ranks in started:
            ranks.stop()
    deadline = time.monotonic() + 10
    while (left := [p for p in leftover_children() if "ipyparallel" in " ".join(common._cmdline(p))]) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        raise Failed(f"stop() left {len(left)} ipyparallel process(es): {', '.join(str(p.pid) for p in left)}",
                     "send this output to the instructor (a bug in helpers.engine.warm_ranks); kill those pids")
    return f"start_ranks({WORLD_SIZE}), all_reduce {got}, stop(), nothing left running"



"""The doctor's checks that need the notebooks' kernel: JupyterLab, the kernel, cell-defined code,
DataLoader workers."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from typing import TYPE_CHECKING

from helpers import REPO_ROOT

if TYPE_CHECKING:
    from helpers.doctor.run import Doctor
from helpers.doctor.common import EXPECTED, REINSTALL, Failed, _error_line, one_line


def _jupyter_lab_python() -> tuple[str | None, str, str]:
    """``(script, interpreter, its sys.prefix)`` of the server ``python3 -m jupyter lab`` starts:
    jupyter_core's ``jupyter`` runs the first ``jupyter-lab`` on PATH, then in this Python's scripts
    folder (``_path_with_self`` in jupyter_core/command.py); the interpreter is the script's ``#!``
    line's (pip's ``exec`` line's, for a long path). ``""`` where it cannot be told."""
    folders = [os.environ.get("PATH", os.defpath), sysconfig.get_path("scripts")]
    script = shutil.which("jupyter-lab", path=os.pathsep.join(folders))
    if script is None:
        return None, "", ""
    with open(script, "rb") as f:
        head = f.read(2048).decode(errors="replace")
    exec_line = re.search(r"^'''exec' \"?(.+?)\"? \"\$0\"", head, re.M)
    words = head[2:].split("\n", 1)[0].split() if head.startswith("#!") else [""]
    interp = exec_line.group(1) if exec_line else words[0]
    if os.path.basename(interp) == "env" and len(words) > 1:  # #!/usr/bin/env python3
        interp = shutil.which(words[-1]) or ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return script, interp, subprocess.run([interp, "-c", "import sys; print(sys.prefix)"], capture_output=True,
                                              text=True, timeout=60).stdout.strip()
    return script, interp, ""


def check_jupyterlab(doc: Doctor) -> str:
    try:
        import jupyterlab
        import jupyterlab.labapp  # noqa: F401 - what `jupyter lab` runs
    except Exception as e:  # noqa: BLE001
        raise Failed(f"JupyterLab is not importable: {_error_line(e)}", REINSTALL) from None
    root = " --allow-root" if hasattr(os, "geteuid") and os.geteuid() == 0 else ""  # JupyterLab refuses root without it
    args = f"--config=jupyter_lab_config.json{root} notebooks/00a_processes_and_collectives.ipynb"
    script, interp, prefix = _jupyter_lab_python()
    if not prefix or os.path.realpath(prefix) != os.path.realpath(sys.prefix):
        runs = f"which runs {interp or 'no Python it names'}" if script else "none found"
        raise Failed(f"`python3 -m jupyter lab` would start jupyter-lab {script or ''}, {runs}, not this Python "
                     f"({sys.executable}): that server would not see this install",
                     f"start JupyterLab with this Python: `{sys.executable} -m jupyterlab {args}`")
    return (f"jupyterlab {jupyterlab.__version__} importable; `python3 -m jupyter lab` starts {script} on this "
            f"Python (the README's start command: `python3 -m jupyter lab {args}`)")


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
from helpers.engine import launch

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
from helpers.engine import launch

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
    and papermill start it (``ipc`` transport: :func:`helpers.ipc_kernel.ipc_kernel_manager`)."""

    def __init__(self, start_timeout: float):
        from jupyter_client.manager import KernelManager

        from helpers.ipc_kernel import ipc_kernel_manager

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
    """The rest of the first line of ``text`` that starts with ``key`` and a space."""
    m = re.search(rf"^{key} (.*)$", text, re.M)
    return m.group(1) if m else None


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



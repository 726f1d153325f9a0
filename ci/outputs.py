"""The output folder of a run: one runner at a time, and only whole files in it.

Two runners writing into one folder would corrupt each other's results: papermill rewrites the
executed notebook in place after cells (``open(path, "w")``, neither papermill nor nbformat
writes atomically or locks), so two runs of one notebook interleave their writes, and a reader
(the course site's build, a person, CI's artifact upload) can catch a notebook half written. So:

- :func:`output_lock` holds an exclusive ``fcntl.flock`` on ``OUTPUT_DIR/.run_notebooks.lock``
  for the whole run. A second runner on the same folder fails at once,
  before it starts any kernel, with :class:`OutputDirBusy` naming the folder, the pid and
  command line holding it, and what to do. The kernel releases a ``flock`` when its holder
  exits, however it exits (SIGKILL too), so a dead runner never leaves a stale lock; the file
  is opened close-on-exec, so kernels and ranks never inherit it.
- :func:`partial_path` is where papermill writes while a notebook runs (a hidden file next to the
  final one); :func:`publish` moves it into place with ``os.replace`` (atomic on one file
  system), so ``<stem>.ipynb`` is always a complete notebook: the previous run's, or this one's.
  Partial files a killed runner left are deleted when the next runner takes the lock.
- :func:`record_times` keeps ``OUTPUT_DIR/<profile>/times.json``: each notebook's last passing
  run time, when and on which machine it was measured (``python3 -m ci.generate --record``
  puts them in the README's path table).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Iterator

from ci.planning import ConfigError

LOCK_NAME = ".run_notebooks.lock"
PARTIAL_SUFFIX = ".partial.ipynb"  # papermill warns about any other ending


class OutputDirBusy(ConfigError):
    """Another runner holds the output folder; nothing was run (exit code 2)."""


def _holder(fd: int) -> str:
    """``pid N (command line)`` as the holder wrote it into the lock file, or why unknown."""
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    pid, _, cmd = text.partition(" ")
    if not pid.isdigit():
        return "a process that has not yet written its pid"
    return f"pid {pid} ({cmd})" if cmd else f"pid {pid}"


@contextlib.contextmanager
def output_lock(output_dir: str | os.PathLike) -> Iterator[Path]:
    """Hold ``output_dir`` (created if missing) for this runner alone while the block runs.

    Raises:
        OutputDirBusy: another process holds it: the message names the folder, the holder and
            what to do (wait for it, or pass ``--output-dir`` with another folder).
    """
    folder = Path(output_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputDirBusy(
                f"the output folder {folder} is in use by another notebook runner, {_holder(fd)}; "
                f"nothing was run. Wait for that run to finish, or pass --output-dir with another "
                f"folder (two runs in one folder would overwrite each other's notebooks)."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {' '.join(sys.argv)}\n".encode(), 0)
        for stale in folder.glob(f"*/.*{PARTIAL_SUFFIX}"):  # left by a runner that was killed
            stale.unlink(missing_ok=True)
        yield folder
    finally:
        os.close(fd)  # releases the lock


def partial_path(output: Path) -> Path:
    """Where papermill writes ``output`` while the notebook runs (hidden, same folder)."""
    return output.with_name(f".{output.stem}.{os.getpid()}{PARTIAL_SUFFIX}")


def publish(partial: Path, output: Path) -> None:
    """Move a finished (or failed) notebook into place atomically; nothing if none was written."""
    if partial.exists():
        os.replace(partial, output)


TIMES_NAME = "times.json"


def _may_have_a_gpu() -> bool:
    """False where no GPU driver is installed: no ``nvidia-smi`` on the PATH and no NVIDIA, WSL
    (``/dev/dxg``) or ROCm (``/dev/kfd``) device node; then :func:`machine` need not import torch
    (about 2 CPU-s, in a runner that imports it nowhere else)."""
    if "torch" in sys.modules or shutil.which("nvidia-smi") or shutil.which("rocm-smi"):
        return True
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd"))


def machine() -> str:
    """This machine in a few words: OS, architecture, CPU cores, GPUs (if torch sees any)."""
    gpus = "no GPU"
    if _may_have_a_gpu():
        try:
            import torch

            if torch.cuda.is_available():
                gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        except Exception:  # noqa: BLE001 - no torch, no CUDA: the machine is still described
            pass
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores, {gpus}"


def record_times(rows: list[dict], folder: Path, *, when: str | None = None,
                 host: str | None = None) -> Path:
    """Merge the ``ok`` rows' seconds into ``folder/times.json`` and return its path.

    The file maps notebook stem to ``{"seconds", "date", "machine"}``; a notebook that did not
    pass keeps its previous entry, so a partial or failed run never erases a measured time.
    """
    path = Path(folder) / TIMES_NAME
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = {}
    when = when or datetime.date.today().isoformat()
    host = host or machine()
    for row in rows:
        if row.get("status") == "ok":
            record[row["notebook"]] = {"seconds": row["seconds"], "date": when, "machine": host}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path

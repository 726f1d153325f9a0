"""A preflight for workshops: can this machine run every notebook? ``python3 -m helpers.doctor``

Prints the platform, cores and memory, then one line per check, ``ok`` or ``FAIL`` with a
one-line fix, and exits 0 only when every check is ok (1 otherwise; 130 on Ctrl-C). In the
spirit of ``accelerate test`` and ``python -m torch.utils.collect_env``, but it runs what the
notebooks run, through the project's own helpers:

========== =====================================================================================
python     in ``requires-python``; a kernel started in ``notebooks/`` finds this copy's ``helpers``
torch      ``import torch``; versions; gloo / nccl available; GPUs
MNIST      :func:`helpers.data.ensure_mnist` (SHA-256 verified, decompressed); torchvision reads it
ports      the tutorials' fixed ``MASTER_PORT`` (12355: the DDP tutorial; 29500: torchrun) is free
memory     enough free memory for one lesson's kernel and ranks
launch     a 2-rank gloo ``all_reduce`` through :func:`helpers.engine.launch`
mp         the DDP tutorial's ``setup()`` in the rank, through :func:`helpers.mp.spawn`
simulate   an ``all_reduce`` on 64 simulated ranks (:func:`helpers.engine.simulate`)
warm ranks :func:`helpers.engine.start_ranks` (2 ranks), an ``all_reduce``, ``stop``, nothing left
JupyterLab importable, and ``python3 -m jupyter lab`` starts this Python's
kernel     the notebooks' ``python3`` kernel (ipykernel) starts and imports torch and helpers
cell code  a function defined in a kernel cell (``__main__``) runs on 2 ranks through ``launch``
DataLoader a cell-defined ``Dataset``, ``num_workers=2``, in 2 ranks: every index once per epoch
shm        ``/dev/shm`` holds at least 256 MiB (Docker's 64 MiB default fails: ``--shm-size=1g``)
========== =====================================================================================

Every check is bounded: past its time limit the doctor interrupts it (SIGINT, which the helpers
answer by ending their processes, as "interrupt kernel" does) and reports it; a check that does
not stop even then ends the doctor (exit 1) after its processes are killed. ``torch`` is imported
inside the checks, so a broken torch gives a fix line, not a traceback.

Options: ``--data-root PATH`` (the MNIST root, default ``<repo>/data``), ``--port N`` (a fixed
``MASTER_PORT`` to check, repeatable; default 12355 and 29500; the first one free is the one the
``mp`` check uses), ``--only NAME,...`` (run some checks; ``cell code`` and ``DataLoader`` bring
``kernel``), ``--time-limit S`` (cap every check's time limit), ``--shm PATH`` (the shared
memory to check, default ``/dev/shm``).
"""

from helpers.doctor.run import CHECKS, Doctor, main

__all__ = ["CHECKS", "Doctor", "main"]

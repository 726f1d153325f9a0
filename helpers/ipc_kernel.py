"""Jupyter kernels that talk over socket files of their own: the doctor's test kernel, the
runner's papermill kernels and the tests' kernels all start them this way."""

from __future__ import annotations

import os
import secrets
import sys

from traitlets import CaselessStrEnum, default

from helpers.engine.internal import socket_dir

#: How kernels started here talk to their client: Unix domain sockets (``ipc``) where the OS has
#: them, TCP on Windows. jupyter_client's TCP default picks five free ports (bind to port 0,
#: close), writes them into the connection file and starts the kernel, which binds them seconds
#: later; a port taken meanwhile by another process kills the kernel at start ("Kernel died before
#: replying to kernel_info", ``ZMQError: Address already in use``). That is "the classic timing
#: issue inherent in Jupyter kernel startup" (https://github.com/jupyter/jupyter_client/issues/154),
#: and the test suite hit it once (2026-12-01), with dozens of processes opening connections at
#: once. An ``ipc`` kernel's sockets are files with a name of its own (:func:`ipc_kernel_manager`):
#: nothing to race for.
KERNEL_TRANSPORT = "tcp" if sys.platform == "win32" else "ipc"


def ipc_kernel_manager(base: type) -> type:
    """``base`` (jupyter_client's ``KernelManager`` or ``AsyncKernelManager``) with ``transport``
    :data:`KERNEL_TRANSPORT` and, for ``ipc``, socket files of its own.

    jupyter_client names ``ipc`` sockets after the connection file, but it reads ``ip`` before it
    creates that file (``ConnectionFileMixin.write_connection_file``), so without one given the
    sockets are ``kernel-ipc-1`` ... ``-5`` in the kernel's working directory: shared by every
    kernel started there (seen: two papermill kernels in ``notebooks/`` read each other's
    messages, "Invalid Signature"), and left in the folder. Here they are
    ``<tempdir>/kernel-<12 random hex digits>-ipc-<n>``, one name per kernel; jupyter_client
    removes them when the kernel is cleaned up (``cleanup_ipc_files``). ``<tempdir>`` is
    :func:`helpers.engine.socket_folder.socket_dir`'s: the temp directory, or ``/tmp`` where ``TMPDIR`` is too
    long for a socket path.
    """

    class Manager(base):
        transport = CaselessStrEnum(["tcp", "ipc"], default_value=KERNEL_TRANSPORT, config=True)

        @default("ip")
        def _ip_of_this_kernel(self) -> str:
            if self.transport != "ipc":
                return super()._ip_default()
            name = f"kernel-{secrets.token_hex(6)}-ipc"
            return os.path.join(socket_dir(len(name) + len("-5")), name)  # channels: <ip>-1 ... <ip>-5

    Manager.__name__ = Manager.__qualname__ = f"IPC{base.__name__}"
    return Manager

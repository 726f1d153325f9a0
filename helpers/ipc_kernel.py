"""Jupyter kernels that talk over socket files of their own: the doctor's test kernel, the
runner's papermill kernels and the tests' kernels all start them this way."""

from __future__ import annotations

import os
import secrets
import sys

from traitlets import CaselessStrEnum, default

from helpers.engine.internal import socket_dir

#: How kernels started here talk to their client: Unix domain sockets (``ipc``) where the OS has
#: them, TCP on Windows. jupyter_client's TCP default picks five free ports that the kernel binds
#: seconds later; one taken meanwhile kills the kernel at start ("the classic timing issue
#: inherent in Jupyter kernel startup", https://github.com/jupyter/jupyter_client/issues/154; the
#: suite hit it once). An ``ipc`` kernel's socket files have a name of its own: nothing to race for.
KERNEL_TRANSPORT = "tcp" if sys.platform == "win32" else "ipc"


def ipc_kernel_manager(base: type) -> type:
    """``base`` (jupyter_client's ``KernelManager`` or ``AsyncKernelManager``) with ``transport``
    :data:`KERNEL_TRANSPORT` and, for ``ipc``, socket files of its own.

    jupyter_client reads ``ip`` before it writes the connection file, so by default every kernel
    started in a folder shares the sockets ``kernel-ipc-1`` ... ``-5`` there (seen: two papermill
    kernels read each other's messages, "Invalid Signature"). Here they are
    ``<socket_dir>/kernel-<12 random hex digits>-ipc-<n>``, one name per kernel, removed with the
    kernel (``cleanup_ipc_files``); ``socket_dir`` is the engine's, short enough for a socket path.
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

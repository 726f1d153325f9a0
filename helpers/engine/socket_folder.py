"""A temp folder short enough to hold a Unix socket: :func:`socket_dir`.

A Unix socket's path has a small limit (:data:`SUN_PATH_MAX`); the fork server's socket, ZeroMQ's
``ipc://`` endpoints of the lessons' kernels and the tests' kernels all need a folder that fits.
"""

from __future__ import annotations

import os
import sys
import tempfile

__all__ = ["SUN_PATH_MAX", "SYSTEM_TEMP_DIRS", "socket_dir"]

#: Bytes in a Unix socket's path, its final NUL included (``sun_path`` in ``<sys/un.h>``): 108 on
#: Linux, 104 on macOS and the BSDs (man 7 unix). ZeroMQ's ``ipc://`` endpoints are such sockets.
SUN_PATH_MAX = 108 if sys.platform.startswith("linux") else 104
#: Where :func:`socket_dir` looks when the temp directory's path is too long (CPython's choice, below).
SYSTEM_TEMP_DIRS = ("/tmp", "/var/tmp", "/usr/tmp")


def socket_dir(name_length: int) -> str:
    """An absolute temp folder where a socket name of ``name_length`` more characters fits in
    :data:`SUN_PATH_MAX`: ``TMPDIR`` when it fits (a long one fails with ``AF_UNIX path too long``), else
    the first writable of :data:`SYSTEM_TEMP_DIRS`, as CPython 3.14 does (cpython issue 132124).

    Raises:
        OSError: none fits; the message gives ``TMPDIR``'s length and what to do.
    """
    def fits(folder: str) -> bool:
        return len(os.fsencode(folder)) + 1 + name_length < SUN_PATH_MAX

    base = tempfile.gettempdir()
    if fits(base):
        return base
    for folder in SYSTEM_TEMP_DIRS:
        if os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK) and fits(folder):
            return folder
    raise OSError(
        f"the temp directory {base!r} is {len(os.fsencode(base))} bytes long: a Unix socket in it "
        f"(a name of {name_length} characters) would pass the {SUN_PATH_MAX - 1}-byte limit, and none of "
        f"{', '.join(SYSTEM_TEMP_DIRS)} is a writable folder to use instead. Set TMPDIR to a shorter "
        "folder (for example `export TMPDIR=/tmp`) before starting Python or Jupyter.")

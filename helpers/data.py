"""MNIST for the notebooks and DDP workers: verified files on disk, and a fast in-memory path.

The repository commits the four original MNIST IDX files (LeCun, Cortes, Burges), gzipped, in
``data/MNIST/raw/``. :func:`ensure_mnist` decompresses each next to itself, the layout
``torchvision.datasets.MNIST(root=...)`` reads, and checks every file's SHA-256.
:func:`load_mnist` parses them into whole-split tensors; :func:`mnist_datasets` gives
torchvision's datasets. Safe to call from several processes at once (each writes its own
temporary file and publishes it with ``os.replace``), cheap to call again (memoised). Every
failure is a :class:`MNISTDataError` naming the file, what is wrong and how to fix it.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
import stat
import tempfile
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from helpers import REPO_ROOT

__all__ = [
    "DEFAULT_ROOT", "MNIST_MEAN", "MNIST_STD", "MNIST_FILES", "MNISTFile", "MNISTDataError",
    "ensure_mnist", "load_mnist", "mnist_datasets", "parse_idx",
]

#: Default dataset root: ``<repo>/data``; the IDX files live in ``<root>/MNIST/raw``.
DEFAULT_ROOT = REPO_ROOT / "data"

#: Mean and standard deviation of the training-set pixels scaled to [0, 1] (dimensionless).
#: Source: /work/shared/data/README.md (checked there against the training set: 0.1307 /
#: 0.3081), the normalisation constants customary since the PyTorch MNIST example.
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081

IDX_MAGIC_IMAGES = 2051  # 0x00000803: unsigned byte, 3 dimensions (N, rows, cols)
IDX_MAGIC_LABELS = 2049  # 0x00000801: unsigned byte, 1 dimension (N,)
IMAGE_SIZE = (28, 28)

_FIX_GZ = (
    "restore the committed .gz files with `git checkout -- data/MNIST/raw` "
    "(outside the repository: copy them from the repository's data/MNIST/raw)"
)


@dataclass(frozen=True)
class MNISTFile:
    """One decompressed IDX file in ``<root>/MNIST/raw``: its name, size in bytes, SHA-256 (hex),
    IDX magic number (2051 images, 2049 labels) and item count."""

    name: str
    size: int
    sha256: str
    magic: int
    count: int


#: The four decompressed files. Sizes and SHA-256 digests: the table in
#: /work/shared/data/README.md; magic numbers and counts: the IDX headers (LeCun et al.).
MNIST_FILES: dict[str, MNISTFile] = {f.name: f for f in (
    MNISTFile("train-images-idx3-ubyte", 47040016, magic=IDX_MAGIC_IMAGES, count=60000,
              sha256="ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db"),
    MNISTFile("train-labels-idx1-ubyte", 60008, magic=IDX_MAGIC_LABELS, count=60000,
              sha256="65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5"),
    MNISTFile("t10k-images-idx3-ubyte", 7840016, magic=IDX_MAGIC_IMAGES, count=10000,
              sha256="0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7"),
    MNISTFile("t10k-labels-idx1-ubyte", 10008, magic=IDX_MAGIC_LABELS, count=10000,
              sha256="ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2"),
)}

_CHUNK = 1 << 20
_lock = threading.RLock()
# Stat keys (path, st_dev, st_ino, st_size, st_mtime_ns) of files whose content this process
# has verified. os.replace keeps inode and mtime, so the key taken from the temporary file is
# the key of the published file; any rewrite gives a new inode or mtime and a cache miss.
_verified: set[tuple] = set()


class MNISTDataError(RuntimeError):
    """The MNIST files are missing, damaged, unwritable or not MNIST; the message says how to fix it."""


def _raw_dir(root) -> Path:
    return (Path(root) if root is not None else DEFAULT_ROOT) / "MNIST" / "raw"


def _key(path: Path, st: os.stat_result) -> tuple:
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _is_verified(path: Path, spec: MNISTFile) -> bool:
    """True if ``path`` is a regular file with the expected content (memoised by stat key)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise MNISTDataError(f"cannot stat {path}: {e}") from e
    if not stat.S_ISREG(st.st_mode) or st.st_size != spec.size:
        return False
    key = _key(path, st)
    if key in _verified:
        return True
    try:
        ok = _sha256_file(path) == spec.sha256
    except OSError as e:
        raise MNISTDataError(f"cannot read {path}: {e}. Make the file readable, or delete it and "
                             "rerun.") from e
    if ok:
        _verified.add(key)
    return ok


def _decompress(gz: Path, target: Path, spec: MNISTFile) -> None:
    """Decompress ``gz`` to ``target`` atomically, verifying size and SHA-256 on the way.

    The output goes to a unique temporary file in the same folder, which replaces ``target``
    (``os.replace``) only once it is complete and verified; on any error it is removed.
    """
    folder = target.parent
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f"{spec.name}.tmp-", dir=folder)
    except PermissionError as e:
        raise MNISTDataError(
            f"cannot decompress {gz.name} to {target}: the folder {folder} is not writable "
            f"({e}). Make it writable (e.g. `chmod u+w {folder}`), or pass root= pointing at a "
            f"writable copy of the data folder."
        ) from e
    except OSError as e:
        raise MNISTDataError(f"cannot create a temporary file in {folder} to decompress {gz.name}: {e}") from e
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        n = 0
        with os.fdopen(fd, "wb") as out:
            try:
                with gzip.open(gz, "rb") as src:
                    for chunk in iter(lambda: src.read(_CHUNK), b""):
                        h.update(chunk)
                        n += len(chunk)
                        out.write(chunk)
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                raise MNISTDataError(f"{gz} is truncated or corrupt ({type(e).__name__}: {e}); "
                                     f"{_FIX_GZ}, then rerun.") from e
            except FileNotFoundError as e:
                raise MNISTDataError(f"{gz} is missing; {_FIX_GZ}.") from e
            except OSError as e:  # unreadable .gz, disk full, ...
                raise MNISTDataError(
                    f"cannot decompress {gz} into {folder} ({type(e).__name__}: {e}). Make the "
                    f".gz readable and the folder writable with free space, then rerun."
                ) from e
            out.flush()
            os.fchmod(out.fileno(), 0o644)
            st = os.fstat(out.fileno())
        actual = h.hexdigest()
        if n != spec.size or actual != spec.sha256:
            raise MNISTDataError(
                f"SHA-256 mismatch for {target.name} decompressed from {gz}: expected {spec.sha256} "
                f"({spec.size} bytes), actual {actual} ({n} bytes). The .gz file is damaged or not "
                f"the committed one; {_FIX_GZ}, then rerun."
            )
        try:
            os.replace(tmp, target)
        except OSError as e:
            raise MNISTDataError(
                f"cannot write {target} ({type(e).__name__}: {e}). Remove whatever is at that path "
                f"and make sure {folder} is writable, then rerun."
            ) from e
        _verified.add(_key(target, st))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _download(root: Path) -> None:
    import torchvision  # local import: only needed for the optional network fallback

    try:
        for train in (True, False):
            torchvision.datasets.MNIST(root=str(root), train=train, download=True)
    except Exception as e:  # network errors, HTTP errors, md5 mismatches of the download
        raise MNISTDataError(
            f"downloading MNIST into {root / 'MNIST' / 'raw'} with torchvision failed: {e}. "
            f"Restore the committed files with `git checkout -- data/MNIST/raw` instead."
        ) from e


def ensure_mnist(root: str | os.PathLike | None = None, *, download: bool = False) -> Path:
    """Make sure ``<root>/MNIST/raw`` holds the four decompressed MNIST files, verified.

    Each ``.gz`` is decompressed next to itself through a temporary file and ``os.replace``
    (no reader sees half a file; concurrent ranks are safe), then its size and SHA-256 are
    checked against :data:`MNIST_FILES`. A good file is left alone, a wrong one rebuilt from its
    ``.gz``. Verification is memoised per process by (path, device, inode, size, mtime).
    Afterwards ``torchvision.datasets.MNIST(root, download=True)`` works offline: torchvision
    skips its download when the decompressed files exist.

    Args:
        root: dataset root; default :data:`DEFAULT_ROOT` (``<repo>/data``).
        download: if True and files are missing, fetch them with torchvision (needs network).

    Returns:
        the root as a :class:`pathlib.Path`, what ``torchvision.datasets.MNIST(root=...)`` takes.

    Raises:
        MNISTDataError: a missing file, a truncated or corrupt ``.gz``, a checksum mismatch
            (expected and actual SHA-256), an unwritable folder, a failed download. No
            temporary file is left behind.
    """
    root = Path(root) if root is not None else DEFAULT_ROOT
    raw = _raw_dir(root)
    with _lock:
        todo = [spec for spec in MNIST_FILES.values() if not _is_verified(raw / spec.name, spec)]
        if not todo:
            return root
        missing = [spec for spec in todo if not (raw / (spec.name + ".gz")).is_file()]
        if missing and download:
            _download(root)
            todo = [spec for spec in todo if not _is_verified(raw / spec.name, spec)]
            missing = [spec for spec in todo if not (raw / (spec.name + ".gz")).is_file()]
        for spec in missing:
            target = raw / spec.name
            if target.is_file():  # wrong content and nothing to rebuild it from
                actual = _sha256_file(target)
                raise MNISTDataError(
                    f"SHA-256 mismatch for {target}: expected {spec.sha256}, actual {actual}, "
                    f"and {spec.name}.gz is missing to rebuild it. Delete {target}, {_FIX_GZ}, "
                    f"then rerun."
                )
        if missing:
            names = ", ".join(str(raw / (s.name + ".gz")) for s in missing)
            raise MNISTDataError(
                f"MNIST file(s) missing: {names}. To fix: {_FIX_GZ}; or call "
                f"ensure_mnist(download=True) to fetch them with torchvision (needs network)."
            )
        for spec in todo:
            _decompress(raw / (spec.name + ".gz"), raw / spec.name, spec)
    return root


def parse_idx(data: bytes | bytearray | memoryview, *, expected_magic: int | None = None,
              expected_count: int | None = None, name: str = "IDX data") -> np.ndarray:
    """Parse an unsigned-byte IDX buffer (MNIST's format) into a ``uint8`` numpy array.

    Header: a big-endian uint32 magic number (2051 = images ``(N, 28, 28)``, 2049 = labels
    ``(N,)``), one big-endian uint32 per dimension, then the data, one byte per value. The
    array shares memory with ``data``. ``name`` (the file path) goes into error messages.

    Raises:
        MNISTDataError: a bad magic number, an image size other than 28 x 28, an item count
            other than ``expected_count``, or a length that does not match the header.
    """
    buf = memoryview(data).cast("B")
    fix = "Delete the decompressed file and rerun ensure_mnist()."
    if len(buf) < 8:
        raise MNISTDataError(f"{name}: {len(buf)} bytes is too short for an IDX header. {fix}")
    magic = int.from_bytes(buf[0:4], "big")
    if magic not in (IDX_MAGIC_IMAGES, IDX_MAGIC_LABELS) or expected_magic not in (None, magic):
        want = expected_magic if expected_magic is not None else f"{IDX_MAGIC_IMAGES} or {IDX_MAGIC_LABELS}"
        raise MNISTDataError(f"{name}: IDX magic number is {magic}, expected {want}. {fix}")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(buf) < header:
        raise MNISTDataError(f"{name}: {len(buf)} bytes is too short for a {ndim}-d IDX header. {fix}")
    dims = tuple(int.from_bytes(buf[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    if magic == IDX_MAGIC_IMAGES and dims[1:] != IMAGE_SIZE:
        raise MNISTDataError(f"{name}: image size is {dims[1]} x {dims[2]}, expected 28 x 28. {fix}")
    if expected_count is not None and dims[0] != expected_count:
        raise MNISTDataError(f"{name}: IDX header says {dims[0]} items, expected {expected_count}. {fix}")
    body = int(np.prod(dims))
    if len(buf) != header + body:
        raise MNISTDataError(f"{name}: {len(buf)} bytes, but the header {dims} implies "
                             f"{header + body}. {fix}")
    return np.frombuffer(buf, dtype=np.uint8, offset=header).reshape(dims)


def _read_verified(path: Path, spec: MNISTFile) -> bytearray:
    """Read ``path`` whole; if this exact file (stat key) was not verified yet, hash the bytes read."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            buf = bytearray(st.st_size)
            n = f.readinto(buf)
    except OSError as e:
        raise MNISTDataError(f"cannot read {path}: {e}. Delete it and rerun ensure_mnist().") from e
    if n != st.st_size:
        raise MNISTDataError(f"{path} changed while being read. Rerun.")
    key = _key(path, st)
    if key not in _verified:
        actual = hashlib.sha256(buf).hexdigest()
        if actual != spec.sha256:
            raise MNISTDataError(
                f"SHA-256 mismatch for {path}: expected {spec.sha256}, actual {actual}. "
                f"Delete the decompressed file and rerun ensure_mnist()."
            )
        with _lock:
            _verified.add(key)
    return buf


@functools.lru_cache(maxsize=4)
def _load_raw(raw: str, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (N, 28, 28) and uint8 labels (N,) of one split, memoised per process."""
    prefix = "train" if train else "t10k"
    arrays = []
    for kind, magic in (("images-idx3-ubyte", IDX_MAGIC_IMAGES), ("labels-idx1-ubyte", IDX_MAGIC_LABELS)):
        spec = MNIST_FILES[f"{prefix}-{kind}"]
        path = Path(raw) / spec.name
        arrays.append(parse_idx(_read_verified(path, spec), expected_magic=magic,
                                expected_count=spec.count, name=str(path)))
    return torch.from_numpy(arrays[0]), torch.from_numpy(arrays[1])


def load_mnist(train: bool = True, root: str | os.PathLike | None = None, normalize: bool = True,
               flatten: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One whole MNIST split as fresh CPU tensors (no per-item PIL transform).

    Args:
        train: the 60,000 training images if True, else the 10,000 test images.
        root: dataset root (default ``<repo>/data``), through :func:`ensure_mnist`.
        normalize: ``(x - MNIST_MEAN) / MNIST_STD`` of pixels in [0, 1] if True, else [0, 1].
        flatten: images ``(N, 784)`` instead of ``(N, 1, 28, 28)``.

    Returns:
        ``(images, labels)``: ``float32`` images, ``int64`` labels ``(N,)`` in 0..9.

    Raises:
        MNISTDataError: as :func:`ensure_mnist`, or an IDX header that is not MNIST's.
    """
    root = ensure_mnist(root)
    images_u8, labels_u8 = _load_raw(str(_raw_dir(root).resolve()), bool(train))
    images = images_u8.to(torch.float32)
    if normalize:
        images.mul_(1.0 / (255.0 * MNIST_STD)).sub_(MNIST_MEAN / MNIST_STD)
    else:
        images.div_(255.0)
    images = images.reshape(-1, 28 * 28) if flatten else images.unsqueeze(1)
    return images, labels_u8.to(torch.int64)


def mnist_datasets(root: str | os.PathLike | None = None, transform: Callable | None = None):
    """``(train, test)`` :class:`torchvision.datasets.MNIST` over the verified files.

    Items are ``(image, label)``; the default ``transform`` (``ToTensor()`` then ``Normalize``
    with :data:`MNIST_MEAN` and :data:`MNIST_STD`, the seed recipe) gives ``float32 (1, 28, 28)``
    images. Slower per item than :func:`load_mnist`. Raises ``MNISTDataError`` as
    :func:`ensure_mnist`.
    """
    from torchvision import datasets, transforms

    root = ensure_mnist(root)
    if transform is None:
        transform = transforms.Compose([transforms.ToTensor(),
                                        transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    train = datasets.MNIST(root=str(root), train=True, download=False, transform=transform)
    test = datasets.MNIST(root=str(root), train=False, download=False, transform=transform)
    return train, test

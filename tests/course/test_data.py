"""Tests for helpers.data on the real MNIST files.

Fault tests work on copies of the committed .gz files in ``tmp_path/MNIST/raw`` and never touch
the repository's ``data/`` (apart from the normal, git-ignored decompression done by the tests
that use the default root). After every fault the folder is checked for leftover temporary or
half-written files.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import REPO_ROOT, data
from helpers.data import (
    MNIST_FILES,
    MNIST_MEAN,
    MNIST_STD,
    MNISTDataError,
    ensure_mnist,
    load_mnist,
    mnist_datasets,
    parse_idx,
)

REPO_RAW = REPO_ROOT / "data" / "MNIST" / "raw"
SHARED_README = Path("/work/shared/data/README.md")

# Label counts per digit 0..9, from /work/shared/data/README.md.
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]

HEX64 = re.compile(r"\b[0-9a-f]{64}\b")


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def gz_copy(tmp_path):
    """``(root, raw)``: a private copy of the four committed .gz files, nothing decompressed."""
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for spec in MNIST_FILES.values():
        shutil.copyfile(REPO_RAW / (spec.name + ".gz"), raw / (spec.name + ".gz"))
    return tmp_path, raw


def assert_clean(raw: Path, allowed: set[str] | None = None) -> None:
    """No temporary files in ``raw``; if ``allowed`` is given, nothing but those names."""
    names = {p.name for p in raw.iterdir()}
    leftovers = [n for n in names if ".tmp" in n]
    assert not leftovers, f"temporary files left behind: {leftovers}"
    if allowed is not None:
        assert names <= allowed, f"unexpected files: {sorted(names - allowed)}"


GZ_ONLY = {spec.name + ".gz" for spec in MNIST_FILES.values()}


def ensure_fails(root: Path) -> MNISTDataError:
    """The error ``ensure_mnist(root)`` raises (the test fails if it raises none)."""
    with pytest.raises(MNISTDataError) as ei:
        ensure_mnist(root)
    return ei.value


# ---- the real data -----------------------------------------------------------------------------

def test_constants_match_shared_readme():
    if not SHARED_README.exists():
        pytest.skip(f"{SHARED_README} not present on this machine")
    text = SHARED_README.read_text()
    for spec in MNIST_FILES.values():
        m = re.search(rf"\|\s*{re.escape(spec.name)}\s*\|\s*(\d+)\s*\|\s*([0-9a-f]{{64}})\s*\|", text)
        assert m, spec.name
        assert (int(m.group(1)), m.group(2)) == (spec.size, spec.sha256)
    assert "train: " + " ".join(map(str, TRAIN_COUNTS)) in text
    assert "test: " + " ".join(map(str, TEST_COUNTS)) in text


def test_ensure_mnist_default_root_digests_verify():
    root = ensure_mnist()
    assert root == REPO_ROOT / "data"
    for spec in MNIST_FILES.values():
        b = (REPO_RAW / spec.name).read_bytes()
        assert len(b) == spec.size
        assert sha256(b) == spec.sha256
    assert_clean(REPO_RAW)
    assert ensure_mnist() == root  # cached second call


def test_torchvision_reads_layout_and_agrees_with_load_mnist():
    import torchvision

    root = ensure_mnist()
    test_tv = torchvision.datasets.MNIST(root=str(root), train=False, download=False)
    _, labels = load_mnist(train=False)
    assert torch.equal(test_tv.targets.to(torch.int64), labels)

    train_ds, test_ds = mnist_datasets()
    assert (len(train_ds), len(test_ds)) == (60000, 10000)
    images, labels = load_mnist(train=True)
    assert torch.equal(train_ds.targets.to(torch.int64), labels)
    for i in (0, 12345, 59999):
        x, y = train_ds[i]
        assert x.shape == (1, 28, 28) and x.dtype == torch.float32
        assert y == labels[i].item()
        torch.testing.assert_close(x, images[i], atol=1e-5, rtol=0)


def test_load_mnist_shapes_dtypes_statistics_label_counts_and_fresh_tensors():
    images, labels = load_mnist(train=True)
    assert images.shape == (60000, 1, 28, 28) and images.dtype == torch.float32
    assert labels.shape == (60000,) and labels.dtype == torch.int64
    assert abs(images.mean().item()) < 1e-3
    assert abs(images.std().item() - 1.0) < 1e-3
    lo, hi = -MNIST_MEAN / MNIST_STD, (1 - MNIST_MEAN) / MNIST_STD
    assert images.min().item() == pytest.approx(lo, abs=1e-5)
    assert images.max().item() == pytest.approx(hi, abs=1e-5)

    raw01, _ = load_mnist(train=True, normalize=False)
    assert raw01.min().item() == 0.0 and raw01.max().item() == 1.0
    assert raw01.mean().item() == pytest.approx(MNIST_MEAN, abs=1e-4)
    assert raw01.std().item() == pytest.approx(MNIST_STD, abs=1e-4)

    flat, test_labels = load_mnist(train=False, flatten=True)
    assert flat.shape == (10000, 784) and flat.dtype == torch.float32
    assert torch.bincount(labels, minlength=10).tolist() == TRAIN_COUNTS
    assert torch.bincount(test_labels, minlength=10).tolist() == TEST_COUNTS
    flat.zero_()  # the caller owns its tensors: the cache does not change
    test_labels.zero_()
    again, again_labels = load_mnist(train=False)
    assert again.abs().sum() > 0 and again_labels.sum() > 0


# torchvision.datasets.MNIST(root, download=True), as seed 002 and the tutorials call it: with the
# network unreachable (http(s)_proxy pointed at a port nobody listens on) it downloads nothing
# once ensure_mnist has decompressed the files, and fails before.
OFFLINE_MNIST = """
import sys, torchvision
try:
    ds = torchvision.datasets.MNIST(root=sys.argv[1], train=True, download=True)
except RuntimeError as e:
    print("FAILED:", str(e).splitlines()[0])
    sys.exit(3)
print("items:", len(ds))
"""


def torchvision_mnist_offline(root: Path) -> subprocess.CompletedProcess:
    from helpers.engine import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # bound, released: connections are refused
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("no_proxy", "http_proxy", "https_proxy")}
    env.update(http_proxy=dead, https_proxy=dead, HTTP_PROXY=dead, HTTPS_PROXY=dead)
    return subprocess.run([sys.executable, "-c", OFFLINE_MNIST, str(root)], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow(35)
def test_torchvision_download_true_works_offline_after_ensure_mnist(gz_copy):
    root, raw = gz_copy
    gz_before = {p.name: p.read_bytes() for p in raw.iterdir()}
    before = torchvision_mnist_offline(root)  # only the committed (recompressed) .gz files
    assert before.returncode == 3 and "Error downloading" in before.stdout, before.stdout + before.stderr
    assert {p.name: p.read_bytes() for p in raw.iterdir()} == gz_before  # the failed try changed nothing

    ensure_mnist(root)
    after = torchvision_mnist_offline(root)
    assert after.returncode == 0 and "items: 60000" in after.stdout, after.stdout + after.stderr
    assert_clean(raw, GZ_ONLY | set(MNIST_FILES))


# ---- decompression into a private copy ---------------------------------------------------------

def test_decompress_into_copy_and_existing_good_files_are_kept(gz_copy):
    root, raw = gz_copy
    assert ensure_mnist(root) == root
    all_names = GZ_ONLY | set(MNIST_FILES)
    assert {p.name for p in raw.iterdir()} == all_names
    before = {n: os.stat(raw / n) for n in MNIST_FILES}
    for n, st in before.items():
        assert st.st_mode & 0o777 == 0o644, n
    # A new process (empty verification cache) re-hashes but must not rewrite good files.
    data._verified.clear()
    ensure_mnist(root)
    for n, st in before.items():
        after = os.stat(raw / n)
        assert (after.st_ino, after.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), n
    assert_clean(raw, all_names)


def test_wrong_decompressed_file_is_rebuilt_from_gz(gz_copy):
    root, raw = gz_copy
    ensure_mnist(root)
    target = raw / "t10k-labels-idx1-ubyte"
    good = target.read_bytes()
    bad = bytearray(good)
    bad[100] ^= 0xFF

    # (a) replaced by another file (new inode)
    tmp = raw / "elsewhere"
    tmp.write_bytes(bad)
    os.replace(tmp, target)
    ensure_mnist(root)
    assert target.read_bytes() == good

    # (b) edited in place, later (a later mtime, as any real edit after verification has)
    st = os.stat(target)
    with open(target, "r+b") as f:
        f.seek(100)
        f.write(bytes([bad[100]]))
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    ensure_mnist(root)
    assert target.read_bytes() == good
    assert_clean(raw, GZ_ONLY | set(MNIST_FILES))


def test_wrong_decompressed_file_without_gz_reports_both_digests(gz_copy):
    root, raw = gz_copy
    ensure_mnist(root)
    name = "t10k-labels-idx1-ubyte"
    target = raw / name
    bad = bytearray(target.read_bytes())
    bad[-1] ^= 0x01
    tmp = raw / "elsewhere"
    tmp.write_bytes(bad)
    os.replace(tmp, target)
    (raw / (name + ".gz")).unlink()
    msg = str(ensure_fails(root))
    assert str(target) in msg
    assert MNIST_FILES[name].sha256 in msg and sha256(bytes(bad)) in msg
    assert "git checkout -- data/MNIST/raw" in msg
    assert_clean(raw)


def test_missing_gz_or_folder(gz_copy):
    root, raw = gz_copy
    (raw / "train-labels-idx1-ubyte.gz").unlink()
    msg = str(ensure_fails(root))
    assert "train-labels-idx1-ubyte.gz" in msg and "missing" in msg
    assert "git checkout -- data/MNIST/raw" in msg and "download=True" in msg
    # Fails before decompressing anything.
    assert_clean(raw, GZ_ONLY - {"train-labels-idx1-ubyte.gz"})
    assert "t10k-images-idx3-ubyte.gz" in str(ensure_fails(root / "nowhere"))  # no folder at all
    with pytest.raises(MNISTDataError, match="missing"):
        load_mnist(root=root / "nowhere")


def test_truncated_gzip(gz_copy):
    root, raw = gz_copy
    gz = raw / "train-images-idx3-ubyte.gz"
    b = gz.read_bytes()
    gz.write_bytes(b[: len(b) // 2])
    msg = str(err := ensure_fails(root))
    assert str(gz) in msg and "truncated or corrupt" in msg and "git checkout" in msg
    assert isinstance(err.__cause__, EOFError)
    assert_clean(raw, GZ_ONLY)


def test_flipped_byte_in_gzip_payload(gz_copy):
    root, raw = gz_copy
    gz = raw / "train-labels-idx1-ubyte.gz"
    b = bytearray(gz.read_bytes())
    b[len(b) // 2] ^= 0xFF  # inside the deflate stream
    gz.write_bytes(b)
    msg = str(ensure_fails(root))
    assert str(gz) in msg
    # Either zlib rejects the stream, or gzip's CRC-32 / our SHA-256 catches the change.
    assert "truncated or corrupt" in msg or "SHA-256 mismatch" in msg
    assert not (raw / "train-labels-idx1-ubyte").exists()
    assert_clean(raw)


def test_valid_gzip_with_wrong_content_is_checksum_mismatch(gz_copy):
    root, raw = gz_copy
    name = "t10k-labels-idx1-ubyte"
    content = bytearray(gzip.decompress((raw / (name + ".gz")).read_bytes()))
    content[5000] = (content[5000] + 1) % 10  # one label changed, still a valid IDX file
    (raw / (name + ".gz")).write_bytes(gzip.compress(bytes(content)))
    msg = str(ensure_fails(root))
    assert "SHA-256 mismatch" in msg and name in msg
    assert MNIST_FILES[name].sha256 in msg
    assert sha256(bytes(content)) in msg
    assert len(HEX64.findall(msg)) == 2
    assert "git checkout -- data/MNIST/raw" in msg
    assert not (raw / name).exists()
    assert_clean(raw)


def test_unreplaceable_target_directory_in_the_way(gz_copy):
    """os.replace fails (a directory squats on the target name): works as root too."""
    root, raw = gz_copy
    squat = raw / "train-images-idx3-ubyte"
    squat.mkdir()
    (squat / "keep").write_text("x")
    msg = str(ensure_fails(root))
    assert str(squat) in msg and "cannot write" in msg and "writable" in msg
    assert squat.is_dir() and (squat / "keep").read_text() == "x"
    assert_clean(raw, GZ_ONLY | {"train-images-idx3-ubyte"})


def _writable(folder: Path) -> bool:
    try:
        fd, name = tempfile.mkstemp(dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


@contextlib.contextmanager
def read_only(folder: Path):
    """Make ``folder`` really unwritable for this process, also when running as root.

    ``chmod 0o555`` is enough for ordinary users; root ignores it, so then the folder is also
    made immutable with ``chattr +i`` (needs CAP_LINUX_IMMUTABLE and ext4/xfs/btrfs/tmpfs).
    If neither works the test is skipped (only possible as root).
    """
    os.chmod(folder, 0o555)
    immutable = False
    try:
        if _writable(folder) and shutil.which("chattr"):
            immutable = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        if _writable(folder):
            pytest.skip("running as root where neither chmod 0o555 nor chattr +i can make a folder read-only")
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        os.chmod(folder, 0o755)


def test_read_only_folder_fails_when_decompression_is_needed_only(gz_copy):
    root, raw = gz_copy
    with read_only(raw):
        msg = str(err := ensure_fails(root))
    assert str(raw) in msg and "not writable" in msg and "chmod u+w" in msg
    assert isinstance(err.__cause__, PermissionError)
    assert_clean(raw, GZ_ONLY)
    ensure_mnist(root)  # once the files are there, a read-only folder is fine
    data._verified.clear()
    with read_only(raw):
        ensure_mnist(root)


# ---- IDX parsing -------------------------------------------------------------------------------

def idx(magic: int, dims: tuple[int, ...], body: bytes | None = None) -> bytes:
    head = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    return head + (body if body is not None else bytes(int(np.prod(dims))))


def test_parse_idx_valid():
    imgs = parse_idx(idx(2051, (3, 28, 28), bytes(range(256)) * 9 + bytes(3 * 784 - 2304)))
    assert imgs.shape == (3, 28, 28) and imgs.dtype == np.uint8
    assert imgs[0, 0, 5] == 5
    labels = parse_idx(idx(2049, (4,), bytes([1, 2, 3, 9])), expected_magic=2049, expected_count=4)
    assert labels.tolist() == [1, 2, 3, 9]


@pytest.mark.parametrize(
    "buf, kwargs, match",
    [
        (idx(2052, (2, 28, 28)), {}, r"magic number is 2052, expected 2051 or 2049"),
        (idx(2049, (2,)), {"expected_magic": 2051}, r"magic number is 2049, expected 2051"),
        (idx(2051, (2, 28, 28)), {"expected_count": 60000}, r"2 items, expected 60000"),
        (idx(2049, (5,)), {"expected_count": 10000}, r"5 items, expected 10000"),
        (idx(2051, (2, 32, 32)), {}, r"32 x 32, expected 28 x 28"),
        (idx(2049, (5,), bytes(4)), {}, r"header \(5,\) implies 13"),
        (idx(2049, (5,), bytes(6)), {}, r"header \(5,\) implies 13"),
        (b"\x00\x00\x08", {}, r"too short"),
        (idx(2051, (2, 28, 28))[:10], {}, r"too short"),
    ],
)
def test_parse_idx_rejects_bad_headers(buf, kwargs, match):
    with pytest.raises(MNISTDataError, match=match) as ei:
        parse_idx(buf, name="some/file-idx", **kwargs)
    assert "some/file-idx" in str(ei.value) and "rerun" in str(ei.value)

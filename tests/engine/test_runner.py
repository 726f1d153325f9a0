"""Tests of ci/run_notebooks.py on tiny throwaway notebooks (no torch, a few kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import psutil
import pytest

from ci import execution, student_copies
from ci import run_notebooks as rn
from helpers.engine.processes import is_live

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "ci" / "run_notebooks.py"

PARAMS = """\
n = 2
x = 0.5
name = "a"
flag = False
maybe = None
"""

OK_CELLS = [
    "import json\nfrom ipykernel.connect import get_connection_info",
    'info = get_connection_info(unpack=True)\n'
    'json.dump({"n": n, "x": x, "name": name, "flag": flag, "transport": info["transport"], "ip": info["ip"]},\n'
    '          open("ok_result.json", "w"))',
]
FAIL_CELLS = [
    "y = 1",
    'assert n == 3, "n is not 3"',
    'print("never reached")',
]
SLEEP_CELLS = [
    # a child in the kernel's process group and one in its own session (immune to killpg)
    "import subprocess, sys, time\n"
    "SLEEPER = [sys.executable, '-c', 'import time; time.sleep(120)']\n"
    "a = subprocess.Popen(SLEEPER)\n"
    "b = subprocess.Popen(SLEEPER, start_new_session=True)\n"
    "open('sleep_pids.txt', 'w').write(f'{a.pid} {b.pid}')\n"
    # and a launch's run folder held open (as by a launch() cut short): only its reaper can remove
    # it, since the kernel is SIGKILLed after the tree
    "import os, tempfile\n"
    "from helpers.engine.run_dir import run_folder\n"
    "os.makedirs('tmp', exist_ok=True)\n"
    "tempfile.tempdir = os.path.abspath('tmp')\n"
    "held = run_folder()\n"
    "open('run_folder.txt', 'w').write(held.__enter__())",
    "time.sleep(300)",
    'print("never reached")',
]
LEAK_CELLS = [
    # the intermediate process exits at once: its child is orphaned while the cell runs and
    # is no longer a descendant of the kernel (only a subreaper runner or a snapshot finds it)
    "import subprocess, sys\n"
    "CODE = ('import subprocess, sys; '\n"
    "        'p = subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(120)\"], '\n"
    "        'start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); '\n"
    "        'print(p.pid)')\n"
    "out = subprocess.run([sys.executable, '-c', CODE], capture_output=True, text=True, check=True)\n"
    "open('leak_pid.txt', 'w').write(out.stdout.strip())",
]

DIE_CELLS = [
    "import os, subprocess, sys\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "open('die_pid.txt', 'w').write(str(child.pid))",
    "os.kill(os.getpid(), 9)",
]


def make_notebook(path: Path, cells: list[str], params: str | None = PARAMS) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells.append(nbformat.v4.new_markdown_cell(f"# {path.stem}"))
    if params is not None:
        cell = nbformat.v4.new_code_cell(params)
        cell.metadata["tags"] = ["parameters"]
        nb.cells.append(cell)
    nb.cells.extend(nbformat.v4.new_code_cell(src) for src in cells)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


@pytest.fixture
def nbdir(tmp_path: Path) -> Path:
    d = tmp_path / "notebooks"
    make_notebook(d / "01_ok.ipynb", OK_CELLS)
    make_notebook(d / "02_fail.ipynb", FAIL_CELLS)
    make_notebook(d / "03_sleep.ipynb", SLEEP_CELLS)
    make_notebook(d / "04_leak.ipynb", LEAK_CELLS)
    make_notebook(d / "05_die.ipynb", DIE_CELLS)
    return d


@pytest.fixture
def profiles(tmp_path: Path) -> Path:
    """A lesson manifest with profile tables for 01_ok only (the folder's notebooks are not all in it)."""
    p = tmp_path / "lessons.toml"
    p.write_text('[[lesson]]\nstem = "01_ok"\ntitle = "ok"\noutcome = "pass"\n'
                 '[lesson.smoke]\nn = 5\n[lesson.full]\nn = 50\nx = 2\n')
    return p


def common_args(nbdir: Path, profiles: Path, tmp_path: Path) -> list[str]:
    return ["--notebooks-dir", str(nbdir), "--manifest", str(profiles),
            "--output-dir", str(tmp_path / "build")]


def run_cli(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    # from a foreign cwd, without PYTHONPATH: the script must stand on its own
    return subprocess.run([sys.executable, str(RUNNER), *args], capture_output=True, text=True,
                          timeout=timeout, cwd="/")


def table_rows(stdout: str) -> dict[str, tuple[str, float]]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == ["notebook", "status", "seconds"])
    rows = {}
    for line in lines[start + 1:]:
        parts = line.split()
        if len(parts) != 3:
            break
        rows[parts[0]] = (parts[1], float(parts[2]))
    return rows


def assert_gone(pids: list[int], within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while any(is_live(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if is_live(p)], f"processes still running: {pids}"


@pytest.mark.timeout(120)
def test_cli_failure_then_ok_continues_table_and_cell(nbdir, profiles, tmp_path):
    res = run_cli(["02", "01_ok", "-p", "name=hello", *common_args(nbdir, profiles, tmp_path)])
    assert res.returncode == 1, res.stdout + res.stderr
    rows = table_rows(res.stdout)
    assert list(rows) == ["02_fail", "01_ok"]
    assert rows["02_fail"][0] == "FAILED"
    assert rows["01_ok"][0] == "ok"
    # the failure names notebook, cell (index in the source notebook + first line) and error
    assert "02_fail: cell 3: `assert n == 3, \"n is not 3\"`: AssertionError: n is not 3" in res.stdout
    assert (tmp_path / "build" / "smoke" / "02_fail.ipynb").is_file()
    assert (tmp_path / "build" / "smoke" / "01_ok.ipynb").is_file()
    # the passing notebook's time is recorded for the README's path table (ci/path_table.py)
    times = json.loads((tmp_path / "build" / "smoke" / "times.json").read_text())
    assert list(times) == ["01_ok"] and times["01_ok"]["seconds"] == rows["01_ok"][1], times
    assert "CPU cores" in times["01_ok"]["machine"] and times["01_ok"]["date"], times
    # profile value (n) and -p value (name) reached the notebook; x kept its default
    got = json.loads((nbdir / "ok_result.json").read_text())
    assert {k: got[k] for k in ("n", "x", "name", "flag")} == {"n": 5, "x": 0.5, "name": "hello", "flag": False}
    # the kernels talked to the runner over Unix sockets of their own (no TCP ports to race for;
    # not jupyter_client's fallback `kernel-ipc-<n>` in the working directory, which kernels started
    # there share), and none is left (ci/cleanup.py)
    if sys.platform != "win32":
        assert got["transport"] == "ipc" and Path(got["ip"]).parent == Path(tempfile.gettempdir()), got
        assert not list(Path(tempfile.gettempdir()).glob(Path(got["ip"]).name + "*")), "socket files left"
    assert not [p.name for p in nbdir.iterdir() if p.name.startswith("kernel-")], "socket files in notebooks/"


@pytest.mark.skipif(sys.platform == "win32", reason="kernels talk over TCP on Windows")
@pytest.mark.timeout(120)
def test_kernel_starts_where_the_temp_directory_is_too_long_for_its_sockets(tmp_path, monkeypatch):
    """An ``ipc`` kernel's sockets are ``<tempdir>/kernel-<12 hex>-ipc-<n>``; with a temp directory
    too long for a socket path (``TMPDIR`` a cluster job's scratch folder) ZeroMQ could not bind
    them and the kernel would die at start. They go to a short system temp folder instead
    (``helpers.engine.socket_folder.socket_dir``), and none is left after the kernel."""
    from jupyter_client.manager import KernelManager

    from ci.cleanup import ipc_kernel_manager
    from helpers.engine.socket_folder import SUN_PATH_MAX

    long_tmp = tmp_path / ("t" * max(1, SUN_PATH_MAX - len(str(tmp_path)) - 20))
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    km = ipc_kernel_manager(KernelManager)(kernel_name="python3")
    km.start_kernel()
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        reply = kc.execute_interactive("6 * 7", timeout=60)
        kc.stop_channels()
        assert reply["content"]["status"] == "ok"
        assert not km.ip.startswith(str(long_tmp)) and len(km.ip) + len("-5") < SUN_PATH_MAX, km.ip
    finally:
        km.shutdown_kernel(now=True)
    assert not list(Path(km.ip).parent.glob(Path(km.ip).name + "*")), "socket files left"


@pytest.mark.timeout(120)
def test_fail_fast_skips_the_rest(nbdir, profiles, tmp_path, capsys):
    rc = rn.main(["--fail-fast", "02_fail", "01", *common_args(nbdir, profiles, tmp_path)])
    out = capsys.readouterr().out
    assert rc == rn.EXIT_FAILED
    rows = table_rows(out)
    assert rows["02_fail"][0] == "FAILED"
    assert rows["01_ok"][0] == "skipped"
    assert not (tmp_path / "build" / "smoke" / "01_ok.ipynb").exists()


@pytest.mark.timeout(360)
def test_cli_timeout_names_cell_and_kills_kernel_tree(nbdir, profiles, tmp_path):
    t0 = time.monotonic()
    res = run_cli(["03", "--cell-timeout", "2", *common_args(nbdir, profiles, tmp_path)])
    elapsed = time.monotonic() - t0
    assert res.returncode == 1, res.stdout + res.stderr
    assert table_rows(res.stdout)["03_sleep"][0] == "TIMEOUT"
    assert "03_sleep: cell 3: `time.sleep(300)`: timed out after 2 s (cell timeout)" in res.stdout
    # the run ended before the cell's sleep could have (no bound on a loaded machine's speed)
    assert elapsed < 300, f"the runner waited for the cell: {elapsed:.0f} s"
    pids = [int(p) for p in (nbdir / "sleep_pids.txt").read_text().split()]
    assert len(pids) == 2
    assert_gone(pids)
    assert (tmp_path / "build" / "smoke" / "03_sleep.ipynb").is_file()
    # the run folder the cell held: removed by its reaper, which the tree kill must spare
    folder = Path((nbdir / "run_folder.txt").read_text())
    assert folder.parent == nbdir / "tmp" and folder.name.startswith("ddp-lab-launch-"), folder
    assert not folder.exists(), f"{folder} was left behind: the run-folder reaper was killed with the kernel's tree"


@pytest.mark.timeout(120)
def test_leftover_process_fails_the_notebook_and_is_killed(nbdir, profiles, tmp_path, monkeypatch):
    monkeypatch.setattr(execution, "LEFTOVER_GRACE_S", 0.5)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    rows = rn.run_notebooks(["04_leak"], output_dir=tmp_path / "build", notebooks_dir=nbdir,
                            manifest=profiles)
    (row,) = rows
    assert row["status"] == "FAILED", row
    assert row["processes_left"] == 1, row
    assert "04_leak: 1 process(es) left behind" in row["error"]
    pid = int((nbdir / "leak_pid.txt").read_text())
    assert f"pid {pid} " in row["error"]
    assert_gone([pid])
    after = [p for p in me.children(recursive=True) if p.pid not in before]
    assert not after, f"runner left children (zombies included): {after}"


@pytest.mark.timeout(120)
def test_kernel_death_orphans_are_found(nbdir, profiles, tmp_path, monkeypatch):
    monkeypatch.setattr(execution, "LEFTOVER_GRACE_S", 0.5)
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    (row,) = rn.run_notebooks(["05"], output_dir=tmp_path / "build", notebooks_dir=nbdir,
                              manifest=profiles)
    assert row["status"] == "FAILED", row
    assert row["error"].startswith("05_die: cell 3: `os.kill(os.getpid(), 9)`: the kernel died"), row
    assert "1 process(es) left behind" in row["error"]
    assert_gone([int((nbdir / "die_pid.txt").read_text())])
    after = [p for p in me.children(recursive=True) if p.pid not in before]
    assert not after, f"runner left children (zombies included): {after}"


def run_main(args, capsys):
    rc = rn.main(args)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("args, messages", [
    (["07", "nope"], ["unknown notebook '07'", "unknown notebook 'nope'", "01_ok", "02_fail", "04_leak"]),
    (["--profile", "huge", "01"], ["unknown profile 'huge'", "smoke", "full"]),
    (["01", "02", "-p", "epochs=3"], ["01_ok: unknown parameter 'epochs'", "02_fail: unknown parameter "
                                      "'epochs'", "flag, maybe, n, name, x"]),
    (["01", "-p", "oops"], ["NAME=VALUE"]),
])
def test_refused_before_anything_runs(nbdir, profiles, tmp_path, capsys, args, messages):
    """Unknown notebooks (the available ones listed), profile or parameter: exit 2, nothing run."""
    rc, out, err = run_main([*args, *common_args(nbdir, profiles, tmp_path)], capsys)
    assert rc == 2 and all(m in err for m in messages), err
    assert not (tmp_path / "build").exists()


@pytest.mark.parametrize(
    "value, given",
    [("many", "str"), (True, "bool"), (2.5, "float"), ([1], "list")],
)
def test_wrong_type_in_profile(nbdir, tmp_path, capsys, value, given):
    prof = tmp_path / "bad.toml"
    prof.write_text('[[lesson]]\nstem = "01_ok"\ntitle = "ok"\noutcome = "pass"\n'
                    f'[lesson.smoke]\nn = {json.dumps(value)}\n')
    rc, out, err = run_main(["01", "--notebooks-dir", str(nbdir), "--manifest", str(prof),
                             "--output-dir", str(tmp_path / "build")], capsys)
    assert rc == 2
    assert "01_ok: parameter 'n' must be an int, but it is " in err
    assert f"({given}) (from profile 'smoke' in bad.toml; the notebook's default is 2)" in err
    assert "`n = 2` in that profile's table" in err
    assert not (tmp_path / "build").exists()


def test_cli_values_are_typed_against_defaults(nbdir, profiles, tmp_path, capsys):
    rc, out, err = run_main(
        ["01", "--list", "-p", "x=3", "-p", "name=42", "-p", "flag=True", "-p", "maybe=[1, 2]",
         *common_args(nbdir, profiles, tmp_path)], capsys)
    assert rc == 0, err
    assert "01_ok: {'n': 5, 'x': 3, 'name': '42', 'flag': True, 'maybe': [1, 2]}" in out
    rc, out, err = run_main(["01", "--list", "-p", "n=abc", *common_args(nbdir, profiles, tmp_path)], capsys)
    assert rc == 2
    assert "parameter 'n' must be an int, but it is 'abc' (str) (from -p n=abc" in err and "`-p n=2`" in err


def test_full_profile_accepts_int_for_float(nbdir, profiles, tmp_path, capsys):
    rc, out, err = run_main(["--profile", "full", "--list", "01", *common_args(nbdir, profiles, tmp_path)], capsys)
    assert rc == 0, err
    assert "01_ok: {'n': 50, 'x': 2}" in out


def test_missing_parameters_cell(tmp_path, profiles, capsys):
    d = tmp_path / "nb"
    make_notebook(d / "01_ok.ipynb", OK_CELLS)
    make_notebook(d / "02_noparams.ipynb", ["print(1)"], params=None)
    rc, out, err = run_main(["--notebooks-dir", str(d), "--manifest", str(profiles),
                             "--output-dir", str(tmp_path / "build")], capsys)
    assert rc == 2
    assert "02_noparams: no cell tagged 'parameters'" in err
    assert not (tmp_path / "build").exists()


def test_empty_notebooks_dir(tmp_path, profiles, capsys):
    (tmp_path / "empty").mkdir()
    rc, out, err = run_main(["--notebooks-dir", str(tmp_path / "empty"), "--manifest", str(profiles)], capsys)
    assert rc == 2 and "no notebooks" in err


def test_name_resolution(nbdir, tmp_path):
    make_notebook(nbdir / "06_a.ipynb", OK_CELLS)
    make_notebook(nbdir / "06_b.ipynb", OK_CELLS)
    resolve = rn.resolve_notebooks
    assert [p.name for p in resolve(None, nbdir)] == [
        "01_ok.ipynb", "02_fail.ipynb", "03_sleep.ipynb", "04_leak.ipynb", "05_die.ipynb", "06_a.ipynb",
        "06_b.ipynb"]
    assert resolve(["1"], nbdir) == [nbdir / "01_ok.ipynb"]
    assert resolve(["03_sleep", str(nbdir / "01_ok.ipynb"), "01_ok.ipynb", "03"], nbdir) == [
        nbdir / "03_sleep.ipynb", nbdir / "01_ok.ipynb"]
    with pytest.raises(rn.ConfigError, match="ambiguous: 06_a, 06_b"):
        resolve(["06"], nbdir)
    make_notebook(nbdir / "07a_first.ipynb", OK_CELLS)  # a lesson label: the stem's part before "_"
    make_notebook(nbdir / "07b_second.ipynb", OK_CELLS)
    assert resolve(["07b", "07a"], nbdir) == [nbdir / "07b_second.ipynb", nbdir / "07a_first.ipynb"]
    with pytest.raises(rn.ConfigError, match="unknown notebook '07c'"):
        resolve(["07c"], nbdir)
    with pytest.raises(rn.ConfigError, match="no such notebook file"):
        resolve([str(tmp_path / "missing.ipynb")], nbdir)


def test_paths_that_cannot_work_are_refused_before_anything_runs(nbdir, profiles, tmp_path, capsys):
    """An output folder that is a file (or lies under one), a notebook's .py twin given as the
    notebook, a notebooks folder that does not exist: exit 2, a message naming the path, nothing
    written (the runner's CLI and the student copies alike)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for out in (afile, afile / "sub"):
        rc, _, err = run_main(["01", "--notebooks-dir", str(nbdir), "--manifest", str(profiles),
                               "--output-dir", str(out)], capsys)
        assert rc == 2 and f"{afile} exists and is not a folder" in err, err
    assert student_copies.main(["01", "--output-dir", str(afile)]) == 2
    assert f"{afile} exists and is not a folder" in capsys.readouterr().err
    twin = nbdir / "01_ok.py"
    twin.write_text("# %%\n")
    rc, _, err = run_main([str(twin), *common_args(nbdir, profiles, tmp_path)], capsys)
    assert rc == 2 and "is a Python file, not a notebook" in err and "'01_ok.ipynb'" in err, err
    rc, _, err = run_main(["01", "--notebooks-dir", str(tmp_path / "nowhere"), "--manifest", str(profiles),
                           "--output-dir", str(tmp_path / "build")], capsys)
    assert rc == 2 and "does not exist or is not a folder" in err and "nowhere" in err, err
    assert afile.read_text() == "" and not (tmp_path / "build").exists()


@pytest.mark.timeout(120)
def test_cli_sigterm_ends_the_run_like_ctrl_c(nbdir, profiles, tmp_path):
    """SIGTERM (``kill``, a cancelled CI job) while a cell runs: exit 143 with a message, the
    kernel and the processes its cell started are ended, and no kernel connection file is left
    in the runner's temp directory."""
    tmp = tmp_path / "runner_tmp"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, str(RUNNER), "03", *common_args(nbdir, profiles, tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                            env={**os.environ, "TMPDIR": str(tmp)})
    pids_file = nbdir / "sleep_pids.txt"
    deadline = time.monotonic() + 60
    while not pids_file.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)  # the cell moves on to its time.sleep(300)
    proc.terminate()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, out + err
    assert "terminated (SIGTERM): the running notebook was stopped and its kernel ended" in err, err
    assert_gone([int(p) for p in pids_file.read_text().split()], within=10)
    left = sorted(p.name for p in tmp.iterdir() if p.name.startswith(("kernel-", "tmp")))
    assert not left, f"kernel files left in the runner's temp directory: {left}"


def test_bad_manifest(nbdir, tmp_path, capsys):
    prof = tmp_path / "p.toml"
    record = '[[lesson]]\nstem = "01_ok"\ntitle = "ok"\noutcome = "pass"\n'
    for content, message in [
        ("[[lesson", "cannot read the lesson manifest"),
        (record + "[lesson.huge]\nn = 1\n", "unknown keys ['huge']"),
        (record.replace('title = "ok"\n', ""), "needs a text for title"),
    ]:
        prof.write_text(content)
        rc, out, err = run_main(["01", "--notebooks-dir", str(nbdir), "--manifest", str(prof)], capsys)
        assert rc == 2 and message in err, err
    (nbdir / "lessons.toml").write_text(record + record.replace("01_ok", "09_missing"))
    rc, out, err = run_main(["--notebooks-dir", str(nbdir), "--list"], capsys)
    assert rc == 2 and "09_missing.ipynb" in err, err


def test_expected_type_inference():
    et = rn.expected_type
    assert et({"inferred_type_name": "None", "default": "3"}) == ("int", False)
    assert et({"inferred_type_name": "None", "default": "-1e-3"}) == ("float", False)
    assert et({"inferred_type_name": "None", "default": "None"}) == (None, True)
    assert et({"inferred_type_name": "None", "default": "2 ** 10"}) == (None, True)
    assert et({"inferred_type_name": "int", "default": "3"}) == ("int", False)
    assert et({"inferred_type_name": "Optional[int]", "default": "None"}) == ("int", True)
    assert et({"inferred_type_name": "list[int]", "default": "[1]"}) == ("list", False)
    assert et({"inferred_type_name": "str | None", "default": "None"}) == ("str", True)


def test_parameter_papermill_cannot_parse_is_still_checked(tmp_path, profiles, capsys):
    d = tmp_path / "nb"
    make_notebook(d / "01_eq.ipynb", ["pass"], params="steps = 200  # 0 = all\nlr = 0.1\n")
    args = ["--notebooks-dir", str(d), "--manifest", str(profiles), "--list"]
    rc, out, err = run_main([*args, "-p", "steps=5"], capsys)
    assert rc == 0 and "01_eq: {'steps': 5}" in out, err
    rc, out, err = run_main([*args, "-p", "steps=0.5"], capsys)
    assert rc == 2 and "parameter 'steps' must be an int" in err


def test_gpu_profile_refused_without_cuda(capsys):
    """The gpu profile never 'passes' on a CPU machine by skipping: it is refused before running."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the gpu profile would run")
    assert rn.main(["--profile", "gpu", "01"]) == rn.EXIT_USAGE
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_gpu_profile_runs_01_and_04_on_one_rank():
    """docs/CLUSTER.md's gpu profile: 01 and 04 run with world_size 1 (nccl for one rank, real
    nn.DataParallel on the one device); the others keep their defaults."""
    from helpers import lessons

    profiles = {lesson.stem: lesson.profiles.get("gpu") for lesson in lessons.load()}
    gpu = {stem for stem, values in profiles.items() if values}
    assert {"01_gradients_dp_vs_ddp", "04_mnist_single_dp_ddp"} <= gpu, gpu
    assert all(profiles[stem].get("world_size") == 1 for stem in gpu), profiles


@pytest.mark.parametrize("value, default", [
    (2, "1"), (2.5, "1"), (True, "1"), (3, "0.5"), (True, "0.5"), ("2", "1"), ([1, 2], "(1, 2)"),
    ((1, 2), "[0]"), ([1], "{1}"), (None, "1"), ({"a": 1}, "{}"), (False, "True"), (1, "True"),
])
def test_runner_and_notebook_agree_on_every_value(value, default):
    """One rule: the runner's pre-flight check accepts a value exactly when the notebook's own
    check_parameters does (for the type the parameters cell's default has), with one message."""
    import ast

    from helpers import notebook as hn

    declared = {"p": {"name": "p", "inferred_type_name": "None", "default": default, "help": ""}}
    final, errors = rn.type_check_parameters("01_x", declared, {"p": (value, "profile 'smoke' in t.json")})
    try:
        hn.check_parameters(p=(value, type(ast.literal_eval(default))))
        notebook_error = None
    except TypeError as e:
        notebook_error = str(e)
    assert (errors == []) == (notebook_error is None), (errors, notebook_error)
    if errors:
        (runner_error,) = errors
        notebook_line = notebook_error.splitlines()[1].strip()
        assert f"but it is {value!r} ({type(value).__name__})" in notebook_line, notebook_line
        # the same sentence; the runner adds the notebook's name before it, where the value came from after it
        assert runner_error.split(" (from ", 1)[0] == f"01_x: {notebook_line.split('. Pass ', 1)[0]}", (
            runner_error, notebook_line)
        assert f"({type(value).__name__}) (from profile 'smoke' in t.json" in runner_error, runner_error
    else:
        assert final == {"p": value}

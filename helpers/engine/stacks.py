"""Where each rank is stuck: its Python stack, dumped on a signal, summarised to the learner's code.

Before a timed-out or interrupted launch (or warm-rank call) ends its ranks, it asks each for its
Python stack with :mod:`faulthandler`:

- in each rank, :func:`register`: ``faulthandler.register(SIGUSR1, all_threads=True)`` into
  ``stacks/<rank>.txt`` of the run folder; the handler is C code that needs no GIL, so it dumps even
  while the rank is blocked inside gloo or NCCL;
- in the caller, :func:`collect`: SIGUSR1 to the unfinished ranks, then the dumps read;
- :func:`summary`: a few lines per rank: its innermost frames in the learner's code (the caller
  looks the lines up) and the library call it is in (``torch.distributed.all_reduce``);
- :func:`state`: own code, a ``torch.distributed`` call, a backward or DDP, or a simulated turn.

Reference: https://docs.python.org/3/library/faulthandler.html
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import threading
import time
import traceback

import psutil

from helpers.engine.run_dir import read_markers
from helpers.engine.tracebacks import Frame, format_frames, is_hidden

__all__ = ["NEVER_MET", "SIGNAL", "collect", "dump_wait_s", "of_threads", "of_unfinished",
           "px_cell_name", "ranks_phrase", "register", "registered", "spans", "state", "stuck_frames",
           "summary", "timeout_advice"]

#: The signal that asks a rank for its stacks (``None`` where there is no SIGUSR1: Windows).
SIGNAL = getattr(signal, "SIGUSR1", None)
STACKS_DIR = "stacks"  # below the run folder: stacks/<rank>.txt
_WAIT_S = 3.0  # how long collect waits for the dumps on an idle machine (seconds; see dump_wait_s)
_MAX_WAIT_S = 30.0  # ... and at most, however loaded (seconds)
_STEADY_S = 0.2  # a dump unchanged for this long is complete, on an idle machine (seconds)
#: :func:`collect`'s text for a rank that is stopped (state T: SIGSTOP, Ctrl-Z, a debugger): it dumps nothing.
STOPPED = "stopped (state T)\n"
_FILE = None  # this rank's open dump file: faulthandler writes to its descriptor until the rank ends


def _path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, STACKS_DIR, f"{rank}.txt")


def register(run_dir: str, rank: int) -> None:
    """In a rank, before its pid marker is written: dump every thread's Python stack to
    ``run_dir/stacks/<rank>.txt`` on :data:`SIGNAL` (a no-op without one)."""
    global _FILE
    if SIGNAL is None:
        return
    os.makedirs(os.path.join(run_dir, STACKS_DIR), exist_ok=True)
    _FILE = open(_path(run_dir, rank), "w")  # noqa: SIM115 - open for the life of the rank
    faulthandler.register(SIGNAL, file=_FILE, all_threads=True)


def _load() -> float:
    """Runnable processes per CPU core, at least 1.0: the 1-minute load average, or the processes
    runnable now (``/proc/loadavg``'s fourth field, Linux) when more (the average lags a sudden load)."""
    runnable = 0.0
    try:
        runnable = os.getloadavg()[0]
        with open("/proc/loadavg") as f:
            runnable = max(runnable, float(f.read().split()[3].split("/")[0]))
    except (OSError, AttributeError, IndexError, ValueError):
        pass
    return max(1.0, runnable / (os.cpu_count() or 1))


def registered(run_dir: str) -> list[int]:
    """The ranks that have registered their dump (:func:`register`) in ``run_dir``."""
    try:
        names = os.listdir(os.path.join(run_dir, STACKS_DIR))
    except OSError:
        return []
    return sorted(int(n[:-4]) for n in names if n.endswith(".txt") and n[:-4].isdigit())


def dump_wait_s() -> float:
    """How long :func:`collect` waits for the dumps: :data:`_WAIT_S` seconds on an idle machine, that
    times the runnable processes per core on a loaded one (a rank waits its turn for a core before its
    handler runs: at load average 10 on 2 cores, about 5 turns), at most :data:`_MAX_WAIT_S`."""
    return min(_MAX_WAIT_S, _WAIT_S * _load())


def collect(run_dir: str, pids: dict[int, int], wait_s: float | None = None) -> dict[int, str]:
    """In the launcher: send :data:`SIGNAL` to each ``{rank: pid}`` (ranks that registered) and
    return ``{rank: dump text}`` of the dumps complete within ``wait_s`` seconds (``None``:
    :func:`dump_wait_s`, longer on a loaded machine)."""
    if SIGNAL is None or not pids:
        return {}
    steady_s = _STEADY_S * _load()
    wait_s = dump_wait_s() if wait_s is None else wait_s
    asked, texts = {}, {}
    for rank, pid in pids.items():
        try:
            if psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                texts[rank] = STOPPED  # its handler cannot run: no dump to wait for
                continue
            os.kill(pid, SIGNAL)
            asked[rank] = _path(run_dir, rank)
        except (OSError, psutil.Error):
            pass
    sizes: dict[int, tuple[int, float]] = {}  # rank -> (size, since when)
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank, path in list(asked.items()):
            try:
                size = os.path.getsize(path)
            except OSError:
                continue
            now = time.monotonic()
            if size == 0 or sizes.get(rank, (-1, now))[0] != size:
                sizes[rank] = (size, now)
            elif now - sizes[rank][1] >= steady_s:
                with open(path, errors="replace") as f:
                    texts[rank] = f.read()
                del asked[rank]
    for rank, path in asked.items():  # late: whatever is there
        try:
            with open(path, errors="replace") as f:
                if text := f.read():
                    texts[rank] = text
        except OSError:
            pass
    return texts


_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")
_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>.+)$')
#: Library frames that only pass a call on (decorators): the call's name is the next frame's.
_PASS_ON = {"wrapper", "inner", "decorate_context", "_fn", "fn", "<lambda>"}
#: Where a library function lives -> the name learners call it by.
_PUBLIC = {"torch.distributed.distributed_c10d": "torch.distributed",
           "torch.distributed.c10d_logger": "torch.distributed"}


def _threads(dump: str) -> list[list[Frame]]:
    """Each thread's frames in a faulthandler dump, outermost first (the dump lists innermost first)."""
    threads: list[list[Frame]] = []
    for line in dump.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].insert(0, Frame(m["file"], int(m["line"]), m["name"], ""))
    return threads


def _module(file: str) -> str:
    """``torch.distributed`` for ``.../site-packages/torch/distributed/distributed_c10d.py``."""
    parts = os.path.abspath(file).split(os.sep)
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            parts = parts[len(parts) - parts[::-1].index(marker):]
            break
    else:
        parts = parts[-1:]
    dotted = ".".join(parts).removesuffix(".py").removesuffix(".__init__")
    return _PUBLIC.get(dotted, dotted)


#: ``(file name ending, function)`` of the frame that calls the learner's code: a launch's rank
#: (rank_main.py), a warm rank's ``run`` (warm_ranks_remote.call) and ``%%px`` cell (IPython's run_code).
#: From this many stacks on, :func:`summary` shows ranks stuck at the same place once (a simulated cluster).
_GROUP_FROM = 8
_ENTRIES = (("rank_main.py", "worker_entry"), ("warm_ranks_remote.py", "call"), ("interactiveshell.py", "run_code"),
            ("simulated.py", "_run_rank"))


def _is_entry(frame: Frame) -> bool:
    return any(frame.name == name and frame.file.endswith(end) for end, name in _ENTRIES)


def _main_thread(dump: str) -> list[Frame]:
    """The frames of the thread running the learner's code (the one with an :data:`_ENTRIES` frame)."""
    threads = _threads(dump)
    return next((t for t in threads if any(map(_is_entry, t))), threads[0] if threads else [])


def stuck_frames(dump: str) -> tuple[list[Frame], str]:
    """``(own frames, library call)`` of the rank's thread running the learner's code (below an
    :data:`_ENTRIES` frame): the learner's frames, outermost first, and ``"torch.distributed.all_reduce"``
    for the library call the innermost of them is in (``""`` if none: the rank is in its own code, e.g. a sleep)."""
    main = _main_thread(dump)
    start = max((i + 1 for i, f in enumerate(main) if _is_entry(f)), default=0)
    frames = main[start:]
    own = [i for i, f in enumerate(frames) if not is_hidden(f.file)]
    below = frames[own[-1] + 1:] if own else frames
    call = next((f for f in below if f.name not in _PASS_ON and not f.name.startswith("_")), None)
    return [frames[i] for i in own], (f"{_module(call.file)}.{call.name}" if call else "")


#: The library calls that run a backward pass (where DDP's gradient all-reduce waits, in C++).
_BACKWARD = {"torch._tensor.backward", "torch.autograd.backward", "torch.autograd.grad"}


def state(dump: str) -> tuple[str, str]:
    """What a rank was doing when its stack was dumped: ``(kind, library call)``, kind one of ``"own"``
    (its own code: a sleep, a loop), ``"rendezvous"`` (``init_process_group``), ``"collective"`` (another
    ``torch.distributed`` call), ``"ddp"`` (a backward or DDP: computing, or in DDP's C++ all-reduce),
    ``"library"`` (another library), ``"turn"`` (a simulated rank waiting for its first turn),
    ``"stopped"`` (state T, :data:`STOPPED`), ``"unknown"`` (an empty or cut dump)."""
    if dump == STOPPED:
        return "stopped", ""
    own, call = stuck_frames(dump)
    if not own and any(f.name == "wait" and os.path.basename(f.file) == "simulated.py"
                   for t in _threads(dump) for f in t):
        return "turn", ""
    if not call:
        return ("own" if own else "unknown"), ""
    if call.endswith(".init_process_group"):
        return "rendezvous", call
    if call.startswith("torch.distributed."):
        return "collective", call
    if call in _BACKWARD or call.startswith("torch.nn.parallel."):
        return "ddp", call
    if any(f.file.endswith("distributed_c10d.py") for f in _main_thread(dump)):
        return "collective", call  # a library call that waits in one (helpers.replicas.assert_in_sync)
    return "library", call


def px_cell_name(code: str) -> str:
    """The base name of the file a warm rank's frames carry for a ``%%px`` cell of ``code``: ipyparallel's
    engine runs it with IPython's ``run_cell``, whose compiler (ipykernel's ``XCachingCompiler``) names it
    ``<tmp>/ipykernel_<engine pid>/<murmur2 hash of the code>.py`` (ipykernel/compiler.py); the engine writes
    no such file, so :func:`summary` takes the line from ``code`` (see its ``cells``)."""
    from ipykernel.compiler import get_file_name  # this process's pid in the folder: the base name only

    return os.path.basename(get_file_name(code))


def _in_cell(frame: Frame, cells: dict[str, tuple[str, str, int]]) -> Frame:
    """``frame`` with its cell's label and source line, when its file is one of ``cells``
    (``{px_cell_name(code): (label, code, lines above the code)}``, e.g. ``("Cell In[4]", code, 1)``
    for a notebook cell whose first line is ``%%px``: its line numbers count that line)."""
    label, code, above = cells.get(os.path.basename(frame.file), ("", "", 0))
    if not label:
        return frame
    lines = code.splitlines()
    source = lines[frame.line - 1].strip() if 0 < frame.line <= len(lines) else ""
    return frame._replace(source=source, label=f"{label}, line {frame.line + above}")


def summary(stacks: dict[int, str], shell=None, full: str = "the error's .stacks", most: int = 2,
            cells: dict[str, tuple[str, str, int]] | None = None) -> list[str]:
    """A few lines per rank: where it is stuck, its ``most`` innermost own frames (cell names in
    IPython when ``shell`` is given; ``%%px`` cells' names and lines from ``cells``, see :func:`_in_cell`)
    with their source lines. ``[]`` without dumps."""
    if not stacks:
        return []
    lines = [f"Where each rank was stuck (your code, most recent call last; all frames in {full}):"]
    places: dict[tuple, tuple[list[int], list[Frame], str]] = {}  # where -> (ranks stuck there, frames, call)
    for rank in sorted(stacks):
        own, call = stuck_frames(stacks[rank])
        own = [_in_cell(f, cells or {}) for f in own][-most:]
        if not own and state(stacks[rank])[0] in ("turn", "stopped"):
            call = {"turn": "its turn", "stopped": "stopped"}[state(stacks[rank])[0]]
        key = (tuple(own), call) if len(stacks) > _GROUP_FROM else (rank,)
        places.setdefault(key, ([], own, call))[0].append(rank)
    for ranks, own, call in places.values():
        name = ranks_phrase(ranks, verb=False)
        where = f" in {call}" if call else ""
        if call in ("its turn", "stopped"):
            lines.append(f"  {name}: " + ("waiting for a turn to start your function" if call == "its turn"
                                          else "stopped (state T), so no stack"))
            continue
        if not own:
            lines.append(f"  {name}: not in your code{where}")
            continue
        lines.append(f"  {name}{where}, called from:" if call else f"  {name}, at:")
        lines += [f"  {line}" for line in format_frames(own, shell)]
    return lines


def of_unfinished(run_dir: str, poll_s: float = 0.05) -> dict[int, str]:
    """In the launcher, on a timeout or an interrupt: ``{rank: Python stack dump}`` of the ranks
    without a done or error marker, asked for before they are ended (:func:`collect`) from every
    rank that registered its dump (a rank writes its pid marker just after: waited for, briefly);
    ``{}`` if interrupted again."""
    try:
        deadline = time.monotonic() + dump_wait_s()
        while True:
            finished = set(read_markers(run_dir, "done")) | set(read_markers(run_dir, "error"))
            pids = {r: info["pid"] for r, info in read_markers(run_dir, "pid").items() if r not in finished}
            dumping = set(registered(run_dir)) - finished
            if dumping <= set(pids) or time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        return collect(run_dir, pids)
    except KeyboardInterrupt:  # a second interrupt: skip the diagnosis, never the clean-up
        return {}


def of_threads(threads: dict[int, threading.Thread]) -> dict[int, str]:
    """``{rank: Python stack}`` of the live ``threads`` of this process (simulated ranks), in a
    dump's format."""
    frames, dumps = sys._current_frames(), {}
    for rank, t in threads.items():
        if t.ident in frames:
            walk = traceback.walk_stack(frames[t.ident])
            dumps[rank] = f"Thread 0x{t.ident:016x} (most recent call first):\n" + "".join(
                f'  File "{f.filename}", line {f.lineno} in {f.name}\n'
                for f in traceback.StackSummary.extract(walk, lookup_lines=False))
    return dumps


# ---- what the unfinished ranks were doing, and what to do (LaunchTimeout, RanksTimeout) --------

#: What to do when every unfinished rank is in ``torch.distributed.init_process_group`` (its rendezvous
#: waits there until ``world_size`` ranks have joined the store at ``MASTER_ADDR:MASTER_PORT``).
NEVER_MET = ("Every unfinished rank is still in init_process_group: the ranks never met. Check that every "
             "rank uses the same MASTER_ADDR and MASTER_PORT, that world_size is the number of ranks "
             "started and each rank is one of 0 .. world_size - 1 (without rank= and world_size=, "
             "init_process_group reads RANK and WORLD_SIZE from os.environ: a value left there from "
             "another run counts too).")


def timeout_advice(ranks: list[int], stacks: dict[int, str], lift: str) -> str:
    """What the unfinished ``ranks`` were doing (from their ``stacks``) and what to do: a rank still in
    its own code (sleeping or computing) is named apart from the ranks waiting in a collective, and
    mismatched collectives are blamed only when every unfinished rank waits in one."""
    kinds: dict[str, list[int]] = {}
    calls: dict[int, str] = {}
    for rank in ranks:
        try:
            kind, calls[rank] = state(stacks[rank]) if rank in stacks else ("unknown", "")
        except Exception:  # noqa: BLE001 - a dump we cannot read
            kind = "unknown"
        kinds.setdefault(kind, []).append(rank)
    busy, stopped = kinds.get("own", []) + kinds.get("library", []), kinds.get("stopped", [])
    waiting = sorted(kinds.get("collective", []) + kinds.get("rendezvous", []) + kinds.get("ddp", []))
    parts = []
    if stopped:
        parts.append(f"{ranks_phrase(stopped, verb=False).capitalize()} {'is' if len(stopped) == 1 else 'are'} "
                     "stopped, not running (state T: a SIGSTOP, Ctrl-Z in a terminal or a debugger stops a process), "
                     "so it could not finish: find what stopped it (`kill -CONT <pid>` resumes a stopped process).")
    if busy:
        by_call: dict[str, list[int]] = {}
        for r in busy:
            if calls.get(r):
                by_call.setdefault(calls[r], []).append(r)
        where = "; ".join(f"{ranks_phrase(rs, verb=False)} in {call}" for call, rs in by_call.items())
        parts.append(f"{ranks_phrase(busy)} still running your function's own work (sleeping or computing"
                     f"{': ' + where if where else ''}), not waiting in a collective.")
    for group, how in ((sorted(kinds.get("collective", []) + kinds.get("rendezvous", [])), "waiting in {}"),
                       (kinds.get("ddp", []), "in {} (computing, or waiting in DDP's all-reduce for the other ranks)")):
        if not group:
            continue
        end = f", most likely for {ranks_phrase(stopped + busy, verb=False)}." if stopped or busy else "."
        named = dict.fromkeys(calls[r] for r in group)
        if len(named) == 1:
            parts.append(f"{ranks_phrase(group)} {how.format(next(iter(named)))}{end}")
        else:  # each rank's call, so that two different collectives read as such
            each = ", ".join(f"rank {r} in {calls[r]}" for r in group)
            parts.append(f"{ranks_phrase(group)} {how.format('different calls')} ({each}){end}")
    if kinds.get("turn"):
        behind = f", behind {ranks_phrase(busy, verb=False)}" if busy else ""
        parts.append(f"{ranks_phrase(kinds['turn'])} waiting for a turn to start your function (simulated "
                     f"ranks run one at a time and give their turn up only in a collective){behind}.")
    if kinds.get("unknown"):
        parts.append(f"No stack came from {ranks_phrase(kinds['unknown'], verb=False)}.")
    if set(kinds) == {"rendezvous"}:
        parts = [NEVER_MET]
    elif stopped and not busy:
        pass
    elif busy and waiting:
        parts.append(f"If that work is simply long, {lift}; if it never reaches the call the others wait in, "
                     "that is the bug.")
    elif busy:
        parts.append(f"If that work is simply long, {lift}.")
    elif waiting and not kinds.get("unknown") and not kinds.get("rendezvous"):
        parts.append("A rank that skips a collective (all_reduce, barrier, DDP's backward) leaves the others "
                     "waiting forever: check that every rank makes the same collective calls in the same "
                     f"order, with tensors of the same shape and dtype. If the work is simply long, {lift}.")
    else:
        parts.append(f"If the work is simply long, {lift}; a rank that skips a collective (all_reduce, barrier, "
                     "DDP's backward) leaves the others waiting forever.")
    return " ".join(parts)


def ranks_phrase(ranks: list[int], verb: bool = True) -> str:
    """``"Rank 0 was"`` / ``"Ranks 0, 2 were"`` (``verb=False``: ``"rank 0"`` / ``"ranks 0, 2"``); four or
    more consecutive ranks read as a span: ``"ranks 1-63"``."""
    names = spans(ranks)
    if not verb:
        return f"rank {names}" if len(ranks) == 1 else f"ranks {names}"
    return f"Rank {names} was" if len(ranks) == 1 else f"Ranks {names} were"


def spans(ranks: list[int]) -> str:
    """``"0, 2, 5-9"``: ``ranks`` with each run of four or more consecutive ranks as a span."""
    parts, run = [], []
    for r in [*ranks, None]:
        if run and r is not None and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            parts += [f"{run[0]}-{run[-1]}"] if len(run) >= 4 else [str(x) for x in run]
        run = [] if r is None else [r]
    return ", ".join(parts)

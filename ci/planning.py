"""Planning a notebook run: which notebooks, which profile, which parameters, all checked
before anything runs.

Notebook names are a stem (``01_gradients_dp_vs_ddp``), a number prefix (``01``), a lesson label
(``06a``, the stem's part before ``_``) or a path to an ``.ipynb`` file. Parameters, lowest priority
first: the notebook's cell tagged ``parameters``; the profile tables of the folder's lesson
manifest (``notebooks/lessons.toml``, read by :mod:`helpers.lessons`: ``[lesson.full]``,
``[lesson.gpu]`` under a lesson's record); ``-p NAME=VALUE``. Every value is type-checked against the
notebook's ``parameters`` cell (``papermill.inspect_notebook``) with the notebook's own rule
(:func:`helpers.param_types.accepts`); :class:`ConfigError` carries every problem found. Used by
:mod:`ci.execution` and the CLI (:mod:`ci.run_notebooks`).
"""

from __future__ import annotations

import ast
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import nbformat
import papermill

from helpers import lessons as manifest_
from helpers.param_types import PARAMETER_TYPES, type_problem

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_NOTEBOOKS_DIR = REPO_ROOT / "notebooks"

#: Known profiles and their default per-cell timeout in seconds.
PROFILE_CELL_TIMEOUTS: dict[str, int] = {"smoke": 300, "full": 1800, "gpu": 1800}
PROFILES = tuple(PROFILE_CELL_TIMEOUTS)


class ConfigError(Exception):
    """Bad invocation or configuration, detected before any notebook ran (exit code 2)."""


class CliValue(str):
    """A ``-p NAME=VALUE`` text; typed per notebook against the parameter's default."""


def manifest_path(notebooks_dir: str | os.PathLike | None = None) -> Path:
    """The lesson manifest of ``notebooks_dir``: ``lessons.toml`` in it (it may not exist)."""
    folder = Path(notebooks_dir) if notebooks_dir is not None else DEFAULT_NOTEBOOKS_DIR
    return folder / manifest_.MANIFEST.name


def discover_notebooks(notebooks_dir: str | os.PathLike | None = None) -> list[Path]:
    """The notebooks of ``notebooks_dir``: in manifest order when the folder has a
    ``lessons.toml`` (each record's ``<stem>.ipynb``, lessons and casebook pages alike), else
    every ``*.ipynb`` in it, sorted by name (a folder of your own notebooks).

    Raises :class:`ConfigError` when the manifest is unreadable or names a missing notebook.
    """
    folder = Path(notebooks_dir) if notebooks_dir is not None else DEFAULT_NOTEBOOKS_DIR
    if not folder.is_dir():
        return []
    if manifest_path(folder).is_file():
        try:
            stems = manifest_.stems(None, manifest_path(folder))
        except manifest_.ManifestError as e:
            raise ConfigError(str(e)) from None
        missing = [s for s in stems if not (folder / f"{s}.ipynb").is_file()]
        if missing:
            raise ConfigError(f"{manifest_path(folder)} names notebooks that {folder} lacks: "
                              + ", ".join(f"{s}.ipynb" for s in missing))
        return [(folder / f"{s}.ipynb").resolve() for s in stems]
    return sorted((p.resolve() for p in folder.glob("*.ipynb") if not p.name.startswith(".")),
                  key=lambda p: p.name)


def _number_prefix(stem: str) -> int | None:
    m = re.match(r"(\d+)", stem)
    return int(m.group(1)) if m else None


def resolve_notebooks(
    names: Iterable[str] | None, notebooks_dir: str | os.PathLike | None = None
) -> list[Path]:
    """Map notebook names (stem, number prefix, lesson label such as ``06a``, or path) to absolute paths.

    Raises :class:`ConfigError` listing the available notebooks when a name matches none, or
    a number prefix matches several.
    """
    folder = Path(notebooks_dir) if notebooks_dir is not None else DEFAULT_NOTEBOOKS_DIR
    if not folder.is_dir():
        raise ConfigError(f"the notebooks folder {folder} does not exist or is not a folder: pass "
                          "--notebooks-dir with the folder that holds the .ipynb files")
    available = discover_notebooks(folder)
    listing = "\n".join(f"  {p.stem}" for p in available) or "  (none)"
    names = list(names or [])
    if not names:
        if not available:
            raise ConfigError(f"no notebooks (*.ipynb) found in {folder}")
        return available

    chosen: list[Path] = []
    errors: list[str] = []
    for name in names:
        if name.endswith(".py"):  # a notebook's jupytext twin: the .ipynb is what runs
            errors.append(f"{name!r} is a Python file, not a notebook: pass the notebook itself "
                          f"({Path(name).with_suffix('.ipynb').name!r}), its stem or its number")
            continue
        looks_like_path = name.endswith(".ipynb") or "/" in name or os.sep in name
        if looks_like_path:
            p = Path(name)
            if p.is_file():
                chosen.append(p.resolve())
            elif p.parent == Path(".") and (folder / p.name).is_file():
                chosen.append((folder / p.name).resolve())
            else:
                errors.append(f"no such notebook file: {name!r}")
            continue
        exact = [p for p in available if p.stem == name]
        if exact:
            chosen.append(exact[0])
            continue
        if re.fullmatch(r"\d+[a-z]", name):  # a lesson label: 06a matches 06a_training_loop_pitfalls
            labelled = [p for p in available if p.stem.split("_", 1)[0] == name]
            if len(labelled) == 1:
                chosen.append(labelled[0])
                continue
        if name.isdigit():
            matches = [p for p in available if _number_prefix(p.stem) == int(name)]
            if len(matches) == 1:
                chosen.append(matches[0])
                continue
            if len(matches) > 1:
                errors.append(f"notebook number {name!r} is ambiguous: "
                              + ", ".join(p.stem for p in matches))
                continue
        errors.append(f"unknown notebook {name!r}")
    if errors:
        raise ConfigError("\n".join(errors) + f"\navailable notebooks in {folder}:\n{listing}")

    unique = list(dict.fromkeys(chosen))
    stems: dict[str, Path] = {}
    for p in unique:
        if p.stem in stems:
            raise ConfigError(f"two selected notebooks share the name {p.stem!r} (their outputs "
                              f"would collide): {stems[p.stem]} and {p}")
        stems[p.stem] = p
    return unique


def check_profile(profile: str) -> None:
    if profile not in PROFILE_CELL_TIMEOUTS:
        raise ConfigError(f"unknown profile {profile!r}; profiles: {', '.join(PROFILES)}")


def load_profiles(manifest: str | os.PathLike | None = None,
                  notebooks_dir: str | os.PathLike | None = None) -> dict[str, dict[str, dict]]:
    """The profile overrides of a lesson manifest: ``{stem: {profile: {name: value}}}``.

    ``manifest`` defaults to ``notebooks_dir``'s ``lessons.toml``; a folder without one has no
    overrides. Raises :class:`ConfigError` when a given manifest is missing or unreadable.
    """
    path = Path(manifest) if manifest is not None else manifest_path(notebooks_dir)
    if manifest is None and not path.is_file():
        return {}
    try:
        return {lesson.stem: lesson.profiles for lesson in manifest_.load(path)}
    except manifest_.ManifestError as e:
        raise ConfigError(str(e)) from None


def notebook_parameters(path: Path) -> dict[str, dict]:
    """The parameters declared in the notebook's ``parameters`` cell (papermill's view).

    Raises :class:`ConfigError` when there is no cell tagged ``parameters``.
    """
    try:
        nb = nbformat.read(str(path), as_version=4)
    except Exception as e:  # noqa: BLE001 - any unreadable notebook is a config error
        raise ConfigError(f"{path.stem}: cannot read {path}: {e}") from None
    if not any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb.cells):
        raise ConfigError(f"{path.stem}: no cell tagged 'parameters' in {path}")
    try:
        declared = papermill.inspect_notebook(str(path))
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{path.stem}: cannot inspect parameters of {path}: {e}") from None
    # papermill's line-based parser skips e.g. a line whose comment contains '='; top-level
    # assignments it missed are still parameters (their type is taken from the literal default)
    source = next(c.source for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", []))
    for name, annotation, default in parameter_assignments(source):
        declared.setdefault(name, {"name": name, "inferred_type_name": annotation or "None",
                                   "default": default, "help": ""})
    return declared


def parameter_assignments(source: str) -> list[tuple[str, str | None, str]]:
    """``(name, annotation, default source)`` of the top-level ``name = value`` statements."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # e.g. IPython magics; papermill's view is all there is
        return []
    found = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found.append((node.targets[0].id, None, ast.unparse(node.value)))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found.append((node.target.id, ast.unparse(node.annotation), ast.unparse(node.value)))
    return found


_GENERIC_BASES = {"List": "list", "Dict": "dict", "Tuple": "tuple", "Set": "set"}


def expected_type(param: dict) -> tuple[str | None, bool]:
    """``(type name or None when unknown, whether None is acceptable)`` for a parameter.

    Uses papermill's ``inferred_type_name`` (from an annotation or type comment) and, when
    that is absent, the type of the default if the default is a Python literal.
    """
    name = str(param.get("inferred_type_name") or "None").strip()
    if name not in ("None", ""):
        nullable = False
        m = re.fullmatch(r"(?:typing\.)?Optional\[(.+)\]", name)
        if m:
            name, nullable = m.group(1).strip(), True
        if "|" in name:
            parts = [s.strip() for s in name.split("|")]
            nullable = nullable or "None" in parts
            parts = [s for s in parts if s != "None"]
            if len(parts) != 1:
                return None, True
            name = parts[0]
        base = name.split("[", 1)[0].strip().rsplit(".", 1)[-1]
        return _GENERIC_BASES.get(base, base), nullable
    try:
        default = ast.literal_eval(str(param.get("default", "")))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None, True
    if default is None:
        return None, True
    return type(default).__name__, False


def _coerce_cli_value(value: CliValue, expected: str | None) -> Any:
    """A Python literal, else the text; for a ``str`` parameter always a string."""
    try:
        parsed = ast.literal_eval(str(value))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return str(value)
    return str(value) if expected == "str" and not isinstance(parsed, str) else parsed


#: Where to pass a right value, for :func:`helpers.param_types.type_problem`: on the command line or
#: in the lesson manifest's profile table, whichever the wrong value came from.
_CLI_FIX = "`-p {name}={cli}`"
_PROFILE_FIX = "`{name} = {json}` in that profile's table"
_CLI_TEXT_NOTE = "the value arrived as text: write it without quotes."


def type_check_parameters(
    stem: str, declared: dict[str, dict], values: dict[str, tuple[Any, str]]
) -> tuple[dict[str, Any], list[str]]:
    """Type ``values`` (``{name: (value, where it came from)}``) against the notebook's
    ``declared`` parameters (:func:`notebook_parameters`), before any process starts.

    A :class:`CliValue` is first read as a Python literal (as-is text for a ``str`` parameter).
    The rule and the message are the notebook's own (:func:`helpers.param_types.accepts`,
    :func:`helpers.param_types.type_problem`), for the type :func:`expected_type` reads from the
    parameters cell; an unknown name, or an unknown type (no check), is handled here.

    Returns the final parameters and a list of error messages, each starting with ``stem``.
    """
    final: dict[str, Any] = {}
    errors: list[str] = []
    known = ", ".join(sorted(declared)) or "(none)"
    for name, (value, source) in values.items():
        if name not in declared:
            errors.append(f"{stem}: unknown parameter {name!r} (from {source}); the parameters "
                          f"cell declares: {known}")
            continue
        expected, nullable = expected_type(declared[name])
        if isinstance(value, CliValue):
            value = _coerce_cli_value(value, expected)
        if expected in PARAMETER_TYPES:
            types = (PARAMETER_TYPES[expected], None) if nullable else PARAMETER_TYPES[expected]
            from_cli = source.startswith("-p ")
            problem = type_problem(
                name, value, types,
                fix=_CLI_FIX if from_cli else _PROFILE_FIX,
                source=f"{source}; the notebook's default is {declared[name].get('default')}",
                text_note=_CLI_TEXT_NOTE,
            )
            if problem:
                errors.append(f"{stem}: {problem}")
                continue
        final[name] = value
    return final, errors


@dataclass
class Job:
    """One notebook to execute, with its checked parameters (profile and ``-p`` values only;
    the notebook's own defaults are not repeated)."""

    path: Path
    params: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.stem


@dataclass
class Plan:
    """A fully validated run: what :func:`run_notebooks` executes."""

    jobs: list[Job]
    profile: str
    output_dir: Path
    cell_timeout: int | None


def plan_run(
    names: Iterable[str] | None = None,
    profile: str = "smoke",
    output_dir: str | os.PathLike = "build",
    cell_timeout: float | None = None,
    extra_params: dict[str, Any] | None = None,
    *,
    notebooks_dir: str | os.PathLike | None = None,
    manifest: str | os.PathLike | None = None,
) -> Plan:
    """Check everything (names, profile, output folder, manifest, parameters) without running anything.

    Raises :class:`ConfigError` with every problem found.
    """
    check_profile(profile)
    paths = resolve_notebooks(names, notebooks_dir)
    check_output_dir(Path(output_dir) / profile)
    profiles = load_profiles(manifest, notebooks_dir)
    source = Path(manifest).name if manifest is not None else manifest_path(notebooks_dir).name
    if cell_timeout is None:
        timeout: int | None = PROFILE_CELL_TIMEOUTS[profile]
    elif not 0 <= cell_timeout < math.inf:  # nan too
        raise ConfigError(f"--cell-timeout must be a finite number of seconds >= 0 (0 disables it), got {cell_timeout}")
    else:
        timeout = int(math.ceil(cell_timeout)) or None

    jobs: list[Job] = []
    errors: list[str] = []
    for path in paths:
        try:
            declared = notebook_parameters(path)
        except ConfigError as e:
            errors.append(str(e))
            continue
        values: dict[str, tuple[Any, str]] = {}
        for k, v in profiles.get(path.stem, {}).get(profile, {}).items():
            values[k] = (v, f"profile {profile!r} in {source}")
        for k, v in (extra_params or {}).items():
            values[k] = (v, f"-p {k}=" + (str(v) if isinstance(v, CliValue) else repr(v)))
        params, errs = type_check_parameters(path.stem, declared, values)
        errors.extend(errs)
        jobs.append(Job(path, params))
    if errors:
        raise ConfigError("\n".join(errors))
    return Plan(jobs, profile, Path(output_dir).resolve(), timeout)


def check_output_dir(output_dir: str | os.PathLike) -> Path:
    """``output_dir`` as an absolute path, checked before anything runs: it, or the nearest of its
    parents that exists, must be a folder this process can write in (missing folders are created
    later). Raises :class:`ConfigError` saying which path is in the way."""
    target = Path(output_dir).resolve()
    for p in (target, *target.parents):
        if not p.exists():
            continue
        if not p.is_dir():
            raise ConfigError(f"output folder {output_dir}: {p} exists and is not a folder; pass a "
                              "folder path with --output-dir (missing folders are created)")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(f"output folder {output_dir}: {p} is not writable; pass another --output-dir")
        break
    return target


def require_device(profile: str) -> None:
    """Refuse, before any notebook runs, a profile whose hardware is missing (never a silent skip)."""
    if profile == "gpu":
        import torch  # here, not at the top: 1.6 s measured, needed only by the gpu profile

        if not torch.cuda.is_available():
            raise ConfigError("profile 'gpu' runs the notebooks on a CUDA GPU (nccl, real nn.DataParallel), "
                              "but torch.cuda.is_available() is False here; use --profile full on a CPU machine")


def effective_parameters(path: Path, profile: str, extra_params: dict[str, Any] | None = None, *,
                         manifest: str | os.PathLike | None = None) -> dict[str, Any]:
    """Every parameter's value when ``path`` runs in ``profile``: the notebook's defaults, then the
    profile's values, then ``extra_params`` (checked as :func:`plan_run` checks them).

    Two runs with equal results execute the notebook with the same parameters (CI uses this to
    run no notebook twice with the same parameters). A default that is not a Python literal is
    kept as ``("<expression>", source text)``. Raises :class:`ConfigError` like :func:`plan_run`.
    """
    values: dict[str, Any] = {}
    for name, declared in notebook_parameters(path).items():
        try:
            values[name] = ast.literal_eval(str(declared.get("default", "")))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            values[name] = ("<expression>", declared.get("default"))
    (job,) = plan_run([str(path)], profile, extra_params=extra_params, manifest=manifest).jobs
    values.update(job.params)
    return values

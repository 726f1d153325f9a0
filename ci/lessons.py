"""The lesson rules: one table (:data:`RULES`: id, one-line statement, check), one command.

Usage (from the repository root)::

    python3 -m ci.lessons check [03 06a ...]  # every problem of the lessons at once; exit 1 if any
    python3 -m ci.lessons prose [06a ...]     # the prose figures, one row a notebook
    python3 -m ci.lessons rules               # the table, as docs/TESTING.md shows it
    python3 -m ci.lessons language-info       # the metadata for jupytext --update-metadata

Nothing is executed: the rules read the ``.ipynb``, its twin, the glossary and the manifest. A
check yields ``(cell index or None, what is wrong and what to do)``, or a bare cell index whose
message is the rule's statement.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator

import jupytext
import nbformat
import papermill

from ci import marked, prose
from ci.gpu_claims import HELPER, MARKED, calls, check_cells, code_tree, device_branches
from helpers import lessons as manifest
from helpers.jupyter_hooks import LANGUAGE_INFO, committed_form

ROOT = manifest.REPO_ROOT
START, END = "<!-- lesson-rules:start -->", "<!-- lesson-rules:end -->"
GLOSSARY_LINK = "../docs/GLOSSARY.md"
LINK = re.compile(r"\]\((\.\./docs/GLOSSARY\.md)(#[^)\s]*)?\)")
ABSOLUTE_PATH = re.compile(r"/home/|/root/|/work/|/Users/|\b[A-Za-z]:\\")
#: typed run times ("about 4–15 s", "takes 1–3 min", "~50 s"), logistics ("2 CPU cores", "CI")
_UNIT = r"[\d.,–-]+ ?(s|ms|sec|seconds?|min|minutes?)\b"
MACHINERY = [re.compile(rf"\babout {_UNIT}|\btakes? (about |roughly |around )?{_UNIT}|~ ?{_UNIT}",
                        re.I),
             re.compile(r"\b\d+[ -](CPU[ -])?cores?\b|\bCPU cores\b", re.I), re.compile(r"\bCI\b")]
#: every bold label starting with the word Claim or Claims, with or without parenthesis and colon
CLAIM = re.compile(r"\*\*Claims?\b[^*\n]*\*\*:?")
DEVICE_WORD = re.compile(r"\b(?:[CG]PUs?|CUDA)\b")
#: A solution cell's first line (a collapsed cell shows it: no answer there) and metadata.
SOLUTION_FIRST_LINE = "# Solution of exercise"
SOLUTION_CHECK = r'check_answer\("ex\d+", solution_\d+, expected_\d+,[^\n]*strict=True'
SOLUTION_METADATA = {"jupyter": {"source_hidden": True}, "tags": ["solution"]}
MIN_SENTENCES, MAX_LESSON_WORDS = 20, 2_500
EXERCISE = re.compile(r"answer_(\d+) = None\s*(#.*)?")


class Lesson:
    """One notebook of ``notebooks/``: its ``.ipynb`` read once, the rest read when a rule asks."""

    def __init__(self, path: Path, nb=None):
        self.path, self.stem = path, path.stem
        self.raw = path.read_text(encoding="utf-8") if nb is None else nbformat.writes(nb) + "\n"
        self.nb = nbformat.reads(self.raw, as_version=nbformat.NO_CONVERT) if nb is None else nb
        self.cells = self.nb.cells

    @cached_property
    def is_lesson(self) -> bool:
        return self.stem in manifest.stems("lesson", self.path.parent / "lessons.toml")

    def tagged(self, tag: str) -> list[int]:
        return [i for i, c in enumerate(self.cells) if tag in c.get("metadata", {}).get("tags", [])]

    def markdown(self) -> Iterator[tuple[int, str]]:
        return ((i, c.source) for i, c in enumerate(self.cells) if c.cell_type == "markdown")

    def code(self) -> Iterator[tuple[int, str]]:
        return ((i, c.source) for i, c in enumerate(self.cells) if c.cell_type == "code")

    @cached_property
    def answers(self) -> dict[int, str]:
        """Cell index -> N of each learner's ``answer_N = None`` cell."""
        return {i: m.group(1) for i, src in self.code() if (m := EXERCISE.fullmatch(src.strip()))}

    @cached_property
    def prose(self) -> prose.Figures:
        return prose.measure(self.path, self.nb)

    @cached_property
    def papermill_parameters(self) -> set[str]:
        return set(papermill.inspect_notebook(str(self.path)))


@dataclass(frozen=True)
class Rule:
    id: str
    statement: str
    check: Callable[[Lesson], Iterator]
    lessons_only: bool = False  # the path's lessons, not the casebook pages


RULES: list[Rule] = []


def rule(id: str, statement: str, lessons_only: bool = False):
    """Add the decorated check to :data:`RULES`, in the order the rules are written."""
    def add(check):
        RULES.append(Rule(id, statement, check, lessons_only))
        return check
    return add


@rule("nbformat", "The `.ipynb` is valid nbformat 4.")
def _nbformat(ls):
    if ls.nb.nbformat != 4:
        yield None, f"nbformat {ls.nb.nbformat}: write it with jupytext --sync (nbformat 4)"
    try:
        nbformat.validate(ls.nb)
    except nbformat.ValidationError as e:
        yield None, f"invalid notebook: {e.message}"


@rule("twin", "A jupytext twin `NN_name.py` holds the same cells (type, source, tags), paired in "
      "the metadata.")
def _twin(ls):
    twin = ls.path.with_suffix(".py")
    if ls.nb.metadata.get("jupytext", {}).get("formats") != "ipynb,py:percent" or not twin.exists():
        yield None, f"not paired: jupytext --set-formats ipynb,py:percent notebooks/{ls.path.name}"
        return
    a, b = ([(c.cell_type, c.source, sorted(c.get("metadata", {}).get("tags", [])))
             for c in nb.cells] for nb in (ls.nb, jupytext.read(str(twin))))
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))
    if diff is not None:
        yield diff, f"differs from {twin.name}: jupytext --sync notebooks/{twin.name} (newer wins)"


@rule("outputs-cleared", "Code cells carry no outputs, execution counts or papermill metadata.")
def _outputs(ls):
    for i, c in enumerate(ls.cells):
        if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count") is not None):
            yield i, "has outputs: jupyter nbconvert --clear-output --inplace, then jupytext --sync"
    yield from ((i, "carries papermill metadata: an executed copy from build/ was committed?")
                for i, m in [(None, ls.nb.metadata), *enumerate(c.metadata for c in ls.cells)]
                if "papermill" in m)


@rule("kernelspec", "The kernelspec is `python3` (`jupytext --set-kernel python3`).")
def _kernelspec(ls):
    if ls.nb.metadata.get("kernelspec", {}).get("name") != "python3":
        yield None


@rule("language-info", "The metadata holds `language_info` as a JupyterLab save writes it, less "
      "`version`: jupytext does not write it; `python3 -m ci.lessons language-info` prints it.")
def _language_info(ls):
    if ls.nb.metadata.get("language_info") != LANGUAGE_INFO:
        yield None, ("not JupyterLab's: jupytext --sync --update-metadata "
                     f"\"$(python3 -m ci.lessons language-info)\" notebooks/{ls.stem}.py")


@rule("saved-form", "The `.ipynb` is in nbformat's own form, the bytes a JupyterLab save writes.")
def _saved_form(ls):
    written = nbformat.writes(ls.nb, version=nbformat.NO_CONVERT)
    saved = written + "\n" * (not written.endswith("\n"))
    if committed_form(ls.nb.metadata) != ls.nb.metadata or ls.raw != saved:
        yield None, "not in nbformat's form (a Jupyter save rewrites it): jupytext --sync its twin"


@rule("no-absolute-paths", "No cell holds an absolute path (`/home/`, `C:\\`...).")
def _absolute(ls):
    yield from ((i, f"absolute path: {ln.strip()[:80]}") for i, c in enumerate(ls.cells)
                for ln in c.source.splitlines() if ABSOLUTE_PATH.search(ln))


@rule("first-cell", "The first cell is markdown (title, what it teaches) and links to the "
      f"glossary, `[glossary]({GLOSSARY_LINK})`.")
def _first_cell(ls):
    first = ls.cells[0] if ls.cells else nbformat.v4.new_code_cell()
    if first.cell_type != "markdown" or GLOSSARY_LINK not in dict(LINK.findall(first.source)):
        yield 0


def glossary_anchors(path: Path = ROOT / "docs" / "GLOSSARY.md") -> set[str]:
    """The anchors of a Markdown file (docs/GLOSSARY.md): ``<a id=...>`` and GitHub's heading slugs."""
    text = path.read_text(encoding="utf-8")
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+\s+(.+?)\s*$", text, re.M)}
    return set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', text)) | slugs


@rule("glossary-anchors", "Links to glossary terms name anchors docs/GLOSSARY.md defines (`<a id>` "
      "or a heading).")
def _anchors(ls):
    anchors = glossary_anchors()
    for i, src in ls.markdown():
        yield from ((i, f"no anchor {frag} in docs/GLOSSARY.md: add it there or fix the link")
                    for _, frag in LINK.findall(src) if frag and frag[1:] not in anchors)


@rule("one-parameters-cell", "Exactly one code cell is tagged `parameters`, one `name = literal  # "
      "description` a line, no `=` in the comment (papermill skips such a line); no "
      "`injected-parameters` cell.")
def _parameters(ls):
    marked_cells = ls.tagged("parameters")
    if len(marked_cells) != 1 or ls.cells[marked_cells[0]].cell_type != "code":
        yield None, f"code cells tagged 'parameters': {marked_cells}; tag exactly one"
        return
    yield from ((i, "papermill's injected-parameters cell committed: delete it")
                for i in ls.tagged("injected-parameters"))
    source = ls.cells[marked_cells[0]].source
    assigned = [t.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)]
    yield from ((marked_cells[0], f"papermill cannot parse {name!r}: no '=' or '>=' in its comment")
                for name in assigned if name not in ls.papermill_parameters)


@rule("parameters-checked", "If it has parameters (only what a profile changes), the code cell "
      "right after it calls "
      "`check_parameters(name=(name, TYPE), ...)` once, naming every parameter, before importing "
      "torch; `check_value` checks ranges.")
def _parameters_checked(ls):
    marked_cells = ls.tagged("parameters")
    if len(marked_cells) != 1 or not ls.papermill_parameters:  # no parameters: nothing to check
        return
    i = marked_cells[0] + 1
    cell = ls.cells[i] if i < len(ls.cells) else None
    tree = code_tree(cell.source) if cell is not None and cell.cell_type == "code" else None
    found = [n for n in ast.walk(tree or ast.Module(body=[])) if isinstance(n, ast.Call)
             and getattr(n.func, "id", getattr(n.func, "attr", None)) == "check_parameters"]
    if len(found) != 1:
        yield i, "call check_parameters(...) once in the code cell right after the parameters cell"
        return
    checked = {kw.arg for kw in found[0].keywords}
    for name in sorted(ls.papermill_parameters ^ checked):
        yield i, (f"check_parameters does not check {name}" if name in ls.papermill_parameters
                  else f"check_parameters names {name}, which is not a parameter")
    for kw in found[0].keywords:
        v = kw.value
        if not (isinstance(v, ast.Tuple) and len(v.elts) == 2
                and getattr(v.elts[0], "id", None) == kw.arg):
            yield i, f"write check_parameters({kw.arg}=({kw.arg}, TYPE), ...)"
    if "import torch" in cell.source:
        yield i, "check the parameters before importing anything slow (torch)"


@rule("prose", f"The markdown has at least {MIN_SENTENCES} sentences, at most "
      f"{prose.MAX_WORDS_PER_SENTENCE:g} words and {prose.MAX_PARENS_PER_SENTENCE:g} parentheses a "
      f"sentence, at most {MAX_LESSON_WORDS:,} words in all (`python3 -m ci.lessons prose` shows "
      "them).")
def _prose(ls):
    f = ls.prose
    words = sum(len(src.split()) for _, src in ls.markdown())
    if f.sentences < MIN_SENTENCES:
        yield None, f"only {f.sentences} sentence(s): explain the lesson in {MIN_SENTENCES} or more"
    if f.words_per_sentence > prose.MAX_WORDS_PER_SENTENCE:
        yield None, f"{f.words_per_sentence:.1f} words a sentence: split long sentences"
    if f.parens_per_sentence > prose.MAX_PARENS_PER_SENTENCE:
        yield None, f"{f.parens_per_sentence:.2f} parentheses a sentence: fewer asides"
    if words > MAX_LESSON_WORDS:
        yield None, f"{words:,} words of markdown: cut to {MAX_LESSON_WORDS:,} (one sitting)"


@rule("no-typed-times", "The prose types no run time (\"about 6 s\") nor machine logistics (core "
      "counts, CI): it says why a cell is slow; the measured times are generated into the README.")
def _typed_times(ls):
    yield from ((i, f"{m.group(0)!r}: say why without a number") for i, text in ls.markdown()
                for p in MACHINERY for m in p.finditer(prose.GENERATED.sub(" ", text)))


@rule("check-folded", "Every cell tagged `check` is folded (`jupyter.source_hidden`) and starts "
      "with `# Check: <what it checks>` (after a `%%px` line).")
def _check_folded(ls):
    for i in ls.tagged("check"):
        lines = ls.cells[i].source.splitlines() or [""]
        first = lines[1] if lines[0].startswith("%%") and len(lines) > 1 else lines[0]
        if not folded(ls.cells[i]) or not first.startswith("# Check: "):
            yield i


ASSERTING = ("assert_close", "assert_equal")


def folded(cell) -> bool | None:
    return cell.metadata.get("jupyter", {}).get("source_hidden")


def asserts(source: str) -> bool:
    """Whether the code (magics stripped) asserts: an ``assert``, ``assert_close`` /
    ``assert_equal`` or ``check_answer(..., strict=...)``."""
    return any(isinstance(n, ast.Assert) or isinstance(n, ast.Call) and (
        (f := getattr(n.func, "attr", getattr(n.func, "id", ""))) in ASSERTING
        or f == "check_answer" and any(k.arg == "strict" for k in n.keywords))
        for n in ast.walk(code_tree(source) or ast.Module([], [])))


@rule("claims", "The lesson states at least one `**Claim:**`, each at most "
      f"{prose.MAX_CLAIM_WORDS} words, and a code cell before the next markdown cell asserts it "
      "(`assert`, `assert_close`, `check_answer(..., strict=True)`); what cannot be asserted is "
      "explanation with its source.")
def _claims(ls):
    if not any(CLAIM.search(src) for _, src in ls.markdown()):
        yield None, "states no **Claim:**: mark the facts its code proves"
    if ls.prose.longest_claim > prose.MAX_CLAIM_WORDS:
        yield None, f"a claim of {ls.prose.longest_claim} words: make a multi-case claim a table"
    for i, src in ls.markdown():
        m = CLAIM.search(src)
        if m and not any(asserts(c.source) for c in check_cells(ls.cells, i)):
            yield i, f"claim {src[m.end():].strip()[:50]!r}: assert it in a code cell or reword it"


def loose_device_marks(source: str) -> list[str]:
    """Claim labels naming a device in another form than ``**Claim (GPU):**`` / ``(CPU)``."""
    after = (re.match(r"\s*\([^)\n]*\)", source[m.end():]) for m in CLAIM.finditer(source))
    labels = [m.group(0) + (a.group(0) if a else "") for m, a in zip(CLAIM.finditer(source), after)
              if not MARKED.fullmatch(m.group(0))]
    return [label for label in labels if DEVICE_WORD.search(label)]


@rule("device-claims", "A claim only a GPU proves is `**Claim (GPU):**` and its check asserts "
      "under `if gpu_claim(...):`; one true only without GPUs `**Claim (CPU):**` under "
      "`if cpu_claim(...):`; no other check branches on the devices; one claim is proven on CPU.")
def _device_claims(ls):
    proven_on_cpu = False
    for i, src in ls.markdown():
        if not CLAIM.search(src):
            continue
        marks = set(MARKED.findall(src))
        proven_on_cpu |= len(CLAIM.findall(src)) > len(re.findall(r"\*\*Claims? \(GPU\):\*\*", src))
        yield from ((i, f"{label!r}: write **Claim (GPU):** or **Claim (CPU):**")
                    for label in loose_device_marks(src))
        checks = check_cells(ls.cells, i)
        called = {name for c in checks for name in calls(c.source)}
        yield from ((i, f"a **Claim ({k}):** whose check cells never call {HELPER[k]}(...)")
                    for k in sorted(marks) if HELPER[k] not in called)
        yield from ((i, f"{HELPER[k]}(...) after a claim not marked **Claim ({k}):**")
                    for k in sorted(set(HELPER) - marks) if HELPER[k] in called)
        if not marks:
            yield from ((i, f"an unmarked claim's check branches on `if {b}`: mark it **Claim "
                            "(GPU):** or (CPU) and branch on gpu_claim(...) / cpu_claim(...)")
                        for c in checks for b in device_branches(c.source))
    if not proven_on_cpu and any(CLAIM.search(src) for _, src in ls.markdown()):
        yield None, "every claim needs a GPU: none is proven on CPU"


@rule("figures", "Every figure has a title, both axis labels (with units) and a layout engine "
      "(`layout=\"constrained\"` or `tight_layout`); no bars on a log or truncated axis; every "
      "legend has a `loc` or `bbox_to_anchor`.")
def _figures(ls):
    from ci.figures import figure_problems

    yield from ((i, p) for i, src in ls.code() if "plt." in src or ".bar" in src
                for p in figure_problems(src))


@rule("exercises", "After the `## What we saw` markdown come two or more exercises, numbered 1, "
      "2, ..., each four cells: `### Exercise N: title` and the task; `answer_N = None  # your "
      "answer here`; the check cell, `check_answer(\"exN\", answer_N, expected_N)` (not strict); "
      "the solution.", lessons_only=True)
def _exercises(ls):
    if len(ls.answers) < 2:
        yield None, f"{len(ls.answers)} exercise(s) (`answer_N = None` cells): write at least 2"
    seen = [i for i, src in ls.markdown() if "## What we saw" in src]
    if ls.answers and (not seen or seen[-1] > min(ls.answers)):
        yield None, "put the exercises after a '## What we saw' markdown cell"
    for k, (i, n) in enumerate(ls.answers.items(), start=1):
        task, check = ls.cells[i - 1], (ls.cells[i + 1:] or [nbformat.v4.new_code_cell()])[0]
        if n != str(k):
            yield i, f"exercises are numbered 1, 2, ... in order: answer_{n} is number {k}"
        if task.cell_type != "markdown" or f"### Exercise {n}" not in task.source:
            yield i - 1, f"exercise {n} needs its task above: '### Exercise {n}: title', the task"
        call = f'check_answer("ex{n}", answer_{n}, expected_{n}'
        if call not in check.source or "strict=True" in check.source:
            yield i + 1, f"the cell after answer_{n} checks it, not strict: {call}, ...)"
        if i + 2 not in ls.tagged("solution"):
            yield i + 2, f"exercise {n}'s solution cell (tagged 'solution') follows its check cell"


@rule("exercise-tag", "The learner's `answer_N = None` cell is tagged `exercise` (the handout "
      "finds it so).", lessons_only=True)
def _exercise_tag(ls):
    yield from sorted(set(ls.answers) - set(ls.tagged("exercise")))


@rule("solutions", "Each solution is a code cell tagged `solution` right after its exercise's "
      "check cell, collapsed (`jupyter.source_hidden`), whose first line is "
      f"`{SOLUTION_FIRST_LINE} N (try the exercise first)` and which ends with "
      "`check_answer(\"exN\", solution_N, expected_N, strict=True)`.", lessons_only=True)
def _solutions(ls):
    for i in ls.tagged("solution"):
        c = ls.cells[i]
        if (i - 2 not in ls.answers or c.cell_type != "code" or folded(c) is not True
                or not c.source.startswith(SOLUTION_FIRST_LINE)
                or not re.search(SOLUTION_CHECK, c.source)):
            yield i


def problems(path: Path) -> list[str]:
    """Every problem of the notebook at ``path``: ``"stem [rule] cell N: what to do"`` lines."""
    try:
        ls = Lesson(path)
    except Exception as e:  # noqa: BLE001 - unreadable: the one problem to report
        return [f"{path.stem} [nbformat]: cannot read {path.name}: {e}"]
    found = []
    for r in (r for r in RULES if ls.is_lesson or not r.lessons_only):
        try:
            found += [(r.id, *(hit if isinstance(hit, tuple) else (hit, r.statement)))
                      for hit in r.check(ls)]
        except Exception as e:  # noqa: BLE001 - a rule that cannot read the lesson says so
            found.append((r.id, None, f"cannot check ({type(e).__name__}: {e}): fix the rest"))
    return [f"{ls.stem} [{id}]" + ("" if i is None else f" cell {i}") + f": {what}"
            for id, i, what in found]


def rules_markdown() -> str:
    """The table of the rules, as docs/TESTING.md holds it between its markers."""
    rows = [f"| `{r.id}` | {r.statement.replace('|', '&#124;')}"
            f"{' (lessons of the path)' * r.lessons_only} |" for r in RULES]
    return "\n".join(["| rule | what a lesson must do |", "|---|---|", *rows])


def outputs(doc: Path) -> list[tuple[Path, str, str, str]]:
    """``[(doc, current, wanted, what)]`` for docs/TESTING.md's table of the rules (ci.generate)."""
    current = doc.read_text(encoding="utf-8")
    wanted = marked.render(current, rules_markdown(), START, END)
    return [(doc, current, wanted, "the lesson rules")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ci.lessons",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["check", "prose", "rules", "language-info"])
    parser.add_argument("labels", nargs="*", help="lesson labels (06a) or stems; default: all")
    args = parser.parse_args(argv)
    if args.command in ("rules", "language-info"):
        info = json.dumps({"language_info": LANGUAGE_INFO})
        print(rules_markdown() if args.command == "rules" else info)
        return 0
    folder = ROOT / "notebooks"
    stems = [s for s in manifest.stems(None) if not args.labels or s in args.labels
             or s.split("_", 1)[0] in args.labels]
    unknown = [a for a in args.labels if not any(a in (s, s.split("_", 1)[0]) for s in stems)]
    if unknown:
        print(f"error: unknown lesson(s) {unknown}; see notebooks/lessons.toml", file=sys.stderr)
        return 2
    if args.command == "prose":
        print(f"{'notebook':42} {'words':>6} {'sent.':>6} {'w/sent':>7} {'(/sent':>7} {'claim':>6}")
        for s in stems:
            f = prose.measure(folder / f"{s}.ipynb")
            print(f"{s:42} {f.words:6d} {f.sentences:6d} {f.words_per_sentence:7.1f} "
                  f"{f.parens_per_sentence:7.2f} {f.longest_claim:6d}")
        return 0
    found = [p for s in stems for p in problems(folder / f"{s}.ipynb")]
    print("\n".join(found) or f"{len(stems)} notebook(s) meet all {len(RULES)} lesson rules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

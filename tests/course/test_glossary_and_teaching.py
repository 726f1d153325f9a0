"""docs agree with the lessons (issue 44, part 5): the glossary says DDP divides first, then
sums, as lesson 01 asserts; it says its Chinese column needs CJK fonts; docs/TEACHING.md gives
memory per laptop, says to shut down the last lesson's kernel, and names the doctor's threshold."""

from __future__ import annotations

from pathlib import Path

from helpers.doctor import checks

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = (ROOT / "docs" / "GLOSSARY.md").read_text(encoding="utf-8")


def test_glossary_all_reduce_divides_first_as_lesson_01_asserts():
    lesson = (ROOT / "notebooks" / "01_gradients_dp_vs_ddp.py").read_text(encoding="utf-8")
    assert "DDP divides **first**" in lesson and 'p.grad /= world_size  # divide first, as DDP does' in lesson
    entry = next(line for line in GLOSSARY.splitlines() if '<a id="all-reduce"></a>' in line)
    assert "divides each gradient by the world size first" in entry and "then all-reduces (sums)" in entry, entry
    assert "all-reduces the gradients during backward and divides" not in GLOSSARY


def test_glossary_says_its_chinese_column_needs_cjk_fonts():
    intro = GLOSSARY.split("| English |", 1)[0]
    assert "CJK" in intro and "boxes" in intro, intro


def test_teaching_gives_memory_shutdown_the_minimum_laptop_and_a_plan_for_one_that_fails():
    """Memory per laptop, shutting down the last kernel, the doctor's threshold; issue 52: the
    minimum laptop, with its basis, and what to do on the day when one fails."""
    text = (ROOT / "docs" / "TEACHING.md").read_text(encoding="utf-8")
    day = text.split("## On the day", 1)[1].split("\n## ", 1)[0].replace("**", "")
    for said in ["**Memory per laptop.**", "USS", "shut down the last lesson's kernel",
                 "MIN_FREE_MIB", "Kernel > Shut Down Kernel", f"{checks.MIN_FREE_MIB:,} MiB",
                 "docs/run_times.json", "**The minimum laptop: 2 CPU cores and 4 GB of memory.**"]:
        assert said in text, said
    for said in ("python3 -m helpers.doctor", "minutes per part", "pair the student"):
        assert said in day, said

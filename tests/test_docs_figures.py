"""The manuals state what is: every measured figure the README and docs/ show is a row copied
from BENCHMARKS.md's Summary (checked here against it), and they carry no history (no dates, no
commits); history goes to CHANGELOG.md."""

import re

import pytest

from tests.conftest import REPO

MARKER = "<!-- rows of BENCHMARKS.md#summary"
MANUALS = [
    "README.md",
    *sorted(p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")),
]
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# Not history, so not checked for dates or commits: a link's target (a heading's anchor in
# BENCHMARKS.md may carry the date it was measured on), a cached model's name (`bed-` and a
# digest of its recipe), and a plain decimal number (`1048576`, an example `# code: 1234567`).
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
MODEL_NAME = re.compile(r"\bbed(-[ml])?-[0-9a-f]{16}\b")


def summary_rows() -> list[str]:
    """The Summary's table lines: header, rule and rows."""
    lines = (REPO / "BENCHMARKS.md").read_text().splitlines()
    start = lines.index("## Summary")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    return [line for line in lines[start:end] if line.startswith("|")]


def copied_tables(text: str) -> list[list[str]]:
    """Each table that follows the marker: its lines, header and rule included."""
    lines = text.splitlines()
    tables = []
    for i, line in enumerate(lines):
        if line.startswith(MARKER):
            table = []
            for row in lines[i + 1 :]:
                if not row.startswith("|"):
                    break
                table.append(row)
            tables.append(table)
    return tables


def as_in_benchmarks(row: str) -> str:
    """A copied row's links point into BENCHMARKS.md from the copy's folder; in the Summary they
    are the file's own anchors. Nothing else may differ."""
    return re.sub(r"\]\((?:\.\./)?BENCHMARKS\.md#", "](#", row)


def history(text: str) -> list[str]:
    """Dates and commit-like tokens in running text, outside the copied Summary rows."""
    copied = {row for table in copied_tables(text) for row in table}
    found = []
    for line in text.splitlines():
        if line in copied:
            continue
        line = MODEL_NAME.sub("", LINK_TARGET.sub("]()", line))
        found += DATE.findall(line)
        found += [t for t in HASH.findall(line) if not t.isdigit()]
    return found


@pytest.mark.parametrize("name", MANUALS)
def test_a_manual_copies_figures_only_from_the_summary(name):
    summary = summary_rows()
    for table in copied_tables((REPO / name).read_text()):
        assert table[0] == summary[0], f"{name}: the header is not the Summary's"
        assert table[1] == summary[1]
        rows = [as_in_benchmarks(row) for row in table[2:]]
        assert rows, f"{name}: a marked table with no rows"
        assert [row for row in rows if row not in summary[2:]] == [], name


def test_the_readme_copies_summary_rows():
    """The README's figures are copies (so the check above is not vacuous)."""
    tables = copied_tables((REPO / "README.md").read_text())
    assert tables and sum(len(table) - 2 for table in tables) >= 2


@pytest.mark.parametrize("name", MANUALS)
def test_a_manual_carries_no_history(name):
    assert history((REPO / name).read_text()) == [], f"{name}: history belongs in CHANGELOG.md"


def test_the_history_check_can_fail():
    assert history("Since 2026-12-01 it does X.") == ["2026-12-01"]
    assert history("Until d024684 a cycle kept it.") == ["d024684"]
    assert (
        history("The cache `bed-c7ef9e111e17a75d`, 1048576 bytes ([x](B.md#y-2026-12-03)).") == []
    )
    row = "| f | 1 | c | 2026-12-05 | ba361bd | [s](#s) |"
    assert history(f"{MARKER} -->\n| h |\n|---|\n{row}\n") == []
    assert history(f"{row}\n") == ["2026-12-05", "ba361bd"]


def test_the_readme_starts_with_its_two_commands_undated():
    text = (REPO / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in block] == [["make", "run"], ["make", "test"]]
    assert not any(re.search(r"\d\s*min", line) for line in block), block


def test_benchmarks_opens_with_contents_claims_then_summary():
    lines = (REPO / "BENCHMARKS.md").read_text().splitlines()
    assert "- [Summary](#summary)" in lines[:40]
    sections = [line for line in lines if line.startswith("## ")]
    assert sections[:3] == ["## Contents", "## The paper's claims", "## Summary"]
    contents = "\n".join(lines[: lines.index("## The paper's claims")])
    assert all(f"[{s[3:]}]" in contents for s in sections[1:]), (
        "a section missing from the contents"
    )
    assert (REPO / "CHANGELOG.md").read_text().startswith("# Changelog\n")

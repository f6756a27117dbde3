"""The scripts under results/ that draw a table from committed records: each still runs on
them, and where a markdown file shows its table, the table is what the script prints now."""

import subprocess
import sys

import pytest

from tests.conftest import REPO


def printed(script: str) -> list[str]:
    """The script's non-empty lines; at least a table's header, rule and one row."""
    result = subprocess.run([sys.executable, script], cwd=REPO, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert sum(line.startswith("|") for line in lines) > 2, result.stdout
    return lines


@pytest.mark.parametrize(
    "script, shown_in",
    [
        ("results/bed/learning_rate_table.py", "results/bed/learning-rate.md"),
        ("results/claims/f_workload_table.py", "results/claims/f-workload.md"),
        ("results/claims/c_kept.py", "BENCHMARKS.md"),
        ("results/claims-rounds/by_round.py", "BENCHMARKS.md"),
        ("results/claims/b_rounds_by_round.py", "BENCHMARKS.md"),
    ],
)
def test_a_table_is_what_its_script_prints(script, shown_in):
    shown = (REPO / shown_in).read_text().splitlines()
    assert [line for line in printed(script) if line not in shown] == []


def test_the_online_dpo_pairs_table_has_a_row_per_n():
    rows = printed("results/claims/b_dpo_pairs.py")[2:]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "4", "16", "64"]
    assert all(int(row.split("|")[2]) >= 1 for row in rows)


def test_benchmarks_opens_with_the_claims_table_the_records_give_now(tmp_path):
    """Each recorded claim analysed again from its committed runs (`--claim X --report-only`),
    then the table (`--report-only`): BENCHMARKS.md shows every row of it as drawn."""
    import shutil

    from jaxrlhf.experiments.claims import claim_registry
    from jaxrlhf.experiments.claims.__main__ import main

    out = tmp_path / "claims"
    shutil.copytree(REPO / "results" / "claims", out, ignore=shutil.ignore_patterns("*.png"))
    recorded = [c for c in claim_registry.names() if (out / c / "claim.json").exists()]
    assert {"a", "b", "f"} <= set(recorded)
    for claim in recorded:
        main(["--claim", claim, "--report-only", "--out", str(out)])
    main(["--report-only", "--out", str(out)])
    benchmarks = (REPO / "BENCHMARKS.md").read_text().splitlines()
    drawn = [line for line in (out / "claims.md").read_text().splitlines() if line.strip()]
    assert len(drawn) == 2 + len(claim_registry.table())  # header, rule, a row per claim
    assert [line for line in drawn if line not in benchmarks] == []

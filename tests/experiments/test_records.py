"""Records packed and loose (`jaxrlhf.experiments.records`): the round trip, which copy a reader
sees, the refusals; and every committed record set read whole."""

import json
import math
from pathlib import Path

import pytest

from jaxrlhf.experiments import read_run, records, run_code
from jaxrlhf.experiments.runner import finished_with
from tests.conftest import REPO

RUNS = {
    "grpo/N4/seed0": {"metrics.jsonl": '{"step": 1}\n{"step": 2}\n', "summary.json": "{}",
                      "experiment.json": '{"seed": 0}', "run.log": "$ cmd\n# code: abc1234\n"},
    "grpo/N4/seed1": {"metrics.jsonl": '{"step": 1}\n', "run.log": "bytes \udcff\r\nand ✓\r"},
}  # fmt: skip


def write(folder: Path, runs: dict) -> None:
    for run, named in runs.items():
        (folder / run).mkdir(parents=True, exist_ok=True)
        for name, content in named.items():
            (folder / run / name).write_bytes(content.encode("utf-8", "surrogateescape"))


def loose(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def test_pack_and_unpack_round_trip_byte_for_byte(tmp_path):
    write(tmp_path, RUNS)
    (tmp_path / "grpo/N4/seed0/checkpoints").mkdir()  # not a record: stays
    before = loose(tmp_path)
    assert records.pack(tmp_path) == ["grpo/N4/seed0"]  # seed1 has no summary: in progress
    assert records.unfinished(tmp_path) == ["grpo/N4/seed1"]
    assert records.pack(tmp_path, partial=True) == ["grpo/N4/seed1"]
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [records.PACK]
    assert (tmp_path / "grpo/N4/seed0/checkpoints").is_dir()
    assert records.runs(tmp_path) == [tmp_path / run for run in sorted(RUNS)]
    assert records.runs(tmp_path / "grpo" / "N4" / "seed1") == [tmp_path / "grpo/N4/seed1"]
    for run, named in RUNS.items():
        assert records.files(tmp_path / run) == named
    assert run_code(tmp_path / "grpo/N4/seed0") == "abc1234"
    metrics, summary = read_run(tmp_path / "grpo/N4/seed0")
    assert [m["step"] for m in metrics] == [1, 2] and summary == {}
    packed = (tmp_path / records.PACK).read_bytes()
    assert records.unpack(tmp_path) == sorted(RUNS)
    assert loose(tmp_path) == before  # the checkpoints folder aside, as written
    records.pack(tmp_path, partial=True)
    assert (tmp_path / records.PACK).read_bytes() == packed  # deterministic


def test_a_loose_run_is_read_whole_over_its_packed_copy(tmp_path):
    """A run being run again in a clone with packed records: its loose folder is the run."""
    write(tmp_path, RUNS)
    records.pack(tmp_path)
    folder = tmp_path / "grpo/N4/seed0"
    assert finished_with(folder, {"seed": 0, "output_dir": "elsewhere"})  # packed: reused
    write(tmp_path, {"grpo/N4/seed0": {"run.log": "$ again\n"}})
    assert records.files(folder) == {"run.log": "$ again\n"}
    assert not finished_with(folder, {"seed": 0})
    with pytest.raises(FileNotFoundError):
        read_run(folder)


def test_packing_merges_and_refuses_a_run_that_differs(tmp_path):
    finished = RUNS["grpo/N4/seed0"]
    write(tmp_path, {"a/seed0": finished})
    records.pack(tmp_path)
    write(tmp_path, {"a/seed0": finished, "a/seed1": finished})
    assert records.pack(tmp_path) == ["a/seed0", "a/seed1"]  # the same run again is fine
    assert sorted(records.read_pack(tmp_path)) == ["a/seed0", "a/seed1"]
    other = {**finished, "summary.json": '{"other": 1}'}
    write(tmp_path, {"a/seed1": other})
    with pytest.raises(ValueError, match="a/seed1"):
        records.pack(tmp_path)
    assert (tmp_path / "a/seed1/summary.json").exists()  # nothing removed
    with pytest.raises(SystemExit, match="a/seed1"):
        records.main(["pack", str(tmp_path)])
    records.pack(tmp_path, replace=True)
    assert records.files(tmp_path / "a/seed1") == other


def test_a_pack_keeps_six_significant_digits_of_each_metric(tmp_path):
    """metrics.jsonl is packed with each float to six significant digits (values rounded by
    hand), ints, strings, each line's own end, and lines that are not ASCII JSON (a torn last
    line, one with undecodable bytes) as written; the other files byte for byte."""
    written = (
        '{"step": 6, "kl": 0.6814903846153846, "tps": 2585.578767822148, "ids": ["a"], '
        '"approx_kl": 7.377333336236469e-13, "ratio": [1.0000066757202148, 0.5]}\n'
        '{"step": 7, "loss": -0.0045983558520674706, "x": NaN}\r\n'
        '{"step": 7.5, "note": "\udcff \u2713 0.6814903846153846"}\n{"step": 8, "lo'
    )
    packed = (
        '{"step": 6, "kl": 0.68149, "tps": 2585.58, "ids": ["a"], '
        '"approx_kl": 7.37733e-13, "ratio": [1.00001, 0.5]}\n'
        '{"step": 7, "loss": -0.00459836, "x": NaN}\r\n'
        '{"step": 7.5, "note": "\udcff \u2713 0.6814903846153846"}\n{"step": 8, "lo'
    )
    run = {**RUNS["grpo/N4/seed0"], "metrics.jsonl": written, "run.log": "0.6814903846153846\n"}
    assert records.compact("metrics.jsonl", written) == packed
    assert records.compact("metrics.jsonl", packed) == packed
    write(tmp_path, {"a/seed0": run})
    records.pack(tmp_path)
    assert records.files(tmp_path / "a/seed0") == {**run, "metrics.jsonl": packed}
    write(tmp_path, {"a/seed0": run})  # the same run again, loose and written in full
    assert records.pack(tmp_path) == ["a/seed0"]  # is the packed run, not one that differs
    write(tmp_path, {"a/seed0": run})  # loose in full beside its packed copy: unpack agrees
    assert records.unpack(tmp_path) == ["a/seed0"]
    assert loose(tmp_path)["a/seed0/metrics.jsonl"] == written.encode("utf-8", "surrogateescape")
    records.pack(tmp_path)
    records.write_pack(tmp_path, {"a/seed0": run})  # a pack from before packs were compact
    assert records.pack(tmp_path) == []
    assert records.read_pack(tmp_path)["a/seed0"]["metrics.jsonl"] == packed  # compacted once


def test_packs_do_not_nest(tmp_path):
    write(tmp_path, {"x/a/seed0": RUNS["grpo/N4/seed0"]})
    records.pack(tmp_path / "x")
    with pytest.raises(ValueError, match="already packs"):
        records.pack(tmp_path / "x" / "a")
    with pytest.raises(ValueError, match="do not nest"):
        records.pack(tmp_path)


# --- every committed record set ---------------------------------------------------------------

PACKS = sorted(p.parent for p in (REPO / "results").rglob(records.PACK))
# Runs committed without a summary: workload candidates stopped early (f-workload.md says which).
UNFINISHED = {"claims/f-workload": {"g64", "s4"}}
# Folders a report plans (their runs were started by an experiment's runner: experiment.json).
REPORTS = ("claim.json", "plan.json", "results.json")


def json_object(text: str, where: str) -> dict:
    value = json.loads(text)
    assert isinstance(value, dict), where
    return value


def test_the_committed_records_are_packed():
    assert len(PACKS) >= 14
    loose = [p for p in (REPO / "results").rglob("metrics.jsonl") if "make-run" not in p.parts]
    assert loose == [], "loose committed runs: python -m jaxrlhf.experiments.records pack ..."


@pytest.mark.parametrize("folder", PACKS, ids=lambda p: results_id(p / records.PACK))
def test_every_committed_run_reads(folder):
    name = folder.relative_to(REPO / "results").as_posix()
    planned = any(p.name in REPORTS for p in folder.rglob("*"))
    runs = records.read_pack(folder)
    assert runs
    for run, named in runs.items():
        where = f"{name}/{run}"
        assert {"metrics.jsonl", "run.log"} <= set(named), where
        metrics = named["metrics.jsonl"]
        assert records.compact("metrics.jsonl", metrics) == metrics, f"{where}: not compact"
        lines = [json_object(line, where) for line in metrics.splitlines()]
        assert lines and all("step" in line for line in lines if "reward_mean" in line), where
        if run not in UNFINISHED.get(name, ()):
            json_object(named["summary.json"], where)
        if planned:
            json_object(named["experiment.json"], where)


def claim_reports() -> list[Path]:
    return sorted((REPO / "results").glob("claims*/*/claim.json"))


@pytest.mark.parametrize("path", claim_reports(), ids=lambda p: p.parent.name)
def test_each_claim_report_counts_the_runs_its_records_hold(path):
    """Each arm's finished seeds in claim.json are the planned runs the records hold finished."""
    from jaxrlhf.experiments.claims.analysis import by_arm
    from jaxrlhf.experiments.claims.claim_registry import claim
    from jaxrlhf.experiments.claims.plans import Settings

    report = json.loads(path.read_text())
    saved = report["settings"]
    settings = Settings(seeds=tuple(saved["seeds"]), steps=saved["steps"],
                        eval_every=saved["eval_every"],
                        passthrough=tuple(saved["passthrough"].items()))  # fmt: skip
    arms = by_arm(claim(path.parent.name).plan(settings, path.parent.parent))
    for row in report["rows"]:
        assert len(arms[row["arm"]]) == row["seeds"], (path, row["arm"])


def results_id(path: Path) -> str:
    return path.parent.relative_to(REPO / "results").as_posix()


@pytest.mark.parametrize("path", sorted((REPO / "results").rglob("results.json")), ids=results_id)
def test_each_experiment_report_finds_its_runs(path):
    """Every run an experiment's results.json counts ("ok") is in the records, finished."""
    report = json.loads(path.read_text())
    ok = [run for run in report["runs"] if run["status"] == "ok"]
    assert ok
    for run in ok:
        folder = REPO / "results" / run["output_dir"].split("/results/", 1)[1]
        metrics, summary = read_run(folder)
        assert len(metrics) == run["steps_done"], folder
        assert math.isclose(summary.get("wall_seconds") or 0, run.get("wall_seconds") or 0)

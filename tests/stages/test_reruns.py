"""A recipe never reuses a stage built from other inputs (issue 59): what `decide` makes of the
stage folders a run left, built here from real configs, real `made_by` records and a tiny
export, with no training. The recipe end to end is in tests/stages/test_recipe_chain.py."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest

from jaxrlhf.stages import provenance
from jaxrlhf.stages.chain import RecipeError, recipe_runs, refusals, stage_overrides
from jaxrlhf.stages.dispatch import run_stage
from tests.conftest import tiny_model

COMMAND = ["--config=configs/nobots.py"]


def stage_config(name: str = "nobots"):
    return importlib.import_module(f"configs.{name}").get_config


@pytest.fixture
def recipe_dir(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # runs/ is relative to the working folder
    return tmp_path / "runs" / "nobots"


def finish(runs, stages=("sft", "reward", "rlhf"), trained: str = "") -> None:
    """Each stage of `stages` as its run leaves it: checkpoints, an export, then summary.json
    with the record of what made it (the inputs read from the stages finished before).
    `trained`: what sets the exports apart from another run's (trained weights differ)."""
    for run in runs:
        if run.stage not in stages:
            continue
        out = Path(run.config.output_dir)
        (out / "checkpoints" / "2").mkdir(parents=True)
        shutil.copytree(tiny_model("llama"), out / "hf_export")
        (out / "hf_export" / "trained.txt").write_text(run.stage + trained)
        provenance.write_summary(run.config, {"stage": run.stage, "steps": 2})


def statuses(runs) -> list[tuple[str, str]]:
    return [(run.stage, run.status) for run in runs]


def test_overrides_reach_the_stage_they_name(recipe_dir):
    overrides = {
        "output_dir": "exp/",  # shared: the recipe's root
        "model.path": "/models/llama",  # shared: the first stage's start
        "task.preference_source": "/data/pairs.jsonl",  # shared: a data source
        "train.learning_rate": 3e-7,  # plain: the RLHF stage
        "sft.train.learning_rate": 2e-5,
        "reward.total_steps": 7,
    }
    sft, reward, rlhf = recipe_runs(overrides, stage_config())
    assert [r.config.output_dir for r in (sft, reward, rlhf)] == ["exp/sft", "exp/reward",
                                                                 "exp/rlhf"]  # fmt: skip
    assert (sft.config.model.path, reward.config.model.path, rlhf.config.model.path) == (
        "/models/llama", "exp/sft", "exp/sft")  # fmt: skip
    defaults = {s: stage_config()(s) for s in ("sft", "reward", "rlhf")}
    assert sft.config.train.learning_rate == 2e-5
    assert reward.config.train.learning_rate == defaults["reward"].train.learning_rate
    assert rlhf.config.train.learning_rate == 3e-7
    assert reward.config.total_steps == 7
    assert sft.config.total_steps == defaults["sft"].total_steps
    assert rlhf.config.total_steps == defaults["rlhf"].total_steps
    assert {r.config.task.preference_source for r in (sft, reward, rlhf)} == {"/data/pairs.jsonl"}
    # What the plan prints for each stage: the keys it got.
    assert sft.overrides == {
        "task.preference_source": "/data/pairs.jsonl", "train.learning_rate": 2e-5,
        "model.path": "/models/llama"}  # fmt: skip
    assert rlhf.overrides == {"task.preference_source": "/data/pairs.jsonl",
                              "train.learning_rate": 3e-7}  # fmt: skip
    assert stage_overrides({"recipe.rerun_from": "sft", "stage": "x"}) == {
        "shared": {}, "sft": {}, "reward": {}, "rlhf": {}}  # fmt: skip
    # A reward model of one's own: no reward stage, and so no reward key to take.
    with pytest.raises(RecipeError, match=r"reward.total_steps: this recipe runs no reward"):
        recipe_runs({"task.reward_model": "/models/rm", "reward.total_steps": 3}, stage_config())
    with pytest.raises(RecipeError, match="rerun_from=sfft: not a stage of this recipe"):
        recipe_runs({}, stage_config(), rerun_from="sfft")


def test_a_finished_recipe_is_skipped_and_a_changed_key_refused(recipe_dir):
    finish(recipe_runs({}, stage_config()))
    runs = recipe_runs({}, stage_config())
    assert statuses(runs) == [("sft", "finished"), ("reward", "finished"), ("rlhf", "finished")]
    assert refusals(runs, COMMAND) == []
    # A changed SFT key: SFT refused, naming the key; the stages built on it go with it.
    runs = recipe_runs({"sft.train.learning_rate": 3e-5}, stage_config())
    assert statuses(runs) == [("sft", "refused"), ("reward", "refused"), ("rlhf", "refused")]
    [line] = refusals(runs, [*COMMAND, "--config.sft.train.learning_rate=3e-5"])
    assert line.startswith("runs/nobots/sft (the recipe's sft stage) was made with other "
                           "settings: train.learning_rate 2e-05 → 3e-05: rerun the sft stage "
                           "and those after it with `python -m jaxrlhf.main "
                           "--config=configs/nobots.py --config.sft.train.learning_rate=3e-5 "
                           "--config.recipe.rerun_from=sft`")  # fmt: skip
    assert line.endswith("or write this run elsewhere with --config.output_dir=NEW_ROOT")
    # A changed RLHF key (plain) and another first model: each names its own stage.
    runs = recipe_runs({"train.learning_rate": 1e-6, "model.path": "/other"}, stage_config())
    lines = refusals(runs, COMMAND)
    assert [line.split(" (")[0] for line in lines] == ["runs/nobots/sft", "runs/nobots/rlhf"]
    assert 'model.path "meta-llama/Llama-3.1-8B" → "/other"' in lines[0]
    assert "train.learning_rate 8e-07 → 1e-06" in lines[1]
    # A shorthand compares as the stage reads it (num_mini_batches sets two keys).
    runs = recipe_runs({"num_mini_batches": 1}, stage_config())  # = sync_every 1, staleness 0
    assert "max_staleness 1 → 0" in refusals(runs, COMMAND)[0]
    # Keys that cannot change what a stage trains are not compared.
    runs = recipe_runs({"eval.every": 5, "checkpoint.every": 1, "generator.addresses": "h:1"},
                       stage_config())  # fmt: skip
    assert {run.status for run in runs} == {"finished"}
    # The suggested rerun runs SFT and every stage after it afresh.
    runs = recipe_runs({"sft.train.learning_rate": 3e-5}, stage_config(), rerun_from="sft")
    assert statuses(runs) == [("sft", "reruns"), ("reward", "reruns"), ("rlhf", "reruns")]


def test_a_deleted_sft_stage_makes_the_stages_built_on_it_stale(recipe_dir):
    finish(recipe_runs({}, stage_config()))
    shutil.rmtree(recipe_dir / "sft")
    runs = recipe_runs({}, stage_config())
    assert statuses(runs) == [("sft", "runs"), ("reward", "refused"), ("rlhf", "refused")]
    lines = refusals(runs, COMMAND)
    assert lines[0].startswith("runs/nobots/reward (the recipe's reward stage) was trained from "
                               "runs/nobots/sft (model.path), which this command trains again: "
                               "rerun the reward stage and those after it")  # fmt: skip
    assert lines[1].startswith("runs/nobots/rlhf (the recipe's rlhf stage) was trained from "
                               "runs/nobots/sft (model.path)")  # fmt: skip
    runs = recipe_runs({}, stage_config(), rerun_from="reward")
    assert statuses(runs) == [("sft", "runs"), ("reward", "reruns"), ("rlhf", "reruns")]
    # Rebuilt SFT, stale reward: refused by the digest, not by the folder.
    finish(runs, stages=("sft",), trained=" again")
    runs = recipe_runs({}, stage_config())
    assert statuses(runs) == [("sft", "finished"), ("reward", "refused"), ("rlhf", "refused")]
    assert "was trained from another runs/nobots/sft (model.path) than the one there now" in (
        refusals(runs, COMMAND)[0])  # fmt: skip


def test_a_killed_stage_resumes_and_the_stages_after_it_rerun(recipe_dir):
    finish(recipe_runs({}, stage_config()))
    (recipe_dir / "reward" / "summary.json").unlink()  # killed before its summary
    runs = recipe_runs({}, stage_config())
    assert statuses(runs) == [("sft", "finished"), ("reward", "refused"), ("rlhf", "refused")]
    [line] = refusals(runs, COMMAND)
    assert line.startswith(
        "runs/nobots/reward (the recipe's reward stage) holds the checkpoints of a run that did "
        "not finish (steps [2]): continue it with `python -m jaxrlhf.main "
        "--config=configs/nobots.py --config.resume=true`")  # fmt: skip
    runs = recipe_runs({"resume": True}, stage_config())
    assert statuses(runs) == [("sft", "finished"), ("reward", "resumes"), ("rlhf", "refused")]
    assert {run.config.resume for run in runs} == {True}  # a shared key
    [line] = refusals(runs, [*COMMAND, "--config.resume=true"])
    assert "runs/nobots/reward (task.reward_model), which this command trains again" in line
    assert "--config.resume=true --config.recipe.rerun_from=rlhf`" in line
    runs = recipe_runs({"resume": True}, stage_config(), rerun_from="rlhf")
    assert statuses(runs) == [("sft", "finished"), ("reward", "resumes"), ("rlhf", "reruns")]


@pytest.mark.parametrize("summary", ['{"stage": "sft", "st', '{"stage": "sft", "steps": 2}',
                                     json.dumps({"made_by": {"format": 0}}), "[1]"])  # fmt: skip
def test_a_summary_without_a_record_of_this_format_is_config_unknown(recipe_dir, summary):
    finish(recipe_runs({}, stage_config()))
    (recipe_dir / "sft" / "summary.json").write_text(summary)
    runs = recipe_runs({}, stage_config())
    assert statuses(runs)[0] == ("sft", "refused")
    [line] = refusals(runs, COMMAND)
    assert line.startswith("runs/nobots/sft (the recipe's sft stage) its summary.json ")
    assert "config unknown: rerun the sft stage" in line


def test_a_stage_removes_its_summary_and_export_before_it_trains(tmp_path, monkeypatch):
    """Resumed over a finished folder and killed half-way: never read as finished."""
    config = stage_config()("sft")
    config.output_dir = str(tmp_path / "sft")
    config.model.path = str(tiny_model("llama"))
    finish([type("Run", (), {"stage": "sft", "config": config})])
    assert provenance.read_record(config.output_dir).state == "finished"

    def killed(config, model_path, log):
        assert not (Path(config.output_dir) / "summary.json").exists()
        assert not (Path(config.output_dir) / "hf_export").exists()
        raise KeyboardInterrupt

    from jaxrlhf.stages import sft

    monkeypatch.setattr(sft, "run", killed)
    with pytest.raises(KeyboardInterrupt):
        run_stage(config, log=lambda line: None)
    assert provenance.read_record(config.output_dir).state == "absent"
    assert (tmp_path / "sft" / "checkpoints" / "2").is_dir()  # resumable
    with pytest.raises(KeyboardInterrupt):
        run_stage(config, log=lambda line: None, afresh=True)
    assert not (tmp_path / "sft" / "checkpoints").exists()  # a rerun starts afresh


def test_a_record_names_its_config_and_its_inputs(recipe_dir):
    finish(recipe_runs({}, stage_config()))
    sft, reward, rlhf = (provenance.read_record(recipe_dir / s) for s in ("sft", "reward", "rlhf"))
    assert sft.inputs == {}  # its model is a hub model, not a stage's output
    assert reward.inputs == {"model.path": sft.output_digest}
    assert rlhf.inputs == {"model.path": sft.output_digest,
                           "task.reward_model": reward.output_digest}  # fmt: skip
    assert rlhf.config["task.reward_model"] == "<root>/reward"  # the root moves whole
    assert "output_dir" not in rlhf.config and "eval.every" not in rlhf.config
    assert sft.output_digest == provenance.export_digest(recipe_dir / "sft" / "hf_export")
    assert sft.output_digest != reward.output_digest

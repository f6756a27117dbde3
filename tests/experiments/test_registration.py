"""Pre-registration as code (issue 60): a claim's plan is written before its runs, a run that
departs from it is refused, and the report labels the verdict by what git says came first."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from jaxrlhf.experiments.claims import registration, tuning
from jaxrlhf.experiments.claims.__main__ import main
from jaxrlhf.experiments.claims.claim_registry import claim
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.runner import PlannedRun

SETTINGS = Settings(seeds=(100, 101), steps=tuning.STEPS, eval_every=64)


def planned(out: Path, settings: Settings = SETTINGS) -> dict:
    runs = claim("b-tuning").plan(settings, out)
    return registration.build_plan("b-tuning", settings, runs, claim("b-tuning").registration)


def test_the_tuning_plan_runs_each_loss_on_policy_on_validation_alone(tmp_path):
    runs = claim("b-tuning").plan(SETTINGS, tmp_path)
    per_loss = {loss: 2 * len(tuning.LEARNING_RATES) * 2 for loss in tuning.SECOND}
    assert len(runs) == sum(per_loss.values())  # 3 rates x 2 second settings x 2 seeds a loss
    for run in runs:
        o = run.overrides
        assert o["num_mini_batches"] == 1 and o["eval.test"] is False  # on-policy; no test
        assert o["eval.test_every"] == 0 and o["total_steps"] == 256
        assert o["rollout.prompts_per_batch"] == 16 and run.labels["seed"] in (100, 101)
        key, values = tuning.SECOND[o["loss"]]
        assert o[key] in values and o["train.learning_rate"] in tuning.LEARNING_RATES
    plan = planned(tmp_path)
    assert plan["seeds"] == [100, 101] and len(plan["arms"]) == 24
    params = claim("b-tuning").registration["params"]
    assert plan["rule"] == {"name": "best_on_validation", "params": params}
    assert "output_dir" not in plan["arms"]["online_dpo/lr1.5e-05/beta0.1"]


def test_a_run_needs_the_plan_it_would_run(tmp_path):
    folder = tmp_path / "b-tuning"
    plan = planned(tmp_path)
    line = registration.check_before_running(folder, plan, "CMD")
    assert line.endswith("no plan of this claim: write it with `CMD --write-plan`, commit it, "
                         "then run (pre-registration: the plan precedes the runs)")  # fmt: skip
    registration.write_plan(folder, plan)
    assert registration.check_before_running(folder, plan, "CMD") is None
    other = planned(tmp_path, Settings(seeds=(100, 102), steps=256, eval_every=64))
    assert "differs from what this command would run (seeds)" in (
        registration.check_before_running(folder, other, "CMD"))  # fmt: skip
    changed = json.loads(json.dumps(plan))
    changed["arms"]["ppo/lr5e-06/kl_coef0.02"]["loss_params.kl_coef"] = 0.03
    assert "(arm ppo/lr5e-06/kl_coef0.02's overrides)" in (
        registration.check_before_running(folder, changed, "CMD"))  # fmt: skip


def test_the_command_writes_the_plan_and_refuses_to_run_without_it(tmp_path, capsys):
    with pytest.raises(SystemExit, match="no plan of this claim: write it with"):
        main(["--claim", "b-tuning", "--out", str(tmp_path)])
    main(["--claim", "b-tuning", "--out", str(tmp_path), "--write-plan"])
    assert "commit it before the first run" in capsys.readouterr().out
    assert registration.read_plan(tmp_path / "b-tuning") == planned(tmp_path.resolve())
    with pytest.raises(SystemExit, match=r"differs from what this command would run \(seeds\)"):
        main(["--claim", "b-tuning", "--out", str(tmp_path), "--seeds", "100-103"])


def git(folder: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=folder, check=True, capture_output=True)


def commit(folder: Path, message: str) -> None:
    git(folder, "add", "-A")
    git(folder, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message)


def record(folder: Path, arm: str) -> None:
    run = folder / arm / "seed100"
    run.mkdir(parents=True)
    (run / "summary.json").write_text("{}")


def test_the_verdict_is_pre_registered_only_when_the_plan_came_first(tmp_path):
    git(tmp_path, "init", "-q")
    folder = tmp_path / "b-tuning"
    plan = planned(tmp_path)
    registration.write_plan(folder, plan)
    assert registration.registration(folder, plan, []) == "post hoc: plan.json was never committed"
    commit(tmp_path, "plan")
    assert registration.registration(folder, plan, []) == "pre-registered"
    record(folder, "ppo")
    commit(tmp_path, "records")
    assert registration.registration(folder, plan, []) == "pre-registered"
    assert registration.registration(folder, plan, ["grpo − ppo"]) == (
        "post hoc: comparisons not in the plan (grpo − ppo)")  # fmt: skip
    plan["measure"] = "area under the validation curve"  # changed after the first record
    registration.write_plan(folder, plan)
    commit(tmp_path, "a new measure")
    assert registration.registration(folder, plan, []) == (
        "post hoc: plan.json changed after the claim's first record")  # fmt: skip
    old = planned(tmp_path)
    assert registration.registration(folder, old, []).startswith(
        "post hoc: the runs differ from the plan (measure)")  # fmt: skip


def test_a_plan_committed_with_its_first_records_is_post_hoc(tmp_path):
    git(tmp_path, "init", "-q")
    folder = tmp_path / "b-tuning"
    plan = planned(tmp_path)
    registration.write_plan(folder, plan)
    record(folder, "ppo")
    commit(tmp_path, "plan and records together")
    assert registration.registration(folder, plan, []) == (
        "post hoc: plan.json changed after the claim's first record")  # fmt: skip


def test_packed_records_keep_the_order_of_plan_and_records(tmp_path):
    """Records committed as a pack (`records.pack`) are records: a plan before them is
    pre-registered; one committed with them is post hoc."""
    from jaxrlhf.experiments import records

    git(tmp_path, "init", "-q")
    folder = tmp_path / "b-tuning"
    plan = planned(tmp_path)
    registration.write_plan(folder, plan)
    commit(tmp_path, "plan")
    record(folder, "ppo")
    records.pack(folder)
    commit(tmp_path, "records packed")
    assert registration.registration(folder, plan, []) == "pre-registered"
    other = tmp_path / "other" / "b-tuning"
    registration.write_plan(other, plan)
    record(other, "ppo")
    records.pack(other)
    commit(tmp_path, "plan and packed records together")
    assert registration.registration(other, plan, []) == (
        "post hoc: plan.json changed after the claim's first record")  # fmt: skip


def test_the_tuning_rule_takes_the_best_validation_and_breaks_ties_by_the_smaller_step(tmp_path):
    settings = Settings(seeds=(100, 101), steps=256, eval_every=64, losses=("grpo",))
    runs = claim("b-tuning").plan(settings, tmp_path)
    score = {"grpo/lr5e-06/kl_coef0.02": 40.0, "grpo/lr1.5e-05/kl_coef0.02": 55.0,
             "grpo/lr1.5e-05/kl_coef0.05": 55.0, "grpo/lr4.5e-05/kl_coef0.02": 30.0}  # fmt: skip
    arms: dict[str, dict[int, dict]] = {}
    for run in runs:
        value = score.get(run.labels["arm"], 20.0) + run.labels["seed"] - 100.5
        arms.setdefault(run.labels["arm"], {})[run.labels["seed"]] = {"validation": value}
    chosen = tuning.best_on_validation(arms, runs)
    assert chosen["grpo"]["arm"] == "grpo/lr1.5e-05/kl_coef0.02"  # tie: the smaller KL coef
    assert chosen["grpo"]["settings"] == {"train.learning_rate": 1.5e-5,
                                          "loss_params.kl_coef": 0.02}  # fmt: skip
    assert chosen["grpo"]["validation"] == 55.0
    assert math.isclose(chosen["grpo"]["validation_stderr"], 0.5)
    del arms["grpo/lr4.5e-05/kl_coef0.05"][101]  # one run unfinished: no choice yet
    assert tuning.best_on_validation(arms, runs) == {}


def test_a_planned_run_keeps_its_seed_out_of_the_arms_overrides(tmp_path):
    run = PlannedRun({"arm": "x", "seed": 3}, tmp_path, {"seed": 3, "output_dir": "o", "a": 1})
    plan = registration.build_plan("b-tuning", SETTINGS, [run], claim("b-tuning").registration)
    assert plan["arms"] == {"x": {"a": 1}}


def test_every_committed_plan_matches_its_records():
    """Each pre-registered claim's records ran as its plan says: every run's overrides are its
    arm's (its folder and seed aside), on a planned seed. Runs loose or packed (`records`)."""
    from jaxrlhf.experiments import records
    from tests.conftest import REPO

    plans = sorted((REPO / "results" / "claims").glob(f"*/{registration.PLAN}"))
    for path in plans:
        plan = registration.read_plan(path.parent)
        assert plan is not None, f"{path}: not a plan of this format"
        for run in records.runs(path.parent):  # {arm}/seed{S}/
            settings = run / "experiment.json"
            text = records.text(run, "experiment.json")
            if text is None:
                continue
            overrides = json.loads(text)
            arm = str(run.parent.relative_to(path.parent))
            assert arm in plan["arms"], f"{settings}: arm {arm} is not in {path}"
            assert overrides["seed"] in plan["seeds"], settings
            ran = {k: v for k, v in overrides.items() if k not in registration.RUN_KEYS}
            assert ran == plan["arms"][arm], f"{settings}: other overrides than {path}'s"

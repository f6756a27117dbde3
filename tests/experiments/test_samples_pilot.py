"""Claim d-pilot ((d)'s setting, chosen before (d) runs again): its plan runs (d)'s two arms at
every size with the test split off; its record chooses the smallest size whose K = 4 arm idles
at most the bound, by hand on hand-written runs."""

from __future__ import annotations

import json

import pytest

from jaxrlhf.experiments.claims.claim_registry import claim
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.claims.samples_pilot import BOUND, SIZES
from jaxrlhf.experiments.claims.verdicts import analyse
from tests.experiments.test_claims import write_run

SETTINGS = Settings(seeds=(700,), steps=4, eval_every=4)


def test_the_plan_runs_d_s_arms_at_every_size_on_validation_alone(tmp_path):
    assert claim("d-pilot").defaults["seeds"] == "700" and claim("d-pilot").registration
    runs = claim("d-pilot").plan(SETTINGS, tmp_path)
    assert [run.labels["arm"] for run in runs] == [f"{s}/K{k}" for s in SIZES for k in (2, 4)]
    for run in runs:
        o = run.overrides
        assert o["model.path"] == run.labels["size"] and o["max_staleness"] == 1
        assert o["rollout.samples_per_prompt"] == run.labels["samples_per_prompt"]
        assert o["eval.test"] is False and o["eval.test_every"] == 0


def _with_idle(folder, idle: float) -> None:
    write_run(folder, test=0.0, validation=0.5)
    path = folder / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:  # the first update (compilation, no batch ready) far off
        r["learner_idle_fraction"] = 0.9 if r["step"] == 1 else idle
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize(
    ("idle_k4", "chosen"),
    [({"bed": 0.2, "bed-m": 0.04, "bed-l": 0.01}, "bed-m"),
     ({"bed": 0.2, "bed-m": BOUND, "bed-l": 0.01}, "bed-m"),  # at the bound: bound
     ({"bed": 0.2, "bed-m": 0.1, "bed-l": 0.06}, None)],
)  # fmt: skip
def test_the_smallest_size_idling_at_most_the_bound_at_k4_is_chosen(tmp_path, idle_k4, chosen):
    runs = claim("d-pilot").plan(SETTINGS, tmp_path)
    for run in runs:  # K = 2 idles less everywhere: it never decides
        size, k = run.labels["size"], run.labels["samples_per_prompt"]
        _with_idle(run.folder, idle_k4[size] if k == 4 else 0.0)
    record = analyse("d-pilot", runs, SETTINGS)
    assert record["chosen"]["size"] == chosen and record["chosen"]["decided"]
    assert record["chosen"]["idle"]["bed/K4"] == pytest.approx(0.2)  # updates 2+ only
    word = record["verdict"]["word"]
    assert word == (f"training-bound at {chosen}" if chosen else "none bound")


def test_nothing_is_chosen_before_every_k4_arm_finished(tmp_path):
    runs = claim("d-pilot").plan(SETTINGS, tmp_path)
    for run in runs:
        if run.labels["arm"] != "bed-l/K4":
            _with_idle(run.folder, 0.0)
    record = analyse("d-pilot", runs, SETTINGS)
    assert record["chosen"]["size"] is None and record["verdict"]["word"] == "part-run"


def test_d_bound_runs_on_the_size_the_pilot_chose_with_its_record():
    """d-bound's SIZE is what d-pilot's committed record chose by its registered rule."""
    from jaxrlhf.experiments.claims.samples_bound import SIZE
    from tests.conftest import REPO

    record = json.loads((REPO / "results/claims/d-pilot/claim.json").read_text())
    assert record["chosen"]["decided"] and record["chosen"]["size"] == SIZE
    assert record["verdict"]["word"] == f"training-bound at {SIZE}"


def test_d_bound_plans_its_arms_on_that_size_and_names_its_comparisons_as_registered(tmp_path):
    """(d)'s rule on d-bound's runs, by hand as (d)'s own test: both arms end at 50% validation
    (the target, 50% test); K2 reaches it at update 4, K4 at 2 for seeds 0-1 and at 4 for
    seed 2. The comparisons carry the registered names, the target goes to the detail."""
    from jaxrlhf.experiments.claims.samples_bound import COMPARISONS, RULE, SIZE

    spec = claim("d-bound")
    assert spec.defaults == {"seeds": "600-623", "eval_every": 4} and spec.registration == RULE
    settings = Settings(seeds=(0, 1, 2), steps=4, eval_every=2)
    runs = spec.plan(settings, tmp_path)
    assert [run.labels["arm"] for run in runs] == ["K2", "K4"] * 3
    for run in runs:
        assert run.overrides["model.path"] == SIZE and run.overrides["max_staleness"] == 1
        assert run.overrides["eval.test_every"] == 2  # every evaluation interval
        k4 = run.labels["samples_per_prompt"] == 4
        write_run(run.folder, (0.9 if run.labels["seed"] == 2 else 1.0) if k4 else 0.6)
    record = analyse("d-bound", runs, settings)
    assert [c["name"] for c in record["comparisons"]] == list(COMPARISONS)
    assert list(COMPARISONS) == RULE["families"]["(d)"]
    assert record["comparisons"][0]["mean"] == pytest.approx((-2 - 2 + 0) / 3)
    assert record["verdict"]["word"] == "unresolved at this power"
    assert record["verdict"]["detail"].startswith("target 50.0% test; updates to 50.0% test")

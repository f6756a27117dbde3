"""Claim a-steps ((a) at three step sizes) on hand-written run records: one family and one
verdict per step size, by (a)'s own rule, and the wall-time speed-up computed by hand."""

from __future__ import annotations

import json
import math

import pytest
from scipy import stats

from jaxrlhf.experiments.claims.async_step_sizes import STEP_SIZES, arm_of
from jaxrlhf.experiments.claims.claim_registry import claim
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.claims.verdicts import analyse
from tests.experiments.test_claims import write_run

SYNC_WALL = {0: 11.0, 1: 12.0, 2: 13.0}
RATIO = {0: 1.1, 1: 1.2, 2: 1.3}  # sync's wall seconds / one-step-off's


def test_each_step_size_is_its_own_family_with_its_own_verdict(tmp_path):
    settings = Settings(seeds=(0, 1, 2), steps=4, eval_every=2)
    runs = claim("a-steps").plan(settings, tmp_path)
    assert len(runs) == 3 * 3 * 3 and {r.overrides["train.learning_rate"] for r in runs} == set(
        STEP_SIZES
    )
    small, middle, large = STEP_SIZES
    for run in runs:
        seed, lr, mode = run.labels["seed"], run.labels["step_size"], run.labels["mode"]
        offset = 0.0
        if mode != "sync" and lr == small:
            offset = 0.001 * (seed + 1)  # +0.1, +0.2, +0.3 points: as good
        if mode != "sync" and lr == middle:
            offset = (-0.04, 0.0, 0.04)[seed]  # −4, 0, +4 points: too wide to tell
        if mode != "sync" and lr == large:
            offset = -0.10 - 0.01 * seed  # −10, −11, −12 points: worse beyond the margin
        write_run(run.folder, 0.5 + 0.1 * seed + offset)
        wall = SYNC_WALL[seed] / (RATIO[seed] if mode == "one-step-off" else 1.0)
        summary = json.loads((run.folder / "summary.json").read_text())
        (run.folder / "summary.json").write_text(json.dumps({**summary, "wall_seconds": wall}))
    record = analyse("a-steps", runs, settings)
    assert record["verdict"]["word"] == (
        "lr 1.5e-05: supported; lr 4.5e-05: unresolved at this power; lr 0.0001: contradicted"
    )
    by_name = {c["name"]: c for c in record["comparisons"]}
    worse = by_name[f"{arm_of(large, 'continuous')} − {arm_of(large, 'sync')}"]
    assert worse["mean"] == pytest.approx(-11.0) and worse["beyond_noise"]
    # Holm within a step size's family of 2, never across the 6 comparisons: each family's
    # smaller p meets 0.05 / 2.
    assert record["family_size"] == 6
    logs = [math.log(RATIO[s]) for s in (0, 1, 2)]
    mean = sum(logs) / 3
    half = stats.t.ppf(0.975, 2) * stats.tstd(logs) / math.sqrt(3)
    expected = f"{math.exp(mean):.2f}x [{math.exp(mean - half):.2f}, {math.exp(mean + half):.2f}]"
    detail = record["verdict"]["detail"]
    assert f"{arm_of(small, 'one-step-off')} − {arm_of(small, 'sync')}" in detail
    assert f"speed-up {expected}" in detail and "speed-up 1.00x [1.00, 1.00]" in detail


def test_its_plan_is_registered_before_its_runs():
    spec = claim("a-steps")
    assert spec.registration is not None and spec.defaults == {"seeds": "200-209"}
    assert set(spec.registration["families"]) == {f"lr{lr:g}" for lr in STEP_SIZES}

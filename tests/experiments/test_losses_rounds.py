"""Claim b-rounds ((b) at each loss's tuned settings over 4 generation rounds): its plan runs
each loss at the settings b-tuning's committed record chose, and its verdict on hand-written
run records follows (b)'s rule, with each arm's policy KL beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jaxrlhf.experiments.claims import losses_rounds
from jaxrlhf.experiments.claims.claim_registry import claim
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.claims.verdicts import analyse
from tests.experiments.test_claims import write_run

TUNING = Path(__file__).resolve().parents[2] / "results" / "claims" / "b-tuning" / "claim.json"


def test_each_loss_runs_at_the_settings_its_tuning_chose():
    chosen = json.loads(TUNING.read_text())["chosen"]
    assert set(chosen) == set(losses_rounds.TUNED) == set(losses_rounds.LOSSES)
    for loss, settings in losses_rounds.TUNED.items():
        assert settings == chosen[loss]["settings"], loss


def test_the_plan_makes_four_generation_rounds_at_the_largest_n(tmp_path):
    settings = Settings(seeds=(400, 401), steps=losses_rounds.STEPS, eval_every=64)
    runs = claim("b-rounds").plan(settings, tmp_path)
    assert len(runs) == 2 * 4 * 4
    for run in runs:
        o = run.overrides
        assert o["loss"] == run.labels["variant"] and o["eval.test"] is True
        assert o["total_steps"] // o["num_mini_batches"] >= 4  # generation rounds per run
        assert o["rollout.prompts_per_batch"] == losses_rounds.PROMPTS_PER_BATCH
        for key, value in losses_rounds.TUNED[o["loss"]].items():
            assert o[key] == value
    spec = claim("b-rounds")
    assert spec.registration is not None and spec.defaults["seeds"] == losses_rounds.SEEDS
    assert len(spec.registration["families"]["fall vs Online DPO"]) == 9


def test_a_loss_that_falls_more_beyond_noise_at_the_largest_n_supports_it(tmp_path):
    settings = Settings(seeds=(0, 1, 2), steps=4, eval_every=2)
    runs = claim("b-rounds").plan(settings, tmp_path)
    for run in runs:
        seed, n, loss = run.labels["seed"], run.labels["num_mini_batches"], run.labels["variant"]
        fall = 0.0
        if n == 64:
            # Online DPO falls 1 point at N = 64; every other loss 10, 11, 12 points.
            fall = 0.01 if loss == "online_dpo" else 0.10 + 0.01 * seed
        write_run(run.folder, 0.6 + 0.01 * seed - fall)
        summary = json.loads((run.folder / "summary.json").read_text())
        kl = 0.5 if n == 64 else 0.1
        (run.folder / "summary.json").write_text(json.dumps({**summary, "policy_kl_end": kl}))
    record = analyse("b-rounds", runs, settings)
    assert record["verdict"]["word"] == "supported"
    by_name = {c["name"]: c for c in record["comparisons"]}
    assert set(by_name) == set(claim("b-rounds").registration["families"]["fall vs Online DPO"])
    # ppo's fall at N = 64 minus Online DPO's: (10, 11, 12) − 1 points.
    assert by_name["ppo − online_dpo, fall at N=64"]["mean"] == pytest.approx(10.0)
    assert by_name["ppo − online_dpo, fall at N=4"]["mean"] == pytest.approx(0.0, abs=1e-9)
    assert "policy KL: online_dpo/N1 0.100" in record["verdict"]["detail"]
    assert "grpo/N64 0.500" in record["verdict"]["detail"]

"""Claim b-tuning, (b)'s tuning: each loss at its own best settings, chosen on validation
before (b) runs; pre-registered (`RULE`, `registration`).

Every loss runs on its own on-policy arm (N = 1: synchronous, one mini-batch a round) over a
grid of `LEARNING_RATES` and its second setting (`SECOND`: Online DPO's β; the KL
coefficient of PPO, RLOO and GRPO), on seeds apart from the claim's (`SEEDS`), with the test
split off (no test evaluation at all). The horizon is (b)'s over several generation rounds:
`STEPS` updates of `PROMPTS_PER_BATCH` prompts, a quarter of the bed's batch, so that a run
generates as many samples as the one-round (b)'s 64 updates, and N = 64 makes 4 rounds.

The rule, fixed before the runs (`best_on_validation`): for each loss, the grid point with the
highest mean final validation accuracy over the seeds; a tie goes to the smaller learning rate,
then the smaller second setting. The chosen settings go into (b)'s plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments.claims.analysis import Verdict
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings, planned_run
from jaxrlhf.experiments.runner import PlannedRun
from jaxrlhf.experiments.stats import mean_stderr

STEPS = 256
PROMPTS_PER_BATCH = 16
SEEDS = "100-101"
LEARNING_RATES = (5e-6, 1.5e-5, 4.5e-5)
SECOND = {
    "online_dpo": ("loss_params.beta", (0.05, 0.1)),
    "ppo": ("loss_params.kl_coef", (0.02, 0.05)),
    "rloo": ("loss_params.kl_coef", (0.02, 0.05)),
    "grpo": ("loss_params.kl_coef", (0.02, 0.05)),
}
RULE = {
    "measure": "final greedy accuracy on the whole validation split (points), mean over seeds",
    "rule": "best_on_validation",
    "params": {"tie": "smaller learning rate, then smaller second setting"},
    "families": {},  # a choice, not a test: no comparison is corrected
}


def grid(losses) -> list[tuple[str, dict[str, Any]]]:
    """(arm, overrides) of every grid point, loss by loss."""
    points = []
    for loss in losses:
        key, values = SECOND[loss]
        for lr in LEARNING_RATES:
            for value in values:
                arm = f"{loss}/lr{lr:g}/{key.rsplit('.', 1)[1]}{value:g}"
                points.append((arm, {"loss": loss, "train.learning_rate": lr, key: value}))
    return points


def best_on_validation(arms: dict[str, dict[int, dict[str, Any]]], runs) -> dict[str, Any]:
    """{loss: the chosen arm, its overrides and its validation mean ± s.e.} (module docstring);
    a loss with unfinished runs chooses nothing yet."""
    overrides = {run.labels["arm"]: run.overrides for run in runs}
    planned: dict[str, int] = {}
    for run in runs:
        planned[run.labels["arm"]] = planned.get(run.labels["arm"], 0) + 1
    chosen = {}
    for loss in dict.fromkeys(run.labels["loss"] for run in runs):
        candidates = []
        for arm in (a for a in planned if a.startswith(f"{loss}/")):
            seeds = arms.get(arm, {})
            if len(seeds) < planned[arm]:
                break
            values = [f["validation"] for f in seeds.values() if math.isfinite(f["validation"])]
            mean, stderr = mean_stderr(values)
            key, _ = SECOND[loss]
            order = (-mean, overrides[arm]["train.learning_rate"], overrides[arm][key])
            candidates.append((order, arm, mean, stderr))
        else:
            _, arm, mean, stderr = min(candidates)
            settings = {k: v for k, v in overrides[arm].items()
                        if k in ("train.learning_rate", *(SECOND[loss][0],))}  # fmt: skip
            chosen[loss] = {"arm": arm, "settings": settings, "validation": mean,
                            "validation_stderr": stderr}  # fmt: skip
    return chosen


def plan_tuning(settings: Settings, out: Path):
    """Each loss's grid points on its own on-policy arm, test split off (module docstring)."""
    on_policy = {"num_mini_batches": 1, "rollout.prompts_per_batch": PROMPTS_PER_BATCH,
                 "eval.test": False, "eval.test_every": 0}  # fmt: skip
    return [
        planned_run(
            out,
            "b-tuning",
            arm,
            seed,
            settings,
            {**on_policy, **overrides},
            {"loss": overrides["loss"]},
        )  # fmt: skip
        for seed in settings.seeds
        for arm, overrides in grid(settings.losses)
    ]


def tuning_record(arms, runs: Sequence[PlannedRun], settings: Settings) -> dict[str, Any]:
    """(b)'s tuning: the settings chosen per loss (`best_on_validation`)."""
    chosen = best_on_validation(arms, runs)
    losses = list(dict.fromkeys(run.labels["loss"] for run in runs))
    detail = "; ".join(f"{loss}: {c['arm'].split('/', 1)[1]} ({c['validation']:.1f} ± "
                       f"{c['validation_stderr']:.1f} on validation)"
                       for loss, c in chosen.items())  # fmt: skip
    word = "tuned" if len(chosen) == len(losses) else "part-run"
    return {"chosen": chosen, "comparisons": [], "family_size": 0,
            "verdict": Verdict(word, detail or "no loss finished").as_dict()}  # fmt: skip


SPEC = ClaimSpec(
    name="b-tuning",
    title="(b) tuning: each loss's learning rate and β or KL coefficient, on validation",
    paper="set per loss (Online DPO 3e-6 with β 0.05; PPO 1e-6)",
    plan=plan_tuning,
    analysis=tuning_record,
    table_row=False,
    registration=RULE,
    defaults={"seeds": SEEDS, "steps": STEPS, "eval_every": 64},
)

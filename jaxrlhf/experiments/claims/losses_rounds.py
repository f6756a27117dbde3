"""Claim b-rounds: (b) with each loss at its own tuned settings, over several generation
rounds, pre-registered (`RULE`, `registration`).

The one-round (b) (`losses_robust`) ran every loss at one learning rate and β, chosen for
Online DPO, over 64 updates: at N = 64 a run generated once. Here:

- each loss runs at the settings (b)'s tuning chose for it on validation (`TUNED`, from
  `results/claims/b-tuning/claim.json`; `tuning.best_on_validation`), checked against those
  records by a test;
- a run is `STEPS` updates of `PROMPTS_PER_BATCH` prompts (a quarter of the bed's batch, as
  in the tuning), so that it generates as many samples as a one-round run and N = 64
  mini-batches a round makes 4 generation rounds;
- Online DPO, PPO, RLOO and GRPO at N in `MINI_BATCHES`, on seeds apart from every other
  claim's (`SEEDS`), each seed's arms one after another.

The rule, fixed before the runs (`losses_robust_rounds`), is (b)'s own
(`losses_robust.losses_robust`) over the plain losses: per other loss L and N > 1, the fall of
final test accuracy from N = 1 to N, L's − Online DPO's, paired by seed; one family of the
nine, corrected by Holm's procedure. Supported: at the largest N every other loss falls more,
beyond noise; contradicted: one falls less than Online DPO beyond noise at some N.
Reported beside, not judged: each arm's final policy KL from the start model on its own
samples of held-out prompts (`eval.kl_prompts`).
"""

from __future__ import annotations

import math
from pathlib import Path

from jaxrlhf.experiments.claims.analysis import Finding, Verdict
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.losses_robust import losses_robust, offpolicy_arm
from jaxrlhf.experiments.claims.plans import Settings, planned_run
from jaxrlhf.experiments.claims.tuning import PROMPTS_PER_BATCH, STEPS
from jaxrlhf.experiments.offpolicy import variant_overrides

NAME = "b-rounds"
SEEDS = "400-409"
LOSSES = ("online_dpo", "ppo", "rloo", "grpo")
MINI_BATCHES = (1, 4, 16, 64)
# Each loss's settings as (b)'s tuning chose them on validation (b-tuning's claim.json
# "chosen"); tests/experiments/test_claims_registered.py checks them against its records.
TUNED = {
    "online_dpo": {"train.learning_rate": 1.5e-05, "loss_params.beta": 0.05},
    "ppo": {"train.learning_rate": 4.5e-05, "loss_params.kl_coef": 0.05},
    "rloo": {"train.learning_rate": 1.5e-05, "loss_params.kl_coef": 0.02},
    "grpo": {"train.learning_rate": 4.5e-05, "loss_params.kl_coef": 0.02},
}

RULE = {
    "measure": "final greedy accuracy on the whole test split (points); per other loss L and "
    "N > 1: (L at N = 1 − L at N) − (Online DPO at N = 1 − Online DPO at N), paired by seed",
    "rule": "losses_robust_rounds",
    "params": {
        "supported": "at the largest N every other loss falls more than Online DPO, beyond noise",
        "contradicted": "some other loss falls less than Online DPO beyond noise, at some N",
        "otherwise": "unresolved at this power",
        "beyond noise": "Holm's procedure over the family at level 0.05",
        "tuned settings": TUNED,
        "reported, not judged": [
            "KL to the start model: the final policy's on its own samples of 256 validation "
            "prompts (summary.json policy_kl_end), mean over seeds, per arm",
        ],
    },
    "families": {
        "fall vs Online DPO": [
            f"{loss} − online_dpo, fall at N={n}" for loss in LOSSES[1:] for n in MINI_BATCHES[1:]
        ],
    },  # fmt: skip
}


def plan_rounds(settings: Settings, out: Path):
    """Each seed's arms one after another (loss, then N), each loss at its tuned settings."""
    return [
        planned_run(
            out,
            NAME,
            offpolicy_arm(loss, n),
            seed,
            settings,
            {
                "num_mini_batches": n,
                "rollout.prompts_per_batch": PROMPTS_PER_BATCH,
                **variant_overrides(loss),
                **TUNED[loss],
            },
            {"variant": loss, "num_mini_batches": n},
        )  # fmt: skip
        for seed in settings.seeds
        for loss in LOSSES
        for n in MINI_BATCHES
    ]


def policy_kl(arms, arm: str) -> str:
    values = [f["policy_kl"] for f in arms.get(arm, {}).values()
              if f.get("policy_kl") is not None and math.isfinite(f["policy_kl"])]  # fmt: skip
    return f"{sum(values) / len(values):.3f}" if values else "-"


def losses_robust_rounds(arms, settings: Settings) -> tuple[list[Finding], Verdict]:
    """(b)'s rule on the plain losses (module docstring), with each arm's final policy KL from
    the start model beside it."""
    findings, verdict = losses_robust(arms, settings)
    kls = ", ".join(f"{arm} {policy_kl(arms, arm)}" for arm in arms)
    return findings, Verdict(verdict.word, f"{verdict.detail}; policy KL: {kls}")


SPEC = ClaimSpec(
    name=NAME,
    title="(b) at each loss's tuned settings, over 4 generation rounds: is Online DPO the "
    "loss most robust to off-policy data",
    paper="Online DPO still learns at N = 64; PPO and RLOO degrade (TLDR)",
    plan=plan_rounds,
    rule=losses_robust_rounds,
    registration=RULE,
    defaults={"seeds": SEEDS, "steps": STEPS, "eval_every": 64},
)

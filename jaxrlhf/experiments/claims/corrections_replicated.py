"""Claim f-replicated: (f) again on new seeds, pre-registered (`RULE`, `registration`).

(f)'s first runs (seeds 0-9) gained their control arm ("grpo+none": π_old recomputed on the
learner, no correction) and regrouped their family after their results. Here the same arms on
the same workload (`corrections_mixed.MIXED_WORKLOAD`: continuous generation, in-flight swaps,
generation-bound) run on seeds apart from every other claim's (`SEEDS`), with the family fixed
before the first run: Online DPO − GRPO, the control − GRPO, and each correction − the control
(final test accuracy, paired by seed, Holm over the five). The rule is (f)'s own
(`corrections_mixed.corrections_on_mixed`): which differences are beyond noise, judged only if
≥ 30% of the samples mixed versions.
"""

from __future__ import annotations

from pathlib import Path

from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.corrections_mixed import (
    base_of,
    corrections_on_mixed,
    mixed_variants,
    plan_mixed,
)
from jaxrlhf.experiments.claims.plans import Settings

SEEDS = "10-19"
NAME = "f-replicated"


def family_of(settings: Settings) -> list[str]:
    """The comparisons of (f)'s final family, in its rule's order."""
    loss = settings.mixed_loss
    control = f"{loss}+none"
    return [f"{arm} − {base_of(arm, loss, control)}" for arm in mixed_variants(settings)
            if arm != loss]  # fmt: skip


RULE = {
    "measure": "final greedy accuracy on the whole test split (points), paired by seed",
    "rule": "corrections_on_mixed",
    "params": {
        "mixed-version share needed": 0.3,
        "beyond noise": "Holm's procedure over the family at level 0.05",
        "verdict": "the differences beyond noise, by name (none: 'none')",
    },
    "families": {"f": family_of(Settings(seeds=()))},
}


def plan_replicated(settings: Settings, out: Path):
    """(f)'s arms and workload, into this claim's folder."""
    return plan_mixed(settings, out, claim=NAME)


def replicated(arms, settings: Settings):
    """(f)'s rule, unchanged (`corrections_mixed.corrections_on_mixed`)."""
    return corrections_on_mixed(arms, settings)


SPEC = ClaimSpec(
    name=NAME,
    title="(f) replicated: off-policy corrections on samples that span a publish, new seeds",
    paper="not studied",
    plan=plan_replicated,
    rule=replicated,
    registration=RULE,
    defaults={"seeds": SEEDS},
)

"""Claim d-pilot: the setting (d) needs, chosen before (d) runs again; pre-registered (`RULE`,
`registration`).

(d) says that, training-bound, K = 4 samples per prompt reach a target sooner than K = 2. On
the bed's default setting the learner waited for its batch 20% of the time at K = 4 (5% at
K = 2): generation, not training, bounded it, so the claim's condition did not hold. The
learner's share of an update grows with the policy's size faster than generation's on these
cores (claim (c)'s records: the sync learner idles 77%, 62% and 47% of the time at the bed's
three sizes), so the pilot runs (d)'s two arms (one step off, 64 prompts a batch with K
samples each, the learner training on each prompt's best and worst) at each size (`SIZES`), one
seed apart from every other claim's (`SEEDS`), test split off, and measures the learner's idle
share (`learner_idle_fraction`, the mean over updates 2+).

The rule, fixed before the runs (`training_bound_size`): the smallest size whose K = 4 arm
idles at most `BOUND` of the time; none: (d) cannot be made training-bound on these cores by
size alone, and says so. The pilot's runs are timing runs: they run alone on the machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments.claims.analysis import Verdict
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings, planned_run
from jaxrlhf.experiments.claims.samples_sooner import samples_arm
from jaxrlhf.experiments.runner import PlannedRun

NAME = "d-pilot"
SEEDS = "700"
SIZES = ("bed", "bed-m", "bed-l")
SAMPLES = (2, 4)
BOUND = 0.05
RULE = {
    "measure": "the learner's idle share (learner_idle_fraction, waiting for its batch ÷ the "
    "update's time), mean over updates 2+, per size and K",
    "rule": "training_bound_size",
    "params": {"bound": BOUND, "at": "K = 4", "sizes": list(SIZES),
               "choice": "the smallest size whose K = 4 arm idles at most the bound",
               "none": "no size is training-bound at K = 4: said so, (d) not rerun by size"},
    "families": {},  # a choice, not a test
}  # fmt: skip


def arm_name(size: str, k: int) -> str:
    return f"{size}/K{k}"


def plan_pilot(settings: Settings, out: Path) -> list[PlannedRun]:
    """(d)'s arms at every size, test split off (module docstring)."""
    return [
        planned_run(
            out,
            NAME,
            arm_name(size, k),
            seed,
            settings,
            {"model.path": size, **samples_arm(k), "eval.test": False, "eval.test_every": 0},
            {"size": size, "samples_per_prompt": k},
        )  # fmt: skip
        for seed in settings.seeds
        for size in SIZES
        for k in SAMPLES
    ]


def training_bound_size(arms, runs: Sequence[PlannedRun]) -> dict[str, Any]:
    """{"idle": {arm: mean idle share}, "size": the choice or None, "decided": whether every
    size's K = 4 arm finished} (module docstring)."""
    idle = {arm: sum(f["learner_idle_fraction"] for f in seeds.values()) / len(seeds)
            for arm, seeds in arms.items() if seeds}  # fmt: skip
    planned = {run.labels["arm"] for run in runs}
    bound_arms = [arm_name(size, 4) for size in SIZES if arm_name(size, 4) in planned]
    decided = all(arm in idle and math.isfinite(idle[arm]) for arm in bound_arms)
    size = next((arm.split("/")[0] for arm in bound_arms if arm in idle
                 and (idle[arm] <= BOUND or math.isclose(idle[arm], BOUND))), None)  # fmt: skip
    return {"idle": idle, "size": size if decided else None, "decided": decided}


def pilot_record(arms, runs: Sequence[PlannedRun], settings: Settings) -> dict[str, Any]:
    """The idle shares and the size chosen (`training_bound_size`)."""
    chosen = training_bound_size(arms, runs)
    shares = ", ".join(f"{arm} {share:.3f}" for arm, share in chosen["idle"].items())
    if not chosen["decided"]:
        word = "part-run"
    else:
        word = f"training-bound at {chosen['size']}" if chosen["size"] else "none bound"
    return {"chosen": chosen, "comparisons": [], "family_size": 0,
            "verdict": Verdict(word, f"learner idle: {shares or 'no arm finished'}; "
                                     f"bound {BOUND} at K = 4").as_dict()}  # fmt: skip


SPEC = ClaimSpec(
    name=NAME,
    title="(d)'s pilot: the smallest bed on which K = 4 is training-bound",
    plan=plan_pilot,
    analysis=pilot_record,
    table_row=False,
    registration=RULE,
    defaults={"seeds": SEEDS, "eval_every": 64},  # validation at the end alone
)

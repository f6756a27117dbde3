"""Claim d-bound: (d) where its condition holds, training-bound, pre-registered (`RULE`,
`registration`).

(d) says that, training-bound, K = 4 samples per prompt reach a target sooner than K = 2. Its
first runs were not training-bound at K = 4 on the bed (the learner waited 20% of the time),
and evaluations 16 updates apart allowed five values of "updates to the target". Here:

- the policy is `SIZE`, the smallest of the bed's sizes on which the K = 4 arm is
  training-bound, chosen by claim d-pilot's registered rule before this plan (checked against
  its record by a test);
- test and validation are evaluated every `EVAL_EVERY` updates;
- (d)'s two arms (one step off, 64 prompts a batch with K in {2, 4} samples each, the learner
  training on each prompt's best and worst) on `SEEDS`, apart from every other claim's: 24, from
  the power calculation on (d)'s first records (the paired s.d. of updates to the target, 13.5;
  a paired t-test at Holm's first level in a family of three, 0.05 / 3, has 81% power against
  the 9.6-update difference they measured with 24 seeds, scipy's noncentral t).

The rule, fixed before the runs, is (d)'s (`samples_sooner.samples_sooner`) with its
comparisons named without the target's value: the target is the lower of the two arms' mean
final validation accuracies (chosen on validation, met on test); a seed that never reaches it
counts the run's updates plus one evaluation interval, and its whole time. One Holm family of
three: updates to the target, the learner's seconds to it, and the KL there (K4 − K2, paired by
seed). Supported: K = 4 reaches it in fewer updates beyond noise; contradicted: in more beyond
noise; else unresolved at this power.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxrlhf.experiments.claims.analysis import Finding, Verdict
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings, planned_run
from jaxrlhf.experiments.claims.samples_sooner import samples_arm, samples_sooner

NAME = "d-bound"
SEEDS = "600-623"
SIZE = "bed-m"  # d-pilot's choice (results/claims/d-pilot/claim.json "chosen")
EVAL_EVERY = 4
SAMPLES = (2, 4)
# (d)'s comparisons, in its order, named without the target's value.
COMPARISONS = ("updates to the target: K4 − K2", "learner seconds to the target: K4 − K2",
               "KL at the target: K4 − K2")  # fmt: skip

RULE = {
    "measure": "updates (and the learner's seconds) until test accuracy first reaches the "
    "target (the lower of the two arms' mean final validation accuracies), and the KL there; "
    "K4 − K2, paired by seed",
    "rule": "samples_sooner_bound",
    "params": {
        "size": SIZE,
        "evaluations": f"test and validation every {EVAL_EVERY} updates",
        "never reached": "the run's updates plus one evaluation interval, and its whole time",
        "supported": "K = 4 reaches the target in fewer updates, beyond noise",
        "contradicted": "K = 4 reaches it in more updates, beyond noise",
        "otherwise": "unresolved at this power",
        "beyond noise": "Holm's procedure over the family at level 0.05",
    },
    "families": {"(d)": list(COMPARISONS)},
}


def plan_bound(settings: Settings, out: Path):
    """(d)'s two arms on `SIZE`, each seed's arms together (module docstring)."""
    return [
        planned_run(
            out,
            NAME,
            f"K{k}",
            seed,
            settings,
            {"model.path": SIZE, **samples_arm(k)},
            {"samples_per_prompt": k},
        )  # fmt: skip
        for seed in settings.seeds
        for k in SAMPLES
    ]


def samples_sooner_bound(arms, settings: Settings) -> tuple[list[Finding], Verdict]:
    """(d)'s rule (module docstring), its comparisons under their registered names."""
    findings, verdict = samples_sooner(arms, settings)
    renamed = [
        dataclasses.replace(f, name=name)
        for f, name in zip(findings, COMPARISONS[: len(findings)], strict=True)
    ]
    if findings:  # (d)'s detail names the target: keep it
        target = findings[0].name.removeprefix("updates to ").split(" test")[0]
        verdict = Verdict(verdict.word, f"target {target} test; {verdict.detail}")
    return renamed, verdict


SPEC = ClaimSpec(
    name=NAME,
    title="(d) training-bound: K = 4 samples per prompt reach a target sooner than K = 2 "
    f"({SIZE}, evaluated every {EVAL_EVERY} updates)",
    paper="K = 4 reaches the target about 2.5x sooner, at a higher KL",
    plan=plan_bound,
    rule=samples_sooner_bound,
    registration=RULE,
    defaults={"seeds": SEEDS, "eval_every": EVAL_EVERY},
)

"""(d) training-bound, K = 4 samples per prompt reach a target sooner than K = 2: K in {2, 4};
the updates and learner seconds to a target test accuracy chosen on validation, and the KL
there."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from jaxrlhf.experiments.claims.analysis import Finding, Verdict, family, interval, matched_seeds
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings, planned_run
from jaxrlhf.experiments.stats import compare


def samples_arm(k: int) -> dict[str, Any]:
    """(d)'s arm: one step off, K = `k` samples per prompt (the learner trains on each prompt's
    best and worst)."""
    return {"sync_every": 1, "num_mini_batches": 0, "max_staleness": 1,
            "rollout.samples_per_prompt": k}  # fmt: skip


def plan_samples(settings: Settings, out: Path):
    return [
        planned_run(out, "d", f"K{k}", seed, settings, samples_arm(k), {"samples_per_prompt": k})
        for seed in settings.seeds
        for k in settings.samples
    ]


def first_reach(figures: dict[str, Any], target: float, split: str = "test") -> dict | None:
    """The first evaluation point of a run's curve at or above `target` points, or None."""
    for point in figures["curve"]:
        if point.get(split) is not None and point[split] * 100 >= target:
            return point
    return None


def samples_sooner(arms, settings: Settings) -> tuple[list[Finding], Verdict]:
    """(d) K = 4 against K = 2 samples per prompt: updates and the learner's seconds (the
    loop's time per update, evaluations left out: `compute.run_curve`) to a target test
    accuracy, and the KL there. The target is chosen on validation: the lower of the two arms'
    mean final validation accuracies. A seed that never reaches it counts the run's length plus
    one evaluation interval, and its whole time (an optimistic bound for it). Supported: K = 4
    reaches it in fewer updates, beyond noise; contradicted: in more, beyond noise."""
    a, b = "K2", "K4"
    if not arms.get(a) or not arms.get(b):
        return [], Verdict("unresolved at this power", "no finished runs")
    target = min(sum(f["validation"] for f in arms[k].values()) / len(arms[k]) for k in (a, b))
    never = settings.steps + settings.eval_every

    def updates(f):
        point = first_reach(f, target)
        return point["step"] if point is not None else never

    def seconds(f):
        point = first_reach(f, target)
        return point["seconds"] if point is not None else f["curve"][-1]["seconds"]

    def kl(f):
        point = first_reach(f, target)
        return point["kl"] if point is not None and point.get("kl") is not None else math.nan

    seeds = matched_seeds(arms, (a, b))
    steps = compare([updates(arms[b][s]) - updates(arms[a][s]) for s in seeds])
    kls = [kl(arms[b][s]) - kl(arms[a][s]) for s in seeds]
    findings = family([Finding(f"updates to {target:.1f}% test: K4 − K2", steps),
                       Finding("learner seconds to the target: K4 − K2",
                               compare([seconds(arms[b][s]) - seconds(arms[a][s])
                                        for s in seeds])),
                       Finding("KL at the target: K4 − K2",
                               compare([x for x in kls if math.isfinite(x)]))])  # fmt: skip
    detail = f"{findings[0].name}: {interval(steps)}"
    if findings[0].beyond_noise:
        word = "supported" if steps.high < 0 else "contradicted"
        return findings, Verdict(word, detail)
    return findings, Verdict("unresolved at this power", detail)


SPEC = ClaimSpec(
    name="d",
    title="(d), first run, on `bed`, evaluated every 16 updates: training-bound, K = 4 samples per "
    "prompt reach a target sooner than K = 2",
    rerun_by="d-bound",
    paper="K = 4 reaches the target about 2.5x sooner, at a higher KL",
    plan=plan_samples,
    rule=samples_sooner,
)

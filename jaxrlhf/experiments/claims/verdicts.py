"""A claim's record from its runs: per-arm rows, then its own part (`ClaimSpec`): the family of
paired comparisons its verdict rule makes (corrected by Holm's procedure) and the verdict they
give, or its analysis (the pilot's spread, the tuning's choices). Each claim's rule is in its
module (`claim_registry`); `analyse(claim, runs, settings)` returns the claim's record."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxrlhf.experiments.claims import claim_registry
from jaxrlhf.experiments.claims.analysis import Verdict, arm_rows, by_arm, starts
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.runner import PlannedRun


def analyse(claim: str, runs: Sequence[PlannedRun], settings: Settings) -> dict[str, Any]:
    """The claim's record: per-arm rows, its family of comparisons, its verdict (or its
    analysis: for the pilot, the spread and the seeds it implies). Until every planned run has
    finished the verdict is "part-run": a claim's seeds are fixed before it runs, and judging it
    at each look as seeds come in would make "beyond noise" more likely than its 5% by chance
    alone."""
    spec = claim_registry.claim(claim)
    arms = by_arm(runs)
    planned: dict[str, int] = {}
    for run in runs:
        planned[run.labels["arm"]] = planned.get(run.labels["arm"], 0) + 1
    record: dict[str, Any] = {"claim": claim, "rows": arm_rows(arms, planned),
                              "starts": starts(arms)}  # fmt: skip
    if spec.analysis is not None:
        return record | spec.analysis(arms, runs, settings)
    findings, verdict = spec.rule(arms, settings)
    finished = sum(len(seeds) for seeds in arms.values())
    if finished < len(runs):  # the seeds were fixed before the runs: no verdict on a part
        verdict = Verdict("part-run", f"{finished} of {len(runs)} runs finished; the verdict "
                          "waits for all of them")  # fmt: skip
    record["comparisons"] = [f.as_dict() for f in findings]
    record["family_size"] = len(findings)
    record["verdict"] = verdict.as_dict()
    return record

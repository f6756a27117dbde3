"""Claim e-parts: (e) in the paper's own two parts, pre-registered (`RULE`, `registration`).

The paper says that, generation-bound, more updates per batch speed learning up, at a cost in
final performance. (e)'s first rule called a final deficit "contradicted", which reads the
claim's second half as a refutation of its first. Here each part has its own measure and
verdict, on (e)'s arms and workload (`updates_per_batch`: 1, 2 and 4 updates per batch, the
engine taking 16 samples at a time) with evaluations every 4 updates, on seeds apart from every
other claim's (`SEEDS`: 20, from the power calculation on (e)'s records, where U4 − U1 needed
about 19):

- the speed-up: generation rounds (batches generated: updates / U) until test accuracy first
  reaches a target chosen on validation (the lowest of the arms' mean final validation
  accuracies); a run that never reaches it counts its rounds plus one evaluation interval.
  Supported: some U > 1 needs fewer rounds beyond noise and none needs more beyond noise;
  contradicted: one needs more beyond noise.
- the cost: final test accuracy after the same 64 updates, each U − 1. Supported (a cost): some
  U > 1 ends lower beyond noise; contradicted: one ends higher beyond noise and none lower.

Each part is its own family of two comparisons (U2 − U1, U4 − U1), corrected by Holm's
procedure within it.
"""

from __future__ import annotations

from pathlib import Path

from jaxrlhf.experiments.claims.analysis import Finding, Verdict, family, interval, paired
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.claims.samples_sooner import first_reach
from jaxrlhf.experiments.claims.updates_per_batch import plan_updates
from jaxrlhf.experiments.stats import compare

NAME = "e-parts"
SEEDS = "300-319"
EVAL_EVERY = 4
UPDATES = (2, 4)  # each against 1

RULE = {
    "measure": "speed-up: generation rounds (updates / U) until test accuracy first reaches "
    "the target (the lowest arm mean of final validation accuracy); cost: final test accuracy "
    "after 64 updates (points); each U − U1, paired by seed",
    "rule": "speedup_and_cost",
    "params": {
        "never reached": "the run's rounds plus one evaluation interval",
        "speed-up supported": "some U > 1 fewer rounds beyond noise, none more beyond noise",
        "speed-up contradicted": "some U > 1 more rounds beyond noise",
        "cost supported": "some U > 1 lower final accuracy beyond noise",
        "cost contradicted": "some U > 1 higher beyond noise and none lower",
        "beyond noise": "Holm's procedure within each part's family at level 0.05",
    },
    "families": {
        "speed-up": [f"rounds to the target: U{u} − U1" for u in UPDATES],
        "cost": [f"final test: U{u} − U1" for u in UPDATES],
    },
}


def plan_parts(settings: Settings, out: Path):
    """(e)'s arms and workload, into this claim's folder."""
    return plan_updates(settings, out, claim=NAME)


def rounds_to(figures, target: float, u: int, settings: Settings) -> float:
    """Generation rounds until the run's test accuracy first reaches `target` points."""
    point = first_reach(figures, target)
    updates = point["step"] if point is not None else settings.steps + settings.eval_every
    return updates / u


def _part(findings: list[Finding], better_is_lower: bool) -> str:
    """ "supported", "contradicted" or "unresolved at this power" for one part (module
    docstring): `better_is_lower` for rounds (fewer is the claim), else for final accuracy
    (lower is the claimed cost)."""
    claimed = [f for f in findings if f.beyond_noise and f.comparison.high < 0]
    against = [f for f in findings if f.beyond_noise and f.comparison.low > 0]
    if better_is_lower:
        return "contradicted" if against else "supported" if claimed else "unresolved at this power"
    return "supported" if claimed else "contradicted" if against else "unresolved at this power"


def speedup_and_cost(arms, settings: Settings) -> tuple[list[Finding], Verdict]:
    """Both parts of (e) (module docstring), each its own Holm family; the verdict names each."""
    present = [u for u in UPDATES if arms.get(f"U{u}")]
    if not arms.get("U1") or not present:
        return [], Verdict("unresolved at this power", "no finished runs")
    names = ["U1", *(f"U{u}" for u in present)]
    target = min(sum(f["validation"] for f in arms[a].values()) / len(arms[a]) for a in names)
    speed = family([
        Finding(f"rounds to the target: U{u} − U1", compare([
            rounds_to(arms[f"U{u}"][s], target, u, settings)
            - rounds_to(arms["U1"][s], target, 1, settings)
            for s in sorted(set(arms[f"U{u}"]) & set(arms["U1"]))
        ]))
        for u in present
    ])  # fmt: skip
    cost = family([Finding(f"final test: U{u} − U1", paired(arms, f"U{u}", "U1"))
                   for u in present])  # fmt: skip
    word = (f"speed-up: {_part(speed, better_is_lower=True)}; "
            f"cost: {_part(cost, better_is_lower=False)}")  # fmt: skip
    detail = f"target {target:.1f}% test; " + "; ".join(
        f"{f.name}: {interval(f.comparison)}" for f in [*speed, *cost]
    )
    return [*speed, *cost], Verdict(word, detail)


SPEC = ClaimSpec(
    name=NAME,
    title="(e) in two parts: generation-bound, more updates per batch learn sooner, at a cost",
    paper="more updates per batch speed learning up, at a cost in final performance",
    plan=plan_parts,
    rule=speedup_and_cost,
    registration=RULE,
    defaults={"seeds": SEEDS, "eval_every": EVAL_EVERY},
)

"""(e) generation-bound, several updates per batch help: 1, 2 and 4 updates per batch on a bed
made generation-bound (`GENERATION_BOUND`); test accuracy, each U − 1."""

from __future__ import annotations

from pathlib import Path

from jaxrlhf.experiments.claims.analysis import Finding, Verdict, family, interval, paired
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings, planned_run

# The bed made generation-bound: the engine takes each rollout call's samples 16 at a time
# (GenerateRequest.max_running; the evaluations keep the whole engine), so a batch's
# generation takes longer than even 4 updates on it. Measured over 16 updates of U4, seed 0
# (results/claims/e-workload/, at ca2b6c9 with the overrides in each run.log): 16 at a time,
# 2.4 s a batch against 1.0 s of learner time for 4 updates; 8 at a time, 4.3 s (a run of
# 64 updates: 64 x 4.3 s = 4.6 min of batches); one at a time, the first plan, slower still.
# A call's deadline counts that (the default, 30 s + rows x max_tokens / 50, does not).
GENERATION_BOUND = {"rollout.max_running": 16, "generator.generate_timeout_s": 600.0}


def plan_updates(settings: Settings, out: Path, claim: str = "e"):
    """Each seed's arms together; `claim`: the folder the runs go to."""
    return [
        planned_run(
            out,
            claim,
            f"U{u}",
            seed,
            settings,
            {
                "sync_every": 1,
                "num_mini_batches": 0,
                "max_staleness": 1,
                "train.updates_per_batch": u,
                **GENERATION_BOUND,
            },
            {"updates_per_batch": u},
        )  # fmt: skip
        for seed in settings.seeds
        for u in settings.updates
    ]


def updates_help(arms, settings: Settings) -> tuple[list[Finding], Verdict]:
    """(e) U updates per batch against 1, generation-bound, at the same batches: test accuracy
    (U − 1). Supported: some U > 1 is better, beyond noise, and none worse; contradicted:
    one is worse, beyond noise."""
    findings = family([Finding(f"U{u} − U1", paired(arms, f"U{u}", "U1"))
                       for u in settings.updates if u > 1])  # fmt: skip
    if not findings:
        return findings, Verdict("unresolved at this power", "no finished runs")
    detail = "; ".join(f"{f.name}: {interval(f.comparison)}" for f in findings)
    if any(f.beyond_noise and f.comparison.high < 0 for f in findings):
        return findings, Verdict("contradicted", detail)
    if any(f.beyond_noise and f.comparison.low > 0 for f in findings):
        return findings, Verdict("supported", detail)
    return findings, Verdict("unresolved at this power", detail)


SPEC = ClaimSpec(
    name="e",
    title="(e), first run, one verdict on final accuracy: generation-bound, several updates per "
    "batch help",
    rerun_by="e-parts",
    paper="more updates per batch speed learning up, at a cost in final performance",
    plan=plan_updates,
    rule=updates_help,
)

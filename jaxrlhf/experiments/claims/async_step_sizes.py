"""Claim a-steps: (a) at three step sizes, pre-registered (`RULE`, `registration`).

Does asynchronous RLHF stay as good as synchronous as the optimizer's step grows? The earlier
(a) ran at one learning rate, 1.5e-5, chosen on validation after a first pilot at 1e-4 in
which one-step-off lost to sync (−11.9 points on test, −12.2 on validation, 3 seeds). Here the
bed's default run (Online DPO, 64 updates of 64 prompts x 8 samples) runs sync, one-step-off
and continuous (in-flight swaps at the same bound) at each of `STEP_SIZES`, on seeds apart
from every earlier claim's (`SEEDS`), each seed's arms one after another.

The rule, fixed before the runs (`as_good_per_step_size`): one family per step size, its two
comparisons (one-step-off − sync, continuous − sync, final test accuracy, paired by seed)
corrected by Holm's procedure; a step size's verdict is (a)'s rule with its 2-point margin
(`async_as_good.async_as_good`). Reported beside each, not judged: each async arm's wall-time
speed-up over sync (sync's wall seconds over the arm's, per seed: geometric mean and 95% t
interval of the logs) and the KL from the start model each arm's final policy reached on its
own samples of held-out prompts (`eval.kl_prompts`).

Online DPO has no importance ratio, so the corrections (`loss_params.is_correction`) do not
apply to it: whether a correction buys back what staleness costs is a question for a ratio
loss, asked by its own claim once (b)'s tuning has chosen that loss's settings.
"""

from __future__ import annotations

import math
from pathlib import Path

from jaxrlhf.experiments.claims.analysis import MARGIN, Finding, Verdict, interval
from jaxrlhf.experiments.claims.async_as_good import ASYNC_ARMS, async_as_good
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings, planned_run
from jaxrlhf.experiments.stats import compare

STEP_SIZES = (1.5e-5, 4.5e-5, 1e-4)
SEEDS = "200-209"
ASYNC = ("one-step-off", "continuous")


def arm_of(lr: float, mode: str) -> str:
    return f"lr{lr:g}/{mode}"


RULE = {
    "measure": "final greedy accuracy on the whole test split (points); each async arm − sync "
    "of the same seed and step size",
    "rule": "as_good_per_step_size",
    "params": {
        "margin_points": MARGIN,
        "supported": "both 95% intervals of a family lie above −margin",
        "contradicted": "an interval lies wholly below −margin and Holm calls it beyond noise",
        "otherwise": "unresolved at this power",
        "reported, not judged": [
            "wall-time speed-up over sync: sync's wall seconds / the arm's, per seed; "
            "geometric mean and 95% t interval of the logs",
            "KL to the start model: the final policy's on its own samples of 256 validation "
            "prompts (summary.json policy_kl_end, configs/bed.py eval.kl_prompts), mean over "
            "seeds, per arm",
        ],
    },
    "families": {
        f"lr{lr:g}": [f"{arm_of(lr, mode)} − {arm_of(lr, 'sync')}" for mode in ASYNC]
        for lr in STEP_SIZES
    },
}


def plan_step_sizes(settings: Settings, out: Path):
    """Each seed's arms one after another (step size, then mode), so that partial results pair."""
    return [
        planned_run(
            out,
            "a-steps",
            arm_of(lr, mode),
            seed,
            settings,
            {"sync_every": 1, "num_mini_batches": 0, "train.learning_rate": lr, **ASYNC_ARMS[mode]},
            {"step_size": lr, "mode": mode},
        )  # fmt: skip
        for seed in settings.seeds
        for lr in STEP_SIZES
        for mode in ASYNC_ARMS
    ]


def speedup(arms, arm: str, sync: str) -> str:
    """Sync's wall seconds over `arm`'s, per seed: the geometric mean and its 95% interval."""
    seeds = sorted(set(arms.get(arm, {})) & set(arms.get(sync, {})))
    logs = [math.log(arms[sync][s]["wall_seconds"] / arms[arm][s]["wall_seconds"])
            for s in seeds
            if arms[sync][s].get("wall_seconds") and arms[arm][s].get("wall_seconds")]  # fmt: skip
    if len(logs) < 2:
        return "speed-up -"
    c = compare(logs)
    return f"speed-up {math.exp(c.mean):.2f}x [{math.exp(c.low):.2f}, {math.exp(c.high):.2f}]"


def policy_kls(arms, arm: str, sync: str) -> str:
    """Each arm's mean final policy KL from the start model (held-out samples), "-" without."""

    def mean(name: str) -> str:
        values = [f["policy_kl"] for f in arms.get(name, {}).values()
                  if f.get("policy_kl") is not None and math.isfinite(f["policy_kl"])]  # fmt: skip
        return f"{sum(values) / len(values):.3f}" if values else "-"

    return f"KL {mean(arm)} (sync {mean(sync)})"


def as_good_per_step_size(arms, settings: Settings) -> tuple[list[Finding], Verdict]:
    """Per step size, (a)'s own rule (`async_as_good`) on that step size's arms, a family of
    its own (module docstring); the verdict names each step size's."""
    findings: list[Finding] = []
    verdicts, details = [], []
    for lr in STEP_SIZES:
        sync = arm_of(lr, "sync")
        if sync not in arms:
            continue
        own = {mode: arms[arm_of(lr, mode)] for mode in ASYNC_ARMS if arm_of(lr, mode) in arms}
        named, verdict = async_as_good(own, settings)
        for finding in named:
            mode = finding.name.split(" − ")[0]
            finding.name = f"{arm_of(lr, mode)} − {sync}"
            details.append(f"{finding.name}: {interval(finding.comparison)}, "
                           f"{speedup(arms, arm_of(lr, mode), sync)}, "
                           f"{policy_kls(arms, arm_of(lr, mode), sync)}")  # fmt: skip
        findings += named
        verdicts.append(f"lr {lr:g}: {verdict.word}")
    if not findings:
        return findings, Verdict("unresolved at this power", "no finished runs")
    return findings, Verdict("; ".join(verdicts), "; ".join(details))


SPEC = ClaimSpec(
    name="a-steps",
    title="(a) at three step sizes: is asynchronous RLHF as good as synchronous as the step grows",
    paper="matched at the paper's settings (No Robots, Llama 3.1 8B; GSM8k)",
    plan=plan_step_sizes,
    rule=as_good_per_step_size,
    registration=RULE,
    defaults={"seeds": SEEDS},
)

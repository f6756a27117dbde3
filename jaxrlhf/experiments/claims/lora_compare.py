"""Claim lora-compare: LoRA at its own learning rate ends within noise of full fine-tuning on
test; pre-registered (`RULE`, `registration`).

Both arms run the bed's default recipe (`configs/bed.py`: Online DPO, one step off-policy, 64
updates of 64 prompts x 8 samples), each at the learning rate claim lora-tuning chose for it on
validation (`CHOSEN`, checked against lora-tuning's record by a test), on seeds apart from every
other claim's (`SEEDS`), the test split on:

- `full`: every parameter trained, publishing the whole policy (drain swaps);
- `lora`: rank `lora_tuning.RANK` adapters on the seven linear layers of each block, each
  publish the adapter alone to a generator in LoRA mode (`generator.swap_mode="lora"`).

The rule, fixed before the runs (`lora_as_good`), is (a)'s equivalence rule for one comparison:
LoRA − full on final test accuracy, paired by seed. Supported: its 95% interval lies above
−`MARGIN` points; contradicted: it lies wholly below −`MARGIN` points, beyond noise; else
unresolved at this power. A difference beyond noise inside the margin is named in the detail.
Ten seeds: the bed's paired spread of two arms of one recipe is 1.2-1.3 points (claim (a)'s
records), so ten give a 95% interval of about ±0.9 points.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments.claims.analysis import MARGIN, Finding, Verdict, family, interval, paired
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.lora_tuning import ARMS
from jaxrlhf.experiments.claims.plans import Settings, planned_run
from jaxrlhf.experiments.runner import PlannedRun

NAME = "lora-compare"
SEEDS = "510-519"
# lora-tuning's choices on validation (results/claims/lora-tuning/claim.json "chosen"; LoRA's
# at the top of its grid, so its best rate may lie above it).
CHOSEN = {"full": 1.5e-5, "lora": 4.5e-4}
COMPARISON = "lora − full"


def compare_rule(chosen: dict[str, float]) -> dict[str, Any]:
    """The registered rule of a comparison at the rates `chosen` (module docstring)."""
    return {
        "measure": "final greedy accuracy on the whole test split (points); lora − full, paired "
        "by seed",
        "rule": "lora_as_good",
        "params": {
            "learning rates": chosen,
            "margin": MARGIN,
            "supported": f"the 95% interval lies above −{MARGIN:g} points",
            "contradicted": f"the 95% interval lies wholly below −{MARGIN:g} points, beyond noise",
            "otherwise": "unresolved at this power",
        },
        "families": {"LoRA against full fine-tuning": [COMPARISON]},
    }


RULE = compare_rule(CHOSEN)


def plan_compare(settings: Settings, out: Path, name: str = NAME,
                 chosen: dict[str, float | None] = CHOSEN,
                 common: dict[str, Any] | None = None) -> list[PlannedRun]:  # fmt: skip
    """Each seed's two arms, each at its chosen rate (module docstring), with `common`'s
    overrides in every run."""
    if None in chosen.values():
        raise ValueError(f"{name}: set its chosen rates from its tuning's record first")
    return [
        planned_run(out, name, kind, seed, settings,
                    {"train.learning_rate": chosen[kind], **ARMS[kind], **(common or {})},
                    {"kind": kind})
        for seed in settings.seeds
        for kind in ARMS
    ]  # fmt: skip


def lora_as_good(arms, settings: Settings) -> tuple[list[Finding], Verdict]:
    """LoRA − full against the margin (module docstring)."""
    if not arms.get("lora") or not arms.get("full"):
        return [], Verdict("unresolved at this power", "no finished runs")
    findings: Sequence[Finding] = family([Finding(COMPARISON, paired(arms, "lora", "full"))])
    c = findings[0].comparison
    detail = f"{COMPARISON}: {interval(c)}"
    if findings[0].beyond_noise and -MARGIN <= c.high < 0:
        detail += f" (lower beyond noise, inside the {MARGIN:g}-point margin)"
    if findings[0].beyond_noise and c.high < -MARGIN:
        return list(findings), Verdict("contradicted", detail)
    if c.low > -MARGIN and c.seeds >= 2:
        return list(findings), Verdict("supported", detail)
    return list(findings), Verdict("unresolved at this power", detail)


SPEC = ClaimSpec(
    name=NAME,
    title="LoRA (rank 8) at its own learning rate is as good as full fine-tuning",
    paper="LoRA matches full fine-tuning in RL at about 10x its learning rate (LoRA without "
    "regret, 2025)",
    plan=plan_compare,
    rule=lora_as_good,
    table_row=False,  # not a claim of the paper's: BENCHMARKS' LoRA section reports it
    registration=RULE,
    defaults={"seeds": SEEDS},
)

"""Claim lora-smollm2-compare: LoRA at its own learning rate ends within noise of full
fine-tuning on test, on SmolLM2's default task; pre-registered (`RULE`).

lora-compare on `configs/default.py` (SmolLM2-135M-Instruct, Online DPO one step off-policy,
8 updates of 8 prompts x 4 samples): both arms (`lora_tuning.ARMS`: full fine-tuning publishing
the whole policy; rank 8 on the seven linear layers of each block, each publish the adapter
alone to a generator in LoRA mode) at the rates claim lora-smollm2-tuning chose on validation
(`CHOSEN`, checked against its record by a test), on seeds apart from every other claim's
(`SEEDS`), greedy accuracy on the whole test split (`task.num_test=0`: the default config
reports 256 of its 832 additions), judged by lora-compare's rule (`lora_as_good`: LoRA − full,
paired by seed, against the 2-point margin).
"""

from __future__ import annotations

from pathlib import Path

from jaxrlhf.experiments.claims import lora_compare
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.lora_compare import compare_rule, lora_as_good, plan_compare
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.runner import PlannedRun

NAME = "lora-smollm2-compare"
SEEDS = "720-729"
# lora-smollm2-tuning's choices on validation (its claim.json "chosen"; LoRA's at the top of its
# grid, 100x full fine-tuning's).
CHOSEN: dict[str, float | None] = {"full": 1e-5, "lora": 1e-3}
COMMON = {"task.num_test": 0, "model.path": "smollm2"}
RULE = compare_rule(CHOSEN)


def plan_smollm2_compare(settings: Settings, out: Path) -> list[PlannedRun]:
    """lora-compare's plan at this claim's rates, on the default task (module docstring)."""
    return plan_compare(settings, out, NAME, CHOSEN, COMMON)


SPEC = ClaimSpec(
    name=NAME,
    title="LoRA (rank 8) at its own learning rate is as good as full fine-tuning, on SmolLM2's "
    "default task",
    paper=lora_compare.SPEC.paper,
    plan=plan_smollm2_compare,
    rule=lora_as_good,
    table_row=False,  # not a claim of the paper's: BENCHMARKS' LoRA section reports it
    registration=RULE,
    defaults={"seeds": SEEDS, "steps": 8, "eval_every": 8},
    config="default.py",
)

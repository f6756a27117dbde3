"""Claim lora-smollm2-tuning: lora-tuning's choice of learning rates on SmolLM2's default task
(`configs/default.py`: SmolLM2-135M-Instruct, Online DPO one step off-policy, 8 updates of 8
prompts x 4 samples, full fine-tuning at 1e-5), before LoRA and full fine-tuning are compared
there on test; pre-registered (`RULE`).

The LoRA issue asks for the comparison on the bed (claims lora-tuning, lora-compare) and on
SmolLM2's default task. Each arm runs over a grid of learning rates (`GRID`: full fine-tuning's
around the default, LoRA's 10x, 30x and 100x it, the bed having chosen 30x), on seeds apart from
every other claim's (`SEEDS`), with the test split off; every evaluation takes the whole
validation split (`COMMON`: the default config evaluates 128 of its prompts), and the runs name
their model (`model.path`), so that the report labels their start "smollm2". The arms
(`lora_tuning.ARMS`: rank 8 on the seven linear layers of each block, each publish the adapter
alone to a generator in LoRA mode) and the rule (`best_on_validation`: per arm, the rate with
the highest mean final validation accuracy; a tie to the smaller rate; a choice at the edge of
its grid said so) are lora-tuning's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.lora_tuning import lora_tuning_record, plan_lora_tuning, rule_for
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.runner import PlannedRun

NAME = "lora-smollm2-tuning"
SEEDS = "710-711"
GRID = {"full": (3e-6, 1e-5, 3e-5), "lora": (1e-4, 3e-4, 1e-3)}
COMMON = {"task.num_eval": 0, "model.path": "smollm2"}
RULE = rule_for(GRID)


def plan_smollm2_tuning(settings: Settings, out: Path) -> list[PlannedRun]:
    """lora-tuning's plan over this claim's grid (module docstring)."""
    return plan_lora_tuning(settings, out, NAME, GRID, COMMON)


def smollm2_tuning_record(arms, runs: Sequence[PlannedRun], settings: Settings) -> dict[str, Any]:
    """lora-tuning's choice over this claim's grid."""
    return lora_tuning_record(arms, runs, settings, GRID)


SPEC = ClaimSpec(
    name=NAME,
    title="LoRA tuning on SmolLM2's default task: the learning rates of LoRA (rank 8) and of "
    "full fine-tuning, on validation",
    paper="LoRA matches full fine-tuning in RL at about 10x its learning rate (LoRA without "
    "regret, 2025)",
    plan=plan_smollm2_tuning,
    analysis=smollm2_tuning_record,
    table_row=False,
    registration=RULE,
    defaults={"seeds": SEEDS, "steps": 8, "eval_every": 8},
    config="default.py",
)

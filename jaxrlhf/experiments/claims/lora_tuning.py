"""Claim lora-tuning: the learning rate of a LoRA run and of full fine-tuning on the bed, each
chosen on validation before their comparison runs; pre-registered (`RULE`, `registration`).

The comparison the LoRA issue asks for (LoRA at its own learning rate ends within noise of full
fine-tuning on test) needs each arm at its own best step size: LoRA's is about 10 times full
fine-tuning's in published RL results ("LoRA without regret", 2025), and the bed's default
(1.5e-5) was chosen for full fine-tuning alone. Each arm runs the bed's default recipe
(`configs/bed.py`: Online DPO, one step off-policy, 64 updates of 64 prompts x 8 samples) over
a grid of learning rates (`GRID`), on seeds apart from every other claim's (`SEEDS`), with the
test split off:

- `full`: every parameter trained, publishing the whole policy (drain swaps);
- `lora`: rank `RANK` adapters on the seven linear layers of each block (alpha 2 x rank),
  each publish the adapter alone to a generator in LoRA mode (`generator.swap_mode="lora"`).

The rule, fixed before the runs (`best_on_validation`): per arm, the learning rate with the
highest mean final validation accuracy over the seeds; a tie goes to the smaller rate. A rate
at the edge of its grid is reported as such (the best may lie beyond it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments.claims.analysis import Verdict
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings, planned_run
from jaxrlhf.experiments.runner import PlannedRun
from jaxrlhf.experiments.stats import mean_stderr

NAME = "lora-tuning"
SEEDS = "500-501"
RANK = 8
GRID = {"full": (5e-6, 1.5e-5, 4.5e-5), "lora": (5e-5, 1.5e-4, 4.5e-4)}
ARMS = {
    "full": {},
    "lora": {"model.lora.rank": RANK, "generator.swap_mode": "lora"},
}


def rule_for(grid: dict[str, tuple[float, ...]]) -> dict[str, Any]:
    """The registered rule of a tuning over `grid` (module docstring)."""
    return {
        "measure": "final greedy accuracy on the whole validation split (points), mean over seeds",
        "rule": "best_on_validation",
        "params": {"tie": "the smaller learning rate",
                   "grid": {k: list(v) for k, v in grid.items()}, "rank": RANK,
                   "edge": "a choice at the edge of its grid is reported as such"},
        "families": {},  # a choice, not a test: no comparison is corrected
    }  # fmt: skip


RULE = rule_for(GRID)


def arm_name(kind: str, lr: float) -> str:
    return f"{kind}/lr{lr:g}"


def best_on_validation(arms, runs: Sequence[PlannedRun], grid=GRID) -> dict[str, Any]:
    """{kind: the chosen learning rate, its arm and its validation mean ± s.e.} (module
    docstring); a kind with unfinished runs chooses nothing yet."""
    planned: dict[str, int] = {}
    for run in runs:
        planned[run.labels["arm"]] = planned.get(run.labels["arm"], 0) + 1
    chosen = {}
    for kind in dict.fromkeys(run.labels["kind"] for run in runs):
        candidates = []
        for lr in grid[kind]:
            arm = arm_name(kind, lr)
            if arm not in planned:
                continue
            seeds = arms.get(arm, {})
            if len(seeds) < planned[arm]:
                break
            values = [f["validation"] for f in seeds.values() if math.isfinite(f["validation"])]
            mean, stderr = mean_stderr(values)
            candidates.append(((-mean, lr), arm, lr, mean, stderr))
        else:
            if not candidates:
                continue
            _, arm, lr, mean, stderr = min(candidates)
            edge = lr in (grid[kind][0], grid[kind][-1])
            chosen[kind] = {"arm": arm, "learning_rate": lr, "validation": mean,
                            "validation_stderr": stderr, "grid_edge": edge}  # fmt: skip
    return chosen


def plan_lora_tuning(settings: Settings, out: Path, name: str = NAME, grid=GRID,
                     common: dict[str, Any] | None = None) -> list[PlannedRun]:  # fmt: skip
    """Each seed's grid, arm by arm, test split off (module docstring), with `common`'s
    overrides in every run."""
    return [
        planned_run(
            out,
            name,
            arm_name(kind, lr),
            seed,
            settings,
            {
                "eval.test": False,
                "eval.test_every": 0,
                "train.learning_rate": lr,
                **ARMS[kind],
                **(common or {}),
            },
            {"kind": kind},
        )  # fmt: skip
        for seed in settings.seeds
        for kind in ARMS
        for lr in grid[kind]
    ]


def lora_tuning_record(arms, runs: Sequence[PlannedRun], settings: Settings,
                       grid=GRID) -> dict[str, Any]:  # fmt: skip
    """The learning rate chosen per arm (`best_on_validation`)."""
    chosen = best_on_validation(arms, runs, grid)
    kinds = list(dict.fromkeys(run.labels["kind"] for run in runs))
    detail = "; ".join(f"{kind}: lr {c['learning_rate']:g} ({c['validation']:.1f} ± "
                       f"{c['validation_stderr']:.1f} on validation"
                       f"{', at the edge of its grid' if c['grid_edge'] else ''})"
                       for kind, c in chosen.items())  # fmt: skip
    word = "tuned" if len(chosen) == len(kinds) else "part-run"
    return {"chosen": chosen, "comparisons": [], "family_size": 0,
            "verdict": Verdict(word, detail or "no arm finished").as_dict()}  # fmt: skip


SPEC = ClaimSpec(
    name=NAME,
    title="LoRA tuning: the learning rates of LoRA (rank 8) and of full fine-tuning, on validation",
    paper="LoRA matches full fine-tuning in RL at about 10x its learning rate (LoRA without "
    "regret, 2025)",
    plan=plan_lora_tuning,
    analysis=lora_tuning_record,
    table_row=False,
    registration=RULE,
    defaults={"seeds": SEEDS},
)

"""What the claims' plans share: the settings, and a run of an arm (each claim's module plans
its arms, seeds and overrides of `configs/bed.py`, or of its own `ClaimSpec.config`).

A run is a plain `python -m jaxrlhf.main --config=configs/bed.py` (the test bed's default
workload: Online DPO, one step off, `jaxrlhf.models.bed`; or the claim's config) with the
overrides of its arm, in
`{out}/{claim}/{arm}/seed{S}/`. A seed fixes the prompts, the generation seeds (batch
generation) and nothing else that differs between arms, so two arms of one seed are paired.
Continuous generation runs unseeded (`jaxrlhf.rl.continuous`): there a seed fixes the prompts.

Every run ends with a greedy evaluation of the whole test split (the figure reported) and of
the validation split (the one any choice is made on). Claims that compare curves evaluate both
every `eval_every` updates too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments.offpolicy import variants
from jaxrlhf.experiments.runner import PlannedRun

# The ratio losses' off-policy corrections (loss_params.is_correction).
CORRECTIONS = ("none", "truncate", "mask", "sequence_mask")


def corrected_variants(losses: Sequence[str], corrections: Sequence[str]) -> list[str]:
    """The corrected rows of `offpolicy.variants` ("grpo+mask": π_old recomputed on the learner,
    then the correction), each ratio loss's led by its control "grpo+none": recomputed on the
    learner with no correction. A correction also re-anchors π_old (and so the clip), so
    "grpo+mask − grpo" measures both; "grpo+mask − grpo+none" the correction alone."""
    out: list[str] = []
    for variant in variants(losses, corrections):
        loss, plus, _ = variant.partition("+")
        if plus:
            out += [f"{loss}+none", variant]
    return list(dict.fromkeys(out))


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a claim's command line chose: seeds, updates per run and evaluations, and the
    claim's own axes (each claim reads the ones it has)."""

    seeds: tuple[int, ...]
    steps: int = 64
    eval_every: int = 16
    losses: tuple[str, ...] = ("online_dpo", "ppo", "rloo", "grpo")
    mini_batches: tuple[int, ...] = (1, 4, 16, 64)
    corrections: tuple[str, ...] = CORRECTIONS
    correction_mini_batches: tuple[int, ...] = (16,)
    sizes: tuple[str, ...] = ("bed", "bed-m", "bed-l")
    size_mini_batches: tuple[int, ...] = (1, 16, 64)
    samples: tuple[int, ...] = (2, 4)
    updates: tuple[int, ...] = (1, 2, 4)
    mixed_loss: str = "grpo"
    passthrough: tuple[tuple[str, Any], ...] = ()


def planned_run(out: Path, claim: str, arm: str, seed: int, settings: Settings,
                overrides: dict[str, Any], labels: dict[str, Any]) -> PlannedRun:  # fmt: skip
    """Seed `seed` of `arm`, in `{out}/{claim}/{arm}/seed{S}/`: the bed with every evaluation
    on (test and validation, at the end and every `eval_every` updates), then the arm's
    overrides, then the command line's pass-throughs."""
    folder = out / claim / arm / f"seed{seed}"
    every = settings.eval_every
    base = {
        "output_dir": str(folder),
        "seed": seed,
        "total_steps": settings.steps,
        "checkpoint.every": settings.steps,
        "export": False,
        "eval.at_end": True,
        "eval.test": True,
        "eval.every": every,
        "eval.test_every": every,
        "train.log_samples_returned": False,  # most of a record's bytes; records are committed
    }
    return PlannedRun({"arm": arm, "seed": seed, **labels}, folder,
                      {**base, **overrides, **dict(settings.passthrough)})  # fmt: skip

"""The runs of each claim: which arms, which seeds, which overrides of `configs/bed.py`.

A run is a plain `python -m jaxrlhf.main --config=configs/bed.py` (the test bed's default
workload: Online DPO, one step off, `jaxrlhf.models.bed`) with the overrides of its arm, in
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

from jaxrlhf.experiments.claims import tuning
from jaxrlhf.experiments.offpolicy import variant_overrides, variants
from jaxrlhf.experiments.runner import CONTINUOUS_OVERRIDES, PlannedRun

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


def _run(out: Path, claim: str, arm: str, seed: int, settings: Settings,
         overrides: dict[str, Any], labels: dict[str, Any]) -> PlannedRun:  # fmt: skip
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


# --- (a) async ≈ sync ----------------------------------------------------------------------------

# arm -> overrides: the paper's synchronous and one-step-off modes, and continuous generation
# with in-flight swaps at the same bound.
ASYNC_ARMS = {
    "sync": {"max_staleness": 0},
    "one-step-off": {"max_staleness": 1},
    "continuous": {"max_staleness": 1, **CONTINUOUS_OVERRIDES},
}


def plan_async(settings: Settings, out: Path, arms: Sequence[str] = tuple(ASYNC_ARMS)):
    """Each seed's arms one after another, so that partial results pair."""
    return [
        _run(
            out,
            "a",
            arm,
            seed,
            settings,
            {"sync_every": 1, "num_mini_batches": 0, **ASYNC_ARMS[arm]},
            {},
        )  # fmt: skip
        for seed in settings.seeds
        for arm in arms
    ]


def plan_pilot(settings: Settings, out: Path):
    """The pilot of (a): sync and one-step-off, whose paired spread sizes the seeds."""
    return plan_async(settings, out, ("sync", "one-step-off"))


# --- (b) off-policy robustness by loss ---------------------------------------------------------


def offpolicy_arm(variant: str, n: int) -> str:
    return f"{variant}/N{n}"


def loss_cells(settings: Settings) -> list[tuple[str, int]]:
    """(variant, N): every loss at every N; a ratio loss's corrections and their control at
    the N of `correction_mini_batches` (at N = 1 every correction is the identity,
    on-policy)."""
    cells = [(loss, n) for loss in settings.losses for n in settings.mini_batches]
    corrected = corrected_variants(settings.losses, settings.corrections)
    cells += [(v, n) for v in corrected for n in settings.correction_mini_batches]
    return cells


def plan_losses(settings: Settings, out: Path):
    return [
        _run(
            out,
            "b",
            offpolicy_arm(variant, n),
            seed,
            settings,
            {"num_mini_batches": n, **variant_overrides(variant)},
            {"variant": variant, "num_mini_batches": n},
        )  # fmt: skip
        for seed in settings.seeds
        for variant, n in loss_cells(settings)
    ]


# --- (c) a larger policy is more robust --------------------------------------------------------


def plan_sizes(settings: Settings, out: Path):
    return [
        _run(
            out,
            "c",
            f"{size}/N{n}",
            seed,
            settings,
            {"model.path": size, "num_mini_batches": n, "loss": "online_dpo"},
            {"size": size, "num_mini_batches": n},
        )  # fmt: skip
        for seed in settings.seeds
        for size in settings.sizes
        for n in settings.size_mini_batches
    ]


# --- (d) K = 4 vs 2 samples per prompt, training-bound ------------------------------------------


def plan_samples(settings: Settings, out: Path):
    return [
        _run(
            out,
            "d",
            f"K{k}",
            seed,
            settings,
            {
                "sync_every": 1,
                "num_mini_batches": 0,
                "max_staleness": 1,
                "rollout.samples_per_prompt": k,
            },
            {"samples_per_prompt": k},
        )  # fmt: skip
        for seed in settings.seeds
        for k in settings.samples
    ]


# --- (e) updates per batch, generation-bound ----------------------------------------------------

# The bed made generation-bound: the engine takes each rollout call's samples 16 at a time
# (GenerateRequest.max_running; the evaluations keep the whole engine), so a batch's
# generation takes longer than even 4 updates on it. Measured over 16 updates of U4, seed 0
# (results/claims/e-workload/, at ca2b6c9 with the overrides in each run.log): 16 at a time,
# 2.4 s a batch against 1.0 s of learner time for 4 updates; 8 at a time, 4.3 s (a run of
# 64 updates: 64 x 4.3 s = 4.6 min of batches); one at a time, the first plan, slower still.
# A call's deadline counts that (the default, 30 s + rows x max_tokens / 50, does not).
GENERATION_BOUND = {"rollout.max_running": 16, "generator.generate_timeout_s": 600.0}


def plan_updates(settings: Settings, out: Path):
    return [
        _run(
            out,
            "e",
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


# --- (f) samples that span a publish ------------------------------------------------------------


def mixed_variants(settings: Settings) -> list[str]:
    """A ratio loss plain, re-anchored (the control) and with each correction, and Online DPO
    beside it."""
    loss = settings.mixed_loss
    return ["online_dpo", loss, *corrected_variants([loss], settings.corrections)]


def plan_mixed(settings: Settings, out: Path, extra: dict[str, Any] | None = None):
    """Continuous generation with in-flight swaps on a workload that generation binds
    (`MIXED_WORKLOAD`, `extra` to try others): a sample's tail continues on the weights
    published meanwhile."""
    return [
        _run(
            out,
            "f",
            variant,
            seed,
            settings,
            {
                "sync_every": 1,
                "num_mini_batches": 0,
                "max_staleness": 1,
                **CONTINUOUS_OVERRIDES,
                **MIXED_WORKLOAD,
                **(extra or {}),
                **variant_overrides(variant),
            },
            {"variant": variant},
        )  # fmt: skip
        for seed in settings.seeds
        for variant in mixed_variants(settings)
    ]


# Generation-bound continuous generation on the bed, where ≥ 30% of samples span a publish.
# The bed's responses are at most 4 tokens, so a sample spans one only when a swap lands
# between its first and last token, while the engine is busy: the learner must finish its
# update before the batch's generation does. GRPO trains on every sample (Online DPO on two a
# prompt), so batches are small: 4 prompts x 8 samples (0.07 s of learner time an update
# against 0.18 s of generation), an engine that takes every sample in flight (1024 sequences),
# and a generator up to two versions ahead, never idle at a swap. Chosen on the share of
# mixed samples alone, one seed each (results/claims/f-workload.md): GRPO 60%, Online DPO 65%
# here; GRPO 27% at 8 prompts and 0.5-2% at 16-32, where its update outlasts generation.
MIXED_WORKLOAD = {
    "generator.max_num_seqs": 1024,
    "rollout.prompts_per_batch": 4,
    "max_staleness": 2,
}

# --- (b)'s tuning ------------------------------------------------------------------------------


def plan_tuning(settings: Settings, out: Path):
    """Each loss's grid points on its own on-policy arm, test split off (`tuning`)."""
    on_policy = {"num_mini_batches": 1, "rollout.prompts_per_batch": tuning.PROMPTS_PER_BATCH,
                 "eval.test": False, "eval.test_every": 0}  # fmt: skip
    return [
        _run(
            out,
            "b-tuning",
            arm,
            seed,
            settings,
            {**on_policy, **overrides},
            {"loss": overrides["loss"]},
        )  # fmt: skip
        for seed in settings.seeds
        for arm, overrides in tuning.grid(settings.losses)
    ]


PLANS = {
    "pilot": plan_pilot,
    "a": plan_async,
    "b": plan_losses,
    "c": plan_sizes,
    "d": plan_samples,
    "e": plan_updates,
    "f": plan_mixed,
    "b-tuning": plan_tuning,
}

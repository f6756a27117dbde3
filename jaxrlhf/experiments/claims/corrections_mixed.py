"""(f) ours: off-policy corrections on samples that span a publish (continuous generation,
in-flight swaps, generation-bound: `MIXED_WORKLOAD`): GRPO plain, re-anchored and with each
correction, and Online DPO; test accuracy, each − its base. Not a claim of the paper."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from jaxrlhf.experiments.claims.analysis import Finding, Verdict, family, interval, paired
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings, corrected_variants, planned_run
from jaxrlhf.experiments.offpolicy import variant_overrides
from jaxrlhf.experiments.runner import CONTINUOUS_OVERRIDES


def mixed_variants(settings: Settings) -> list[str]:
    """A ratio loss plain, re-anchored (the control) and with each correction, and Online DPO
    beside it."""
    loss = settings.mixed_loss
    return ["online_dpo", loss, *corrected_variants([loss], settings.corrections)]


def plan_mixed(settings: Settings, out: Path, extra: dict[str, Any] | None = None,
               claim: str = "f"):  # fmt: skip
    """Continuous generation with in-flight swaps on a workload that generation binds
    (`MIXED_WORKLOAD`, `extra` to try others): a sample's tail continues on the weights
    published meanwhile. `claim`: the folder the runs go to."""
    return [
        planned_run(
            out,
            claim,
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


def base_of(arm: str, loss: str, control: str) -> str:
    """What `arm` is compared with: the plain loss for the control and for an arm without a
    correction (Online DPO), the control for a corrected arm."""
    return loss if arm == control or "+" not in arm else control


def corrections_on_mixed(arms, settings: Settings) -> tuple[list[Finding], Verdict]:
    """(f) on samples that span a publish, test accuracy: re-anchoring π_old on the learner
    with no correction against the plain ratio loss ("grpo+none − grpo"), each correction
    against that control ("grpo+mask − grpo+none": the correction alone; against the plain
    loss while the control has no runs), and Online DPO against the plain loss. Not a claim
    of the paper: the verdict says which differ beyond noise, and whether ≥ 30% of samples
    mixed versions."""
    loss = settings.mixed_loss
    control = f"{loss}+none" if arms.get(f"{loss}+none") else loss

    findings = family([
        Finding(f"{arm} − {base_of(arm, loss, control)}",
                paired(arms, arm, base_of(arm, loss, control)))
        for arm in arms if arm != loss and arms.get(arm)
    ])  # fmt: skip
    mixed = [f["mixed_version_fraction"] for seeds in arms.values() for f in seeds.values()]
    share = sum(mixed) / len(mixed) if mixed else math.nan
    detail = (f"mixed-version samples {share:.0%} (bound 30%); "
              + "; ".join(f"{f.name}: {interval(f.comparison)}" for f in findings))  # fmt: skip
    if not findings or not share >= 0.3:
        return findings, Verdict("unresolved at this power", detail)
    beyond = [f.name for f in findings if f.beyond_noise]
    word = "differences beyond noise: " + (", ".join(beyond) if beyond else "none")
    return findings, Verdict(word, detail)


SPEC = ClaimSpec(
    name="f",
    title="(f), first run, its control arm and family set after its results: off-policy "
    "corrections on samples that span a publish (ours)",
    rerun_by="f-replicated",
    paper="not studied",
    plan=plan_mixed,
    rule=corrections_on_mixed,
)

"""The claims by name, in the claims table's order: adding a claim is its module (a `SPEC`:
`claim_spec.ClaimSpec`) and one line here. The command (`__main__`), the analysis
(`verdicts.analyse`) and the table read a claim's entry alone."""

from __future__ import annotations

from jaxrlhf.experiments.claims import (
    async_as_good,
    async_step_sizes,
    corrections_mixed,
    corrections_replicated,
    lora_compare,
    lora_smollm2,
    lora_smollm2_compare,
    lora_tuning,
    losses_robust,
    losses_rounds,
    pilot,
    samples_bound,
    samples_pilot,
    samples_sooner,
    sizes_robust,
    tuning,
    updates_per_batch,
    updates_two_parts,
)
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec

CLAIMS: tuple[ClaimSpec, ...] = (
    pilot.SPEC,  # sizes (a)'s seeds
    async_as_good.SPEC,  # (a)
    async_step_sizes.SPEC,  # a-steps: (a) at three step sizes, pre-registered
    losses_robust.SPEC,  # (b)
    losses_rounds.SPEC,  # b-rounds: (b) at the tuned settings over 4 rounds, pre-registered
    sizes_robust.SPEC,  # (c)
    samples_sooner.SPEC,  # (d)
    samples_pilot.SPEC,  # d-pilot: the size on which (d) is training-bound, pre-registered
    samples_bound.SPEC,  # d-bound: (d) on that size, evaluated every 4 updates, pre-registered
    updates_per_batch.SPEC,  # (e)
    updates_two_parts.SPEC,  # e-parts: (e)'s two parts, pre-registered
    corrections_mixed.SPEC,  # (f)
    corrections_replicated.SPEC,  # f-replicated: (f) on new seeds, pre-registered
    tuning.SPEC,  # b-tuning: (b)'s settings, pre-registered
    lora_tuning.SPEC,  # lora-tuning: LoRA's and full fine-tuning's rates, pre-registered
    lora_compare.SPEC,  # lora-compare: LoRA against full fine-tuning at those rates, on test
    lora_smollm2.SPEC,  # lora-smollm2-tuning: lora-tuning on SmolLM2's default task
    lora_smollm2_compare.SPEC,  # lora-smollm2-compare: lora-compare there, at its choices
)


def names() -> tuple[str, ...]:
    """Every claim's name, in order (what `--claim` takes)."""
    return tuple(spec.name for spec in CLAIMS)


def table() -> tuple[ClaimSpec, ...]:
    """The claims with a row in the claims table: the current ones in order, then those run
    again by another (`ClaimSpec.rerun_by`), in order."""
    rows = [spec for spec in CLAIMS if spec.table_row]
    return tuple([s for s in rows if s.rerun_by is None] + [s for s in rows if s.rerun_by])


def claim(name: str) -> ClaimSpec:
    """The registered claim called `name`; ValueError listing the known claims otherwise."""
    for spec in CLAIMS:
        if spec.name == name:
            return spec
    raise ValueError(f"unknown claim {name!r}; known claims: {', '.join(names())}")


def check(claims: tuple[ClaimSpec, ...]) -> None:
    """Raise ValueError if two claims share a name."""
    seen = [spec.name for spec in claims]
    doubled = sorted({name for name in seen if seen.count(name) > 1})
    if doubled:
        raise ValueError(f"claims registered twice: {', '.join(doubled)}")


check(CLAIMS)

"""(b) Online DPO is the loss most robust to off-policy data: Online DPO, PPO, RLOO and GRPO at
N in {1, 4, 16, 64} mini-batches a round (and each correction of the ratio losses, with its
control, at N = 16); the fall of test accuracy from N = 1, each loss's − Online DPO's, per N."""

from __future__ import annotations

from pathlib import Path

from jaxrlhf.experiments.claims.analysis import Finding, Verdict, fall_difference, family, interval
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings, corrected_variants, planned_run
from jaxrlhf.experiments.offpolicy import variant_overrides


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
        planned_run(
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


def losses_robust(arms, settings: Settings) -> tuple[list[Finding], Verdict]:
    """(b) per other loss L and N > 1: fall(L, N) − fall(Online DPO, N), the fall being the
    test accuracy at N = 1 minus at N (> 0: L falls more). One family over every loss and N;
    the corrected rows (their N = 1 is their loss's) form a second family, reported beside.
    Supported: at the largest N every other plain loss falls more, beyond noise;
    contradicted: one falls less, beyond noise."""
    others = [loss for loss in settings.losses if loss != "online_dpo"]
    larger = [n for n in settings.mini_batches if n > 1]
    dpo = lambda n: (offpolicy_arm("online_dpo", 1), offpolicy_arm("online_dpo", n))  # noqa: E731
    plain = family([
        Finding(f"{loss} − online_dpo, fall at N={n}",
                fall_difference(arms, (offpolicy_arm(loss, 1), offpolicy_arm(loss, n)), dpo(n)))
        for loss in others for n in larger
    ])  # fmt: skip
    corrected = family([
        Finding(f"{arm.split('/')[0]} − online_dpo, fall at N={n}",
                fall_difference(arms, (offpolicy_arm(arm.split("/")[0].split("+")[0], 1), arm),
                                dpo(n)))
        for arm in arms if "+" in arm for n in [int(arm.rsplit("N", 1)[1])]
    ])  # fmt: skip
    if not plain:
        return plain, Verdict("unresolved at this power", "no finished runs")
    top = max(larger)
    at_top = [f for f in plain if f.name.endswith(f"N={top}")]
    detail = "; ".join(f"{f.name}: {interval(f.comparison)}" for f in at_top)
    if any(f.beyond_noise and f.comparison.high < 0 for f in plain):
        return plain + corrected, Verdict("contradicted", detail)
    if at_top and all(f.beyond_noise and f.comparison.low > 0 for f in at_top):
        return plain + corrected, Verdict("supported", detail)
    return plain + corrected, Verdict("unresolved at this power", detail)


SPEC = ClaimSpec(
    name="b",
    title="(b), first run, every loss at Online DPO's lr 1.5e-5 and β 0.1, one generation round at "
    "N = 64: Online DPO is the loss most robust to off-policy data",
    rerun_by="b-rounds",
    paper="Online DPO still learns at N = 64; PPO and RLOO degrade (TLDR)",
    plan=plan_losses,
    rule=losses_robust,
)

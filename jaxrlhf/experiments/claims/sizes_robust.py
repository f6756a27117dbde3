"""(c) a larger policy is more robust to off-policy data: bed, bed-m and bed-l at N in
{1, 16, 64}, Online DPO; the fall of test accuracy from N = 1, smaller − larger, per N."""

from __future__ import annotations

from pathlib import Path

from jaxrlhf.experiments.claims.analysis import Finding, Verdict, fall_difference, family, interval
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings, planned_run


def plan_sizes(settings: Settings, out: Path):
    return [
        planned_run(
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


def sizes_robust(arms, settings: Settings) -> tuple[list[Finding], Verdict]:
    """(c) per pair of sizes (smaller, larger) and N > 1: fall(smaller) − fall(larger) (> 0:
    the larger is more robust). Supported: at the largest N the smallest falls more than the
    largest, beyond noise; contradicted: it falls less, beyond noise."""
    sizes, larger_n = settings.sizes, [n for n in settings.size_mini_batches if n > 1]
    arm = lambda size, n: f"{size}/N{n}"  # noqa: E731
    findings = family([
        Finding(f"{small} − {large}, fall at N={n}",
                fall_difference(arms, (arm(small, 1), arm(small, n)),
                                (arm(large, 1), arm(large, n))))
        for i, small in enumerate(sizes) for large in sizes[i + 1 :] for n in larger_n
    ])  # fmt: skip
    if not findings:
        return findings, Verdict("unresolved at this power", "no finished runs")
    key = f"{sizes[0]} − {sizes[-1]}, fall at N={max(larger_n)}"
    (main,) = [f for f in findings if f.name == key]
    detail = f"{main.name}: {interval(main.comparison)}"
    if main.beyond_noise and main.comparison.low > 0:
        return findings, Verdict("supported", detail)
    if main.beyond_noise and main.comparison.high < 0:
        return findings, Verdict("contradicted", detail)
    return findings, Verdict("unresolved at this power", detail)


SPEC = ClaimSpec(
    name="c",
    title="(c) A larger policy is more robust to off-policy data",
    paper="robustness grows with the policy's size (Pythia 410M to 2.8B, TLDR)",
    plan=plan_sizes,
    rule=sizes_robust,
)

"""The pilot of (a): sync and one-step-off (the runs of (a), in its folder); the paired spread
of one-step-off − sync, and the seeds a ±2-point interval needs. No verdict: it sizes (a)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments.claims.analysis import power_of
from jaxrlhf.experiments.claims.async_as_good import plan_async
from jaxrlhf.experiments.claims.claim_spec import Arms, ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.runner import PlannedRun


def plan_pilot(settings: Settings, out: Path):
    """The pilot of (a): sync and one-step-off, whose paired spread sizes the seeds."""
    return plan_async(settings, out, ("sync", "one-step-off"))


def pilot_power(arms: Arms, runs: Sequence[PlannedRun], settings: Settings) -> dict[str, Any]:
    """The spread of one-step-off − sync and the seeds it implies (`analysis.power_of`)."""
    return {"power": power_of(arms, "one-step-off", "sync")}


SPEC = ClaimSpec(
    name="pilot",
    title="Pilot: the spread of one-step-off − sync",
    plan=plan_pilot,
    analysis=pilot_power,
    table_row=False,  # the pilot is (a)'s
)

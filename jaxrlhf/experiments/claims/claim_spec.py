"""`ClaimSpec`: everything the claims' command keys by a claim's name, in one entry that the
claim's own module holds (its `SPEC`) and `claim_registry` lists, as `LossSpec` does for losses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments.claims.analysis import Finding, Verdict
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.runner import PlannedRun

# {arm: {seed: the run's figures}} (`analysis.by_arm`)
Arms = dict[str, dict[int, dict[str, Any]]]
Plan = Callable[[Settings, Path], list[PlannedRun]]
Rule = Callable[[Arms, Settings], tuple[list[Finding], Verdict]]
Analysis = Callable[[Arms, Sequence[PlannedRun], Settings], dict[str, Any]]
# The command line's settings a claim may default otherwise (`__main__.settings_of`).
SETTINGS_DEFAULTS = ("seeds", "steps", "eval_every")
REGISTRATION_KEYS = ("measure", "rule", "families")


@dataclasses.dataclass(frozen=True)
class ClaimSpec:
    """One claim of the claims' command.

    name: what `--claim` takes, and the folder its record is written to (`{out}/{name}/`).
    title: its heading (report, figure, claims table).
    plan(settings, out) -> its runs (`plans.planned_run`), each seed's arms together.
    rule(arms, settings) -> (findings, verdict): its family of paired comparisons (Holm) and the
        verdict they give; the record is judged "part-run" until every planned run finished
        (`verdicts.analyse`). A claim has a rule or an `analysis`, not both.
    analysis(arms, runs, settings) -> the record's own keys, for a claim that is no test (the
        pilot's spread, the tuning's choices).
    paper: what the paper reports for it ("-": nothing).
    table_row: whether it has a row in the claims table (`--report-only` without `--claim`),
        in the registry's order.
    registration: its pre-registration ("measure", "rule", "params", "families";
        `registration.build_plan`): it runs only from its committed plan.json. None: its plan
        is its code.
    defaults: its command line's defaults of `SETTINGS_DEFAULTS` where not the usual ones.
    config: the file in configs/ its runs start from (the test bed's, unless the claim is about
        another workload).
    rerun_by: the claim that runs this one again, pre-registered at fair settings: this row
        goes below every current row of the claims table, its title naming its own settings.
    """

    name: str
    title: str
    plan: Plan
    rule: Rule | None = None
    analysis: Analysis | None = None
    paper: str = "-"
    table_row: bool = True
    registration: Mapping[str, Any] | None = None
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    config: str = "bed.py"
    rerun_by: str | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.title:
            raise ValueError(f"ClaimSpec {self.name!r}: a name and a title are needed")
        if (self.rule is None) == (self.analysis is None):
            raise ValueError(f"ClaimSpec {self.name!r}: give a verdict rule or an analysis")
        unknown = set(self.defaults) - set(SETTINGS_DEFAULTS)
        if unknown:
            raise ValueError(f"ClaimSpec {self.name!r}: defaults of unknown settings "
                             f"{sorted(unknown)}; known: "
                             f"{', '.join(SETTINGS_DEFAULTS)}")  # fmt: skip
        if self.registration is not None and not set(REGISTRATION_KEYS) <= set(self.registration):
            raise ValueError(f"ClaimSpec {self.name!r}: a registration needs "
                             f"{', '.join(REGISTRATION_KEYS)}")  # fmt: skip

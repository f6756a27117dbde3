"""Pre-registration as code: a claim's plan, written and committed before its first run.

`python -m jaxrlhf.experiments.claims --claim X --seeds ... --write-plan` writes
`{out}/X/plan.json`: the claim, its seeds and settings, each arm's overrides, the measure, the
verdict rule (by name, with its parameters) and the comparison families Holm corrects within.
Commit it, then run: a claim whose folder holds no plan, or one that differs from what the
command would run, is refused before any run (`check_before_running`).

`--report-only` draws the verdict with the rule the plan names. The verdict is labelled
(`registration`):

- "pre-registered": the plan was committed before every record of the claim, and the runs read
  are the plan's (same arms, seeds and overrides), and the rule's comparisons are the plan's;
- "post hoc: WHY" otherwise (the plan changed after the first record, or was never committed,
  or the arms or comparisons differ). A post-hoc verdict is never the claim's verdict:
  `claims_table` shows it as such.

Which commit holds what is read from git (`git log` of the claim's folder); outside a git
checkout the plan is taken as committed only by the check before running.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments.runner import PlannedRun

PLAN = "plan.json"
FORMAT = 1
# Per-run keys that differ from run to run of one arm, not part of an arm's overrides.
RUN_KEYS = ("output_dir", "seed")
# A claim folder's files that are not run records.
NOT_RECORDS = (PLAN, "claim.json", "claim.png")


def build_plan(claim: str, settings, runs: Sequence[PlannedRun], rule: dict[str, Any]) -> dict:
    """The plan of `claim`'s `runs`: `rule` holds "measure", "rule" (name), "params" and
    "families" ({family: [comparison names]})."""
    arms: dict[str, dict[str, Any]] = {}
    for run in runs:
        overrides = {k: v for k, v in run.overrides.items() if k not in RUN_KEYS}
        arms.setdefault(run.labels["arm"], json.loads(json.dumps(overrides)))
    return {
        "format": FORMAT,
        "claim": claim,
        "seeds": list(settings.seeds),
        "settings": {
            "steps": settings.steps,
            "eval_every": settings.eval_every,
            "passthrough": dict(settings.passthrough),
        },  # fmt: skip
        "arms": arms,
        "measure": rule["measure"],
        "rule": {"name": rule["rule"], "params": rule.get("params", {})},
        "families": rule["families"],
    }


def read_plan(folder: Path) -> dict | None:
    try:
        plan = json.loads((folder / PLAN).read_text())
    except (OSError, ValueError):
        return None
    return plan if isinstance(plan, dict) and plan.get("format") == FORMAT else None


def write_plan(folder: Path, plan: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PLAN).write_text(json.dumps(plan, indent=2) + "\n")
    return folder / PLAN


def plan_differences(committed: dict, planned: dict) -> list[str]:
    """What differs between the committed plan and the one the command would run, one item a
    part ("seeds", "arm grpo/N16's overrides", ...)."""
    found = []
    for key in ("claim", "seeds", "settings", "measure", "rule", "families"):
        if committed.get(key) != planned.get(key):
            found.append(key)
    for arm in sorted(committed.get("arms", {}).keys() | planned["arms"].keys()):
        if committed.get("arms", {}).get(arm) != planned["arms"].get(arm):
            found.append(f"arm {arm}'s overrides")
    return found


def check_before_running(folder: Path, planned: dict, command: str) -> str | None:
    """None when `folder` holds the plan the command would run, else the one line that says
    what to do."""
    committed = read_plan(folder)
    if committed is None:
        return (f"{folder / PLAN}: no plan of this claim: write it with `{command} --write-plan`, "
                "commit it, then run (pre-registration: the plan precedes the runs)")  # fmt: skip
    changed = plan_differences(committed, planned)
    if changed:
        return (f"{folder / PLAN} differs from what this command would run "
                f"({', '.join(changed)}): run it as planned, or write a new plan for a new "
                "claim folder (--out)")  # fmt: skip
    return None


def registration(folder: Path, planned: dict, findings: Sequence[str]) -> str:
    """ "pre-registered" or "post hoc: WHY" (module docstring). `findings`: the comparison names
    the rule made."""
    committed = read_plan(folder)
    if committed is None:
        return "post hoc: no plan.json"
    changed = plan_differences(committed, planned)
    if changed:
        return f"post hoc: the runs differ from the plan ({', '.join(changed)})"
    named = {name for family in committed["families"].values() for name in family}
    extra = sorted(set(findings) - named)
    if extra:
        return f"post hoc: comparisons not in the plan ({'; '.join(extra)})"
    return _git_order(folder)


def _git(folder: Path, *args: str) -> list[str]:
    result = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True)
    return result.stdout.split() if result.returncode == 0 else []


def _git_order(folder: Path) -> str:
    """Whether the plan's last change was committed before the claim's first record."""
    if not _git(folder, "rev-parse", "--is-inside-work-tree"):
        return "pre-registered (not a git checkout: the plan was checked before the runs)"
    plan_commits = _git(folder, "log", "--format=%H", "--", PLAN)
    if not plan_commits:
        return "post hoc: plan.json was never committed"
    excluded = [f":(exclude){name}" for name in NOT_RECORDS]
    record_commits = _git(folder, "log", "--format=%H", "--", ".", *excluded)
    if not record_commits:
        return "pre-registered"
    first_record, last_plan = record_commits[-1], plan_commits[0]
    ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", first_record, last_plan],
                              cwd=folder, capture_output=True)  # fmt: skip
    if ancestor.returncode == 0:  # the plan changed with or after the first record
        return "post hoc: plan.json changed after the claim's first record"
    return "pre-registered"

"""Each claim's figures, paired comparisons and verdict, from its runs' records alone.

Accuracies are greedy accuracies on the whole test split after training (`summary.json`), in
points (percent). A comparison is paired by seed (`stats.compare_paired`): its mean ± s.e., its
95% t interval and the p of no difference. A claim's comparisons form one family: "beyond
noise" means that Holm's procedure over the family rejects no difference at level 0.05
(`stats.holm`); each verdict says how many comparisons its family made.

Verdicts (`Verdict`): `supported` or `contradicted` when the rule of the claim (in its
function's docstring) holds at that level, else `unresolved at this power`, with the interval
that would have had to be narrower.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from jaxrlhf.config.checks import resolve
from jaxrlhf.experiments import read_run
from jaxrlhf.experiments.claims.start_models import model_of
from jaxrlhf.experiments.compute import run_curve
from jaxrlhf.experiments.runner import PlannedRun
from jaxrlhf.experiments.stats import Comparison, compare, holm, mean_stderr

POINTS = 100.0
# "As good": the 95% interval of async − sync lies above −MARGIN points (non-inferiority).
MARGIN = 2.0


def sync_every(overrides: dict[str, Any]) -> int:
    """A claim run's publish interval, as the config resolves it from its overrides (the bed's
    config leaves both keys at their defaults)."""
    keys = {"num_mini_batches": 0, "sync_every": 1, "max_staleness": 0}
    config = ml_collections.ConfigDict({k: overrides.get(k, v) for k, v in keys.items()})
    return resolve(config).sync_every


def run_figures(run: PlannedRun, last: int = 5) -> dict[str, Any] | None:
    """One finished run's figures (None when it has not finished): test and validation accuracy
    before and after training (points), KL to the start model (mean `kl` of the last `last`
    steps), its evaluation curve (`compute.run_curve`: step, learner seconds, KL, accuracies),
    the learner's seconds, the share of samples that spanned a publish and the learner's idle
    share (means over its steps after the first)."""
    try:
        records, summary = read_run(run.folder)
    except FileNotFoundError:
        return None
    if summary.get("test_accuracy_end") is None and summary.get("eval_accuracy_end") is None:
        return None  # not finished (a tuning run evaluates validation alone)
    tail = records[-last:]
    later = records[1:] or records

    def mean_of(key: str, rows) -> float:
        values = [r[key] for r in rows if r.get(key) is not None]
        return float(statistics.fmean(values)) if values else math.nan

    def points(key: str) -> float:  # a missing or null figure is NaN; a real 0.0 stays 0.0
        value = summary.get(key)
        return math.nan if value is None else value * POINTS

    return {
        "test": points("test_accuracy_end"),
        "validation": points("eval_accuracy_end"),
        "test_start": points("test_accuracy_start"),
        "validation_start": points("eval_accuracy_start"),
        "model": model_of(run.overrides),
        "kl": mean_of("kl", tail),
        # The served policy's KL from the reference on its own samples of held-out prompts at
        # the end (`eval.kl_prompts`; NaN in runs without it).
        "policy_kl": summary.get("policy_kl_end", math.nan),
        "curve": run_curve(records, summary, sync_every(run.overrides)),
        "learner_seconds": sum(r["step_s"] for r in records),
        "wall_seconds": summary.get("wall_seconds"),
        "mixed_version_fraction": mean_of("mixed_version_fraction", later),
        "learner_idle_fraction": mean_of("learner_idle_fraction", later),
        "staleness_mean": mean_of("staleness_mean", records),
        # The defect checks (BENCHMARKS.md): each update's staleness after the first, and the
        # oldest token of the run.
        "staleness_later": [
            min(r["staleness_mean"] for r in later),
            max(r["staleness_mean"] for r in later),
        ],  # fmt: skip
        "token_staleness_max": max(
            (r.get("token_staleness_max", math.nan) for r in records), default=math.nan
        ),  # fmt: skip
        # Where an update's time goes (descriptive): means over the updates after the first
        # two, which carry the learner's compilation.
        "time": {key: mean_of(key, records[2:] or records) for key in TIME_KEYS},
    }


# metrics.jsonl keys of `run_figures`' "time": the loop's seconds per update, its wait for
# generation, the train step, the publish, and the generator's tokens/s and busy share.
TIME_KEYS = ("step_s", "wait_for_generation_s", "train_s", "weight_sync_s",
             "generation_tokens_per_s", "generator_occupancy")  # fmt: skip


def by_arm(runs: Sequence[PlannedRun]) -> dict[str, dict[int, dict[str, Any]]]:
    """{arm: {seed: figures}} of the finished runs (`run_figures`)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for run in runs:
        figures = run_figures(run)
        out.setdefault(run.labels["arm"], {})
        if figures is not None:
            out[run.labels["arm"]][run.labels["seed"]] = figures
    return out


def arm_rows(arms: dict[str, dict[int, dict[str, Any]]], planned: dict[str, int]) -> list[dict]:
    """Per arm: mean ± s.e. over its finished seeds of each figure, and how many of its
    planned runs finished."""
    rows = []
    for arm, seeds in arms.items():
        row: dict[str, Any] = {"arm": arm, "seeds": len(seeds), "planned": planned.get(arm, 0)}
        for key in (
            "test",
            "validation",
            "test_start",
            "kl",
            "policy_kl",
            "learner_seconds",
            "mixed_version_fraction",
            "learner_idle_fraction",
            "staleness_mean",
        ):
            values = [f[key] for f in seeds.values()
                      if f.get(key) is not None and math.isfinite(f[key])]  # fmt: skip
            row[key], row[f"{key}_stderr"] = mean_stderr(values)
        ranges = [f["staleness_later"] for f in seeds.values()]
        row["staleness_later"] = ([min(r[0] for r in ranges), max(r[1] for r in ranges)]
                                  if ranges else [math.nan, math.nan])  # fmt: skip
        row["token_staleness_max"] = max((f["token_staleness_max"] for f in seeds.values()),
                                         default=math.nan)  # fmt: skip
        row["time"] = {key: mean_stderr([f["time"][key] for f in seeds.values()
                                         if "time" in f and math.isfinite(f["time"][key])])[0]
                       for key in TIME_KEYS}  # fmt: skip
        row["wall_seconds"] = mean_stderr([f["wall_seconds"] for f in seeds.values()
                                           if f.get("wall_seconds")])[0]  # fmt: skip
        rows.append(row)
    return rows


@dataclasses.dataclass
class Finding:
    """One comparison of a claim's family, and whether Holm's procedure over the family
    calls it beyond noise."""

    name: str
    comparison: Comparison
    beyond_noise: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, **dataclasses.asdict(self.comparison),
                "beyond_noise": self.beyond_noise}  # fmt: skip


def family(findings: list[Finding]) -> list[Finding]:
    """Marks the findings Holm's procedure rejects (the family is the list)."""
    for finding, rejected in zip(findings, holm([f.comparison.p for f in findings]),
                                 strict=True):  # fmt: skip
        finding.beyond_noise = rejected
    return findings


def start_of(figures: dict[str, Any]) -> tuple:
    """The model a run started from: its name and its greedy accuracies before training (test,
    validation; points, to 0.01). Two machines' starts from one recipe differ (`start_models`)."""
    values = [figures.get(key, math.nan) for key in ("test_start", "validation_start")]
    return (figures.get("model", "bed"),
            *(round(v, 2) if math.isfinite(v) else None for v in values))  # fmt: skip


def matched_seeds(arms, keys: Sequence[str]) -> list[int]:
    """The seeds that every arm of `keys` finished, where the runs of each model among them
    started from the same model (`start_of`). Pairing by seed removes what a seed shares across
    arms; a seed whose arms ran on two machines would add the machines' difference instead, so
    it is left out (the comparison's seed count shows it)."""
    seeds = set.intersection(*(set(arms.get(k, {})) for k in keys)) if keys else set()

    def matched(seed: int) -> bool:
        starts: dict[str, set] = {}
        for key in keys:
            start = start_of(arms[key][seed])
            starts.setdefault(start[0], set()).add(start)
        return all(len(models) == 1 for models in starts.values())

    return sorted(s for s in seeds if matched(s))


def starts(arms) -> list[dict[str, Any]]:
    """Each start model of the finished runs (`start_of`) and how many runs it began."""
    counts = Counter(start_of(figures) for seeds in arms.values() for figures in seeds.values())
    return [{"model": m, "test_start": t, "validation_start": v, "runs": n}
            for (m, t, v), n in counts.items()]  # fmt: skip


def paired(arms, b: str, a: str, figure: Callable[[dict], float] = lambda f: f["test"]):
    """b − a of `figure` over the seeds both arms finished, from one start (`matched_seeds`)."""
    seeds = matched_seeds(arms, (a, b))
    return compare([figure(arms[b][s]) - figure(arms[a][s]) for s in seeds])


def fall_difference(arms, worse: tuple[str, str], better: tuple[str, str]) -> Comparison:
    """Per seed, the fall of `worse` (its on-policy arm's test accuracy minus its off-policy
    arm's) minus the fall of `better`: > 0 when `worse` falls more (`matched_seeds`)."""
    seeds = matched_seeds(arms, [*worse, *better])

    def fall(pair, s):
        return arms[pair[0]][s]["test"] - arms[pair[1]][s]["test"]

    return compare([fall(worse, s) - fall(better, s) for s in seeds])


@dataclasses.dataclass
class Verdict:
    word: str  # "supported", "contradicted", "unresolved at this power" (or "part-run")
    detail: str

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def interval(c: Comparison) -> str:
    return f"{c.mean:+.1f} [{c.low:+.1f}, {c.high:+.1f}], {c.seeds} seeds"


def power_of(arms, b: str, a: str) -> dict[str, Any]:
    """The pilot's figures: the seed-to-seed s.d. of the paired difference b − a and the seeds
    a 95% interval of half-width 2 points needs (`stats.seeds_for_half_width`)."""
    from jaxrlhf.experiments.stats import seeds_for_half_width

    c = paired(arms, b, a)
    spread = c.stderr * math.sqrt(c.seeds) if c.seeds >= 2 else math.nan
    needed = seeds_for_half_width(spread, MARGIN) if math.isfinite(spread) and spread > 0 else None
    return {"difference": dataclasses.asdict(c), "spread": spread, "half_width": MARGIN,
            "seeds_needed": needed}  # fmt: skip

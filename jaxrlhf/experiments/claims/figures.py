"""A claim's figure and tables, from its record (`verdicts.analyse`) and its runs' curves."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxrlhf.experiments import save_figure
from jaxrlhf.experiments.stats import format_mean_stderr, t_quantile

if TYPE_CHECKING:
    from jaxrlhf.experiments.claims.claim_spec import ClaimSpec


def half_width(stderr: float, seeds: int) -> float:
    """The 95% t interval's half-width of a mean of `seeds` values (0 when undefined)."""
    if seeds < 2 or not math.isfinite(stderr):
        return 0.0
    return t_quantile(0.975, seeds - 1) * stderr


def plot_claim(record: dict[str, Any], curves: dict[str, list[list[dict]]], path: Path,
               title: str) -> Path:  # fmt: skip
    """Three panels: each arm's test accuracy (mean, 95% interval); the claim's comparisons
    (mean, 95% interval, filled when beyond noise after Holm); test accuracy against KL from
    the start model at every evaluation (each arm's mean over seeds: the frontier)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.6), layout="constrained")
    left, middle, right = fig.subplots(1, 3, width_ratios=(1.2, 1.2, 1))
    rows = record["rows"]
    y = list(range(len(rows)))
    left.errorbar([r["test"] for r in rows], y, fmt="o", capsize=3,
                  xerr=[half_width(r["test_stderr"], r["seeds"]) for r in rows])  # fmt: skip
    left.set_yticks(y, [f"{r['arm']} ({r['seeds']})" for r in rows], fontsize="small")
    left.set_xlabel("test accuracy after training (%), mean ± 95% CI (seeds)")
    findings = record.get("comparisons", [])
    for i, f in enumerate(findings):
        middle.errorbar([f["mean"]], [i], xerr=[[f["mean"] - f["low"]], [f["high"] - f["mean"]]],
                        fmt="o", capsize=3, color="C3" if f["beyond_noise"] else "C0",
                        mfc=None if f["beyond_noise"] else "white")  # fmt: skip
    middle.axvline(0.0, color="gray", lw=1)
    middle.set_yticks(range(len(findings)), [f["name"] for f in findings], fontsize="x-small")
    middle.set_xlabel("paired difference (points), 95% CI; red: beyond noise (Holm)")
    for index, (arm, runs) in enumerate(curves.items()):
        points = _mean_curve(runs)
        right.plot([p[0] for p in points], [p[1] for p in points], "o-", ms=3,
                   color=f"C{index % 10}", label=arm)  # fmt: skip
    right.set_xlabel("batch KL from the start model (on the sampler's samples)")
    right.set_ylabel("test accuracy (%)")
    if curves:
        right.legend(fontsize="x-small")
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
    verdict = record.get("verdict", {}).get("word", "")
    fig.suptitle(f"{title}: {verdict}" if verdict else title)
    return save_figure(fig, path)


def _mean_curve(runs: Sequence[list[dict]]) -> list[tuple[float, float]]:
    """(mean KL, mean test accuracy in points) at each evaluation step the runs share."""
    steps = sorted({p["step"] for run in runs for p in run})
    out = []
    for step in steps:
        points = [p for run in runs for p in run if p["step"] == step
                  and p.get("kl") is not None and p.get("test") is not None]  # fmt: skip
        if points:
            out.append((sum(p["kl"] for p in points) / len(points),
                        100 * sum(p["test"] for p in points) / len(points)))  # fmt: skip
    return out


def markdown(record: dict[str, Any]) -> str:
    """The arms (test and validation accuracy, the two KLs, mixed-version share, learner idle
    share, seeds) and the comparisons (mean ± s.e., 95% interval, p, beyond noise). "batch KL":
    the loss's KL on the sampler's own samples (the last updates' mean); "policy KL": the final
    policy's KL from the start model on its own samples of held-out prompts (`eval.kl_prompts`;
    "-" for runs without it), which shows how far the learner moved."""
    lines = ["| arm | seeds | test % | validation % | batch KL | policy KL | mixed | learner idle "
             "| staleness, updates 2+ (min-max) | oldest token |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in record["rows"]:
        cells = [format_mean_stderr(r["test"], r["test_stderr"]),
                 format_mean_stderr(r["validation"], r["validation_stderr"]),
                 format_mean_stderr(r["kl"], r["kl_stderr"], digits=2),
                 format_mean_stderr(r.get("policy_kl", math.nan),
                                    r.get("policy_kl_stderr", math.nan), digits=3),
                 format_mean_stderr(r["mixed_version_fraction"], r["mixed_version_fraction_stderr"],
                                    digits=2),
                 format_mean_stderr(r["learner_idle_fraction"], r["learner_idle_fraction_stderr"],
                                    digits=2),
                 "{:.2f}-{:.2f}".format(*r.get("staleness_later", (math.nan, math.nan))),
                 f"{r.get('token_staleness_max', math.nan):g}"]  # fmt: skip
        lines.append(f"| {r['arm']} | {r['seeds']}/{r['planned']} | {' | '.join(cells)} |")
    lines += time_table(record["rows"])
    if record.get("starts"):
        models = ", ".join(f"{m['model']} {m['test_start']} / {m['validation_start']} "
                           f"({m['runs']} runs)" for m in record["starts"])  # fmt: skip
        lines += [
            "",
            f"Start models (test % / validation % before training): {models}. A seed "
            "is paired only where each model's runs in a comparison share their start.",
        ]
    findings = record.get("comparisons", [])
    if findings:
        lines += ["", f"{len(findings)} comparisons (Holm over each family):", "",
                  "| comparison | mean ± s.e. (points) | 95% CI | p | seeds | beyond noise |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for f in findings:
            lines.append(f"| {f['name']} | {format_mean_stderr(f['mean'], f['stderr'])} | "
                         f"[{f['low']:+.1f}, {f['high']:+.1f}] | {f['p']:.3g} | {f['seeds']} | "
                         f"{'yes' if f['beyond_noise'] else 'no'} |")  # fmt: skip
    if "verdict" in record:
        verdict = record["verdict"]
        lines += ["", f"Verdict: **{verdict['word']}** ({verdict['detail']})"]
        if verdict.get("registration"):
            lines += ["", f"Registration: {verdict['registration']}"]
    if "power" in record:
        p = record["power"]
        lines += ["", f"Paired spread (s.d. of one-step-off − sync over seeds): "
                  f"{p['spread']:.2f} points; seeds for a 95% interval of ±{p['half_width']:g} "
                  f"points: {p['seeds_needed']}"]  # fmt: skip
    return "\n".join(lines)


def time_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Where each arm's time goes, descriptive (no comparison): the run's wall seconds, then
    per update after the first two (means over seeds) the loop's seconds, its wait for
    generation, the train step and the publish, and the generator's tokens/s and busy share.
    Nothing for records without these figures."""
    if not any(math.isfinite(r.get("time", {}).get("step_s", math.nan)) for r in rows):
        return []
    lines = ["", "Where the time goes (descriptive; seconds per update after the first two, "
             "means over seeds):", "",
             "| arm | wall s | s/update | waits for generation | trains | publishes "
             "| generated tokens/s | generator busy |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        t = r.get("time", {})
        cells = [f"{r.get('wall_seconds', math.nan):.1f}",
                 *(f"{t.get(k, math.nan):.3f}" for k in
                   ("step_s", "wait_for_generation_s", "train_s", "weight_sync_s")),
                 f"{t.get('generation_tokens_per_s', math.nan):.0f}",
                 f"{t.get('generator_occupancy', math.nan):.2f}"]  # fmt: skip
        lines.append(f"| {r['arm']} | {' | '.join(cells)} |")
    return lines


def claims_table(rows: Sequence[tuple[ClaimSpec, dict[str, Any]]]) -> str:
    """The claims table, a row per (claim, its record): the paper's claim and figure, ours (the
    claim's headline comparison: mean, 95% interval, seeds) and the verdict."""
    lines = ["| claim | the paper's figure | ours (points: mean [95% CI], seeds) | verdict |",
             "|---|---|---|---|"]  # fmt: skip
    for spec, record in rows:
        findings = [f for f in record.get("comparisons", []) if f["seeds"] >= 2]
        ours = "; ".join(f"{f['name']}: {f['mean']:+.1f} [{f['low']:+.1f}, {f['high']:+.1f}], "
                         f"{f['seeds']}" for f in findings[:4])  # fmt: skip
        ours = ours or ("-" if "comparisons" not in record else "not yet two paired seeds")
        if len(findings) > 4:
            ours += f" (+{len(findings) - 4} more)"
        verdict = record.get("verdict", {}).get("word", "-")
        if verdict == "part-run":  # how far it is: "N of M runs finished"
            verdict += f" ({record['verdict']['detail'].split(';')[0]})"
        lines.append(f"| {spec.title} | {spec.paper} | {ours} | {verdict} |")
    return "\n".join(lines)

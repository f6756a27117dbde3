"""The paper's off-policyness test bed over seeds: final reward, test accuracy and KL against N.

    # the short CPU setting (see below): Online DPO and RLOO, N in {1, 4, 16}, 3 seeds
    python -m jaxrlhf.experiments.offpolicy --losses online_dpo,rloo --mini-batches 1,4,16 \
        --steps 16 --prompts-per-batch 4 --seeds 0,1,2
    # the paper's sweep: 3 losses x N in {1, 2, 4, 8, 16, 64}, 64 updates (accelerators)
    python -m jaxrlhf.experiments.offpolicy --mini-batches 1,2,4,8,16,64
    # a pipeline check on the tiny random model (no learning signal: rewards stay ~0)
    python -m jaxrlhf.experiments.offpolicy --model tiny --losses online_dpo,rloo \
        --mini-batches 1,2 --steps 2 --seeds 0 --out /tmp/offpolicy-tiny
    # the off-policy corrections under staleness: RLOO and GRPO with each, beside Online DPO
    python -m jaxrlhf.experiments.offpolicy --losses online_dpo,rloo,grpo \
        --corrections none,truncate,mask,sequence_mask --mini-batches 1,4,16 --steps 16 \
        --prompts-per-batch 4 --seeds 0,1,2
    # with continuous generation, in-flight swaps and 4 more versions of staleness, so that
    # generation overlaps training (in {out}/continuous/lag4/)
    python -m jaxrlhf.experiments.offpolicy --losses online_dpo,grpo,rloo \
        --corrections none,mask --mini-batches 4 --lag 4 --steps 16 --prompts-per-batch 4 \
        --seeds 0,1,2 --generation continuous
    # redraw the table and figure from the runs already in --out
    python -m jaxrlhf.experiments.offpolicy --report-only

For each loss (`--losses`, default online_dpo,ppo,rloo), each N (`--mini-batches`) and each
seed (`--seeds`, `config.seed`: the prompts, the generation seeds and the validation prompts)
and, for a loss with an importance ratio (ppo, rloo, grpo), each off-policy correction
(`--corrections`, default none; `loss_params.is_correction` on the learner's recompute,
`old_logprobs=learner`, with `truncated_is_cap=2.0` for truncate: a row "rloo+mask"), the RLHF
stage runs with `num_mini_batches=N` (N mini-batches generated with one policy, then N
updates, then the weights are published: `sync_every=N`, `max_staleness=N-1`), on the offline
default's model and task (`configs/default.py`; `configs/tiny.py` for `--model tiny`). Every run
takes `--steps` updates, a multiple of every N (by default their least common multiple). N = 1
is on-policy (synchronous). All runs share one generator service (`jaxrlhf.experiments.runner`);
each is a plain `python -m jaxrlhf.main` in `{out}/{loss}/N{N}/seed{S}/`.

`--generation continuous` generates as `rollout.continuous` does, with in-flight swaps that keep
the KV cache (`runner.CONTINUOUS_OVERRIDES`): every prompt is its own call, started as soon as
the staleness bound (on each sample's oldest token) allows. With this test bed's
`max_staleness=N-1` and `sync_every=N` the bound admits the next policy's batches only once its
weights are published, so generation does not overlap training and no sample spans a publish
(`mixed_version_fraction` 0, BENCHMARKS.md): the mode differs from batch generation only in its
scheduling and its unseeded samples. Overlap needs `max_staleness >= sync_every`, which the
`num_mini_batches` shorthand does not give: `--lag K` gives it (`sync_every=N`,
`max_staleness=N-1+K`, in `{out}[/continuous]/lag{K}/`), so the next K batches generate while
the current N train. Even then a sample spans a publish only if its generation is still running
when the weights arrive: on a training-bound workload (this one, on the 2-core CPU machine) the
generator finishes the admitted batches long before the next publish and waits at the bound, so
samples are older (up to N-1+K versions) but each is still of one version (BENCHMARKS.md). Its
runs, table and figure go to `{out}/continuous/` (the same layout), beside the batch-at-a-time
ones (`--generation batch`, the default), whose seeds fix the same prompts. Continuous
generation runs unseeded (`jaxrlhf.rl.continuous`), so a seed there fixes the prompts and the
validation prompts, not the samples: a difference between the two generations of one seed is
paired by prompts only.

Figures per run (`runner.run_figures`): final reward = mean `reward_mean` over the last `--last`
steps (task reward before the missing-EOS penalty, on batches sampled up to N − 1 versions
earlier); KL = mean `kl` over the same steps; greedy accuracy after training on the test split
(the figure to compare: fresh responses of the final weights; `summary.json`) and on the
validation split. Per (loss, N): mean ± standard error over the seeds. Outputs:
`{out}/results.json`, `{out}/offpolicy.png` (the three figures against N on a log2 axis, one
line per loss, error bars ± 1 s.e.) and a markdown table on stdout.

Runtimes on the 2-core CPU machine and the measured table are in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments import save_figure
from jaxrlhf.experiments.runner import (
    CONTINUOUS_OVERRIDES,
    PlannedRun,
    add_runner_arguments,
    common_overrides,
    parse_passthrough,
    parse_seeds,
    runner_from_args,
)
from jaxrlhf.experiments.stats import format_mean_stderr, mean_stderr, zero_if_nan

DEFAULT_LOSSES = ("online_dpo", "ppo", "rloo")
DEFAULT_MINI_BATCHES = (1, 2, 4, 8, 16, 64)
# --generation -> the runs' overrides (module docstring).
GENERATIONS = {"batch": {}, "continuous": CONTINUOUS_OVERRIDES}
# (figure, label, scale) of the table and the plot's panels.
FIGURES = (
    ("test_accuracy_end", "test accuracy after training (%)", 100.0),
    ("eval_accuracy_end", "validation accuracy after training (%)", 100.0),
    ("final_reward", "final reward (mean of last steps)", 1.0),
    ("final_kl", "KL to reference (mean of last steps)", 1.0),
)


def default_steps(mini_batches: Sequence[int]) -> int:
    """The fewest updates that every N divides (every run then ends right after a publish)."""
    return math.lcm(*mini_batches)


def check_steps(steps: int, mini_batches: Sequence[int]) -> None:
    bad = [n for n in mini_batches if n < 1 or steps % n]
    if bad:
        raise ValueError(
            f"--steps={steps} is not a multiple of N={bad}: every run takes the same number "
            f"of updates, N at a time (e.g. --steps={default_steps(mini_batches)})"
        )


def variants(losses: Sequence[str], corrections: Sequence[str]) -> list[str]:
    """The rows of the sweep: each loss with an importance ratio once per correction
    ("rloo+mask"; "rloo" for none), every other loss once."""
    from jaxrlhf.losses import LOSSES

    out = []
    for loss in losses:
        ratio = loss in LOSSES and LOSSES[loss].importance_ratio
        out += [
            loss if c == "none" else f"{loss}+{c}" for c in (corrections if ratio else ["none"])
        ]
    return list(dict.fromkeys(out))


def variant_overrides(variant: str) -> dict[str, Any]:
    """The config overrides of a row of `variants`."""
    loss, _, correction = variant.partition("+")
    overrides: dict[str, Any] = {"loss": loss}
    if correction:
        overrides |= {"loss_params.old_logprobs": "learner",
                      "loss_params.is_correction": correction}  # fmt: skip
        if correction == "truncate":
            overrides["loss_params.truncated_is_cap"] = 2.0
    return overrides


def run_dir(out: Path, loss: str, num_mini_batches: int, seed: int) -> Path:
    return Path(out) / loss / f"N{num_mini_batches}" / f"seed{seed}"


def aggregate(entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (loss, N): each figure's mean and standard error over the finished seeds."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for entry in entries:
        cells.setdefault((entry["loss"], entry["num_mini_batches"]), []).append(entry)
    rows = []
    for (loss, n), group in sorted(cells.items()):
        done = [e for e in group if e["status"] == "ok"]
        failed = sum(str(e["status"]).startswith("failed") for e in group)
        row: dict[str, Any] = {"loss": loss, "num_mini_batches": n, "seeds": len(done),
                               "failed": failed,
                               "missing": len(group) - len(done) - failed}  # fmt: skip
        for key, _, _ in FIGURES + (("test_accuracy_start", "", 1.0),):
            values = [e[key] for e in done if e.get(key) is not None]
            row[key], row[f"{key}_stderr"] = mean_stderr(values)
        row["staleness_max"] = max((e["staleness_max"] for e in done), default=None)
        minutes = [e["seconds"] / 60 for e in done if e.get("seconds")]
        row["minutes_per_run"] = sum(minutes) / len(minutes) if minutes else None
        rows.append(row)
    return rows


def markdown_table(rows: Sequence[dict[str, Any]], last: int) -> str:
    """One row per (loss, N): mean ± s.e. over seeds of each figure."""
    header = (
        f"| loss | N | seeds | test accuracy % | validation accuracy % | reward (last {last}) "
        f"| KL (last {last}) | staleness max | min/run |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [
            format_mean_stderr(row[key], row[f"{key}_stderr"], scale, 1 if scale > 1 else 3)
            for key, _, scale in FIGURES
        ]
        notes = [f"{row[k]} {k}" for k in ("failed", "missing") if row.get(k)]
        seeds = f"{row['seeds']}" + (f" ({', '.join(notes)})" if notes else "")
        minutes = "-" if row["minutes_per_run"] is None else f"{row['minutes_per_run']:.1f}"
        lines.append(f"| {row['loss']} | {row['num_mini_batches']} | {seeds} | "
                     f"{' | '.join(cells)} | {row['staleness_max']} | {minutes} |")  # fmt: skip
    return "\n".join(lines)


def panel_rows(losses: Sequence[str]) -> list[list[str]]:
    """The figure's rows of panels: one per loss run with corrections, its rows ("rloo",
    "rloo+mask", ...) beside the losses run without (Online DPO: the reference); one row
    when no loss has a correction."""
    bases = sorted({loss.partition("+")[0] for loss in losses if "+" in loss})
    if not bases:
        return [sorted(losses)]
    plain = [loss for loss in losses if "+" not in loss and loss not in bases]
    return [sorted(plain + [x for x in losses if x.partition("+")[0] == base]) for base in bases]


def plot_results(
    rows: Sequence[dict[str, Any]],
    path: str | Path,
    steps: int,
    generation: str = "batch",
    lag: int = 0,
) -> Path:
    """PNG: each figure against N (log2 axis), one line per loss, error bars ± 1 s.e.; the
    test accuracy before training as a dashed line. A row of panels per loss with corrections
    (`panel_rows`); a correction has one colour in every row."""
    from matplotlib.figure import Figure

    done = [r for r in rows if r["seeds"]]
    if not done:
        raise ValueError("no finished run to plot")
    losses = sorted({r["loss"] for r in done})
    bases = {loss.partition("+")[0] for loss in losses if "+" in loss}
    corrections = sorted({x.partition("+")[2] for x in losses if x.partition("+")[0] in bases})
    others = [loss for loss in losses if loss.partition("+")[0] not in bases]
    colour = {loss: f"C{corrections.index(loss.partition('+')[2])}"
              for loss in losses if loss.partition("+")[0] in bases}  # fmt: skip
    colour |= {loss: f"C{(len(corrections) + i) % 10}" for i, loss in enumerate(others)}
    groups = panel_rows(losses)
    fig = Figure(figsize=(4.5 * len(FIGURES), 4.0 * len(groups)), layout="constrained")
    grid = fig.subplots(len(groups), len(FIGURES), squeeze=False)
    ticks = sorted({r["num_mini_batches"] for r in done})
    panels = [(ax, figure, group) for axes, group in zip(grid, groups, strict=True)
              for ax, figure in zip(axes, FIGURES, strict=True)]  # fmt: skip
    for ax, (key, label, scale), group in panels:
        for loss in group:
            points = [r for r in done if r["loss"] == loss and math.isfinite(r[key])]
            if points:
                ax.errorbar(
                    [r["num_mini_batches"] for r in points],
                    [r[key] * scale for r in points],
                    yerr=[zero_if_nan(r[f"{key}_stderr"]) * scale for r in points],
                    fmt="o-", capsize=3, label=loss, color=colour[loss],
                )  # fmt: skip
        if key == "test_accuracy_end":
            starts = [r["test_accuracy_start"] for r in done]
            starts = [value for value in starts if math.isfinite(value)]
            if starts:
                ax.axhline(starts[0] * scale, color="gray", ls="--", lw=1, label="before training")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("N (mini-batches per policy)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    seeds = sorted({r["seeds"] for r in done})
    how = ", continuous generation" if generation == "continuous" else ""
    how += f", max_staleness N - 1 + {lag}" if lag else ""
    fig.suptitle(f"Off-policy RLHF{how}: {steps} updates per run, mean ± s.e. over "
                 f"{'/'.join(map(str, seeds))} seeds")  # fmt: skip
    return save_figure(fig, path)


def run_overrides(args, loss: str, num_mini_batches: int, seed: int, folder: Path):
    overrides = common_overrides(args, folder, args.steps)
    overrides |= {**variant_overrides(loss), "num_mini_batches": num_mini_batches, "seed": seed}
    if args.lag:  # N versions per publish as before, K more of staleness allowed
        overrides |= {"num_mini_batches": 0, "sync_every": num_mini_batches,
                      "max_staleness": num_mini_batches - 1 + args.lag}  # fmt: skip
    overrides |= GENERATIONS[args.generation]
    for flag, key in (
        ("prompts_per_batch", "rollout.prompts_per_batch"),
        ("samples_per_prompt", "rollout.samples_per_prompt"),
        ("learning_rate", "train.learning_rate"),
    ):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    return {**overrides, **args.passthrough}


def results_folder(args, out: Path) -> Path:
    """Where a --generation's and a --lag's runs, table and figure go: beside the others."""
    folder = out / "continuous" if args.generation == "continuous" else out
    return folder / f"lag{args.lag}" if args.lag else folder


def plan(args, out: Path) -> list[PlannedRun]:
    out = results_folder(args, out)
    runs = []
    for loss in args.losses:
        for n in args.mini_batches:
            for seed in args.seeds:
                folder = run_dir(out, loss, n, seed)
                labels = {"loss": loss, "num_mini_batches": n, "seed": seed}
                runs.append(PlannedRun(labels, folder, run_overrides(args, loss, n, seed, folder)))
    return runs


def _parse_args(argv: Sequence[str] | None):
    parser = argparse.ArgumentParser(
        prog="python -m jaxrlhf.experiments.offpolicy", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--losses", default=",".join(DEFAULT_LOSSES))
    parser.add_argument("--corrections", default="none", help="off-policy corrections of the "
                        "losses with an importance ratio: none, truncate, mask, "
                        "sequence_mask")  # fmt: skip
    parser.add_argument("--mini-batches", default=",".join(map(str, DEFAULT_MINI_BATCHES)))
    parser.add_argument("--steps", type=int, help="updates per run (default: lcm of the N values)")
    parser.add_argument("--prompts-per-batch", type=int)
    parser.add_argument("--samples-per-prompt", type=int)
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--generation", choices=list(GENERATIONS), default="batch",
                        help="batch at a time (drain swaps), or continuous with in-flight "
                        "swaps in {out}/continuous/ (module docstring)")  # fmt: skip
    parser.add_argument("--lag", type=int, default=0, help="K: max_staleness = N - 1 + K with "
                        "sync_every = N, in {out}[/continuous]/lag{K}/ (module "
                        "docstring)")  # fmt: skip
    parser.add_argument("--out", default="runs/offpolicy")
    add_runner_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    args.passthrough = parse_passthrough(parser, extra)
    from jaxrlhf.losses import CORRECTIONS

    corrections = [c.strip() for c in args.corrections.split(",") if c.strip()]
    unknown = sorted(set(corrections) - set(CORRECTIONS))
    if unknown:
        parser.error(f"--corrections: unknown {unknown}; known: {', '.join(CORRECTIONS)}")
    args.corrections = corrections
    args.losses = variants([n.strip() for n in args.losses.split(",") if n.strip()], corrections)
    args.mini_batches = sorted({int(n) for n in args.mini_batches.split(",") if n.strip()})
    args.seeds = parse_seeds(args.seeds)
    if args.lag < 0:
        parser.error(f"--lag={args.lag}: must be >= 0 (extra versions of staleness)")
    args.steps = args.steps or default_steps(args.mini_batches)
    try:
        check_steps(args.steps, args.mini_batches)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    runner, out = runner_from_args(args, "offpolicy")
    settings = {key: getattr(args, key) for key in (
        "losses", "corrections", "mini_batches", "seeds", "model", "steps", "prompts_per_batch",
        "samples_per_prompt", "learning_rate", "last", "generation", "lag",
        "passthrough")}  # fmt: skip
    folder = results_folder(args, out)
    folder.mkdir(parents=True, exist_ok=True)

    def write(entries):
        results = {"settings": settings, "cells": aggregate(entries), "runs": entries}
        (folder / "results.json").write_text(json.dumps(results, indent=2))

    entries = runner.run_all(plan(args, out), args.last, write)
    rows = aggregate(entries)
    if args.lag:
        print(f"lag {args.lag}: sync_every = N, max_staleness = N - 1 + {args.lag}")
    print(markdown_table(rows, args.last))
    if any(row["seeds"] for row in rows):
        figure = plot_results(rows, folder / "offpolicy.png", args.steps, args.generation,
                              args.lag)  # fmt: skip
        print(f"figure: {figure}")
    print(f"results: {folder / 'results.json'}")


if __name__ == "__main__":
    main()

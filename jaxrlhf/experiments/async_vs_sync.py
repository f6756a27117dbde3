"""Is one-step-off asynchronous RLHF as good as synchronous? Paired over seeds, on held-out splits.

    python -m jaxrlhf.experiments.async_vs_sync                  # the offline default, 3 seeds
    python -m jaxrlhf.experiments.async_vs_sync --vary train.learning_rate=3e-6,1e-5
    python -m jaxrlhf.experiments.async_vs_sync --model tiny --steps 2 --eval-every 1 \
        --seeds 0 --out /tmp/avs-tiny                            # a pipeline check
    python -m jaxrlhf.experiments.async_vs_sync --async-mode continuous  # continuous vs sync
    python -m jaxrlhf.experiments.async_vs_sync --report-only    # redraw from --out

For each variant (`--vary KEY=V1,V2,...`: one config key and its values; default: the config as
is) and each seed (`--seeds`), the offline default's workload (`configs/default.py`;
`configs/tiny.py` for `--model tiny`) runs twice, `--steps` updates each, weights published
after every update: synchronously (`max_staleness=0`: batch i is generated with the weights
after i updates) and one step off-policy (`max_staleness=1`: batch i with the weights after
i − 1, while the learner trains on batch i − 1). A seed fixes the prompts, the generation seeds
and the validation prompts, so the two modes of a seed differ only in the staleness of the
samples: their difference is paired.

`--async-mode continuous` makes the async runs continuous instead (`rollout.continuous=true`,
`generator.swap_mode=in-flight` with the KV kept: batches overlap across the pool and a batch's
tail finishes on newer weights; the staleness bound is still `max_staleness=1` per sample's
oldest token). Continuous generation runs unseeded (vLLM 0.32's CPU engine dies on per-request
seeds), so a seed fixes the prompts and the validation prompts but not the samples, and the
pairing is by prompts only. Its runs go to `{variant}/continuous/` beside `{variant}/async/`,
so both comparisons share the sync runs of one `--out`.

Greedy accuracy is measured on the validation split (choosing a variant) and on the test split
(the figure to report; the whole split, the same for every seed) after every `--eval-every`
updates and at the end. Per variant and evaluation step: sync and async mean ± standard error
over the seeds, and the paired difference async − sync (mean ± s.e.); "within noise" when
|mean| ≤ 2 s.e. The variant with the best mean validation accuracy at the end (both modes) is
marked chosen: its test figures are the ones to report. Each run is a plain `python -m
jaxrlhf.main` in `{out}/{variant}/{sync|async|continuous}/seed{S}/` (generator services
shared by consecutive runs of a swap setting, one at a time; see
`jaxrlhf.experiments.runner`). Outputs: `{out}/results.json`,
`{out}/async_vs_sync.png` (test accuracy of both modes and their paired difference per variant
and step, ± 1 s.e.; with `--async-mode continuous`: `results-continuous.json`,
`continuous_vs_sync.png`) and a markdown table on stdout. The measured table and runtimes are
in BENCHMARKS.md.
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
    common_overrides,
    parse_experiment_args,
    runner_from_args,
    variant_label,
)
from jaxrlhf.experiments.stats import (
    format_mean_stderr,
    mean_stderr,
    paired_difference,
    within,
    zero_if_nan,
)

MODES = {"sync": 0, "async": 1}  # mode -> max_staleness
SPLITS = {"test": "test_accuracy", "validation": "eval_accuracy"}


def accuracy_at(entry: dict[str, Any], split: str, step: int, steps: int) -> float | None:
    """The run's greedy accuracy on `split` after `step` updates (the end: summary.json)."""
    key = SPLITS[split]
    if step == steps:
        return entry.get(f"{key}_end")
    return entry.get("evals", {}).get(str(step), {}).get(key)


def comparisons(entries: Sequence[dict[str, Any]], steps: int, eval_every: int) -> list[dict]:
    """Per variant, split and evaluation step: both modes' mean ± s.e. and the paired
    difference async − sync (module docstring)."""
    done = [e for e in entries if e["status"] == "ok"]
    eval_steps = sorted({*range(eval_every, steps, eval_every or steps), steps})
    rows = []
    for variant in dict.fromkeys(e["variant"] for e in entries):
        for split in SPLITS:
            for step in eval_steps:
                by_mode = {
                    mode: {
                        e["seed"]: value
                        for e in done
                        if e["variant"] == variant and e["mode"] == mode
                        and (value := accuracy_at(e, split, step, steps)) is not None
                    }
                    for mode in MODES
                }  # fmt: skip
                if not any(by_mode.values()):
                    continue
                row: dict[str, Any] = {"variant": variant, "split": split, "step": step}
                for mode, values in by_mode.items():
                    row[mode], row[f"{mode}_stderr"] = mean_stderr(list(values.values()))
                    row[f"{mode}_seeds"] = len(values)
                diff, stderr, n = paired_difference(by_mode["sync"], by_mode["async"])
                row |= {"difference": diff, "difference_stderr": stderr, "paired_seeds": n,
                        "within_2_stderr": within(diff, stderr)}  # fmt: skip
                rows.append(row)
    return rows


def chosen_variant(rows: Sequence[dict[str, Any]], steps: int) -> str | None:
    """The variant with the best mean validation accuracy at the end, both modes together."""
    scores = {
        r["variant"]: (r["sync"] + r["async"]) / 2
        for r in rows
        if r["split"] == "validation" and r["step"] == steps
        and math.isfinite(r["sync"]) and math.isfinite(r["async"])
    }  # fmt: skip
    return max(scores, key=scores.get) if scores else None


def markdown_table(rows: Sequence[dict[str, Any]], chosen: str | None) -> str:
    lines = [
        "| variant | split | updates | sync % | async % | async − sync (paired) % | seeds "
        "| within 2 s.e. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = " (chosen)" if r["variant"] == chosen else ""
        cells = [
            format_mean_stderr(r["sync"], r["sync_stderr"], 100),
            format_mean_stderr(r["async"], r["async_stderr"], 100),
            format_mean_stderr(r["difference"], r["difference_stderr"], 100),
        ]
        lines.append(f"| {r['variant']}{mark} | {r['split']} | {r['step']} | "
                     f"{' | '.join(cells)} | {r['paired_seeds']} | "
                     f"{'yes' if r['within_2_stderr'] else 'no'} |")  # fmt: skip
    return "\n".join(lines)


def plot_results(
    rows: Sequence[dict[str, Any]], path: str | Path, title: str = "One-step-off async vs sync"
) -> Path:
    """Test accuracy of both modes (left) and their paired difference (right), per variant
    and evaluation step, error bars ± 1 s.e."""
    from matplotlib.figure import Figure

    test = [r for r in rows if r["split"] == "test"]
    if not test:
        raise ValueError("no finished run to plot")
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    labels = [f"{r['variant'].rsplit('.', 1)[-1]}\n{r['step']} updates" for r in test]
    x = list(range(len(test)))
    for offset, mode in ((-0.1, "sync"), (0.1, "async")):
        left.errorbar([i + offset for i in x], [r[mode] * 100 for r in test],
                      yerr=[zero_if_nan(r[f"{mode}_stderr"]) * 100 for r in test],
                      fmt="o", capsize=4, label=mode)  # fmt: skip
    left.set_ylabel("test accuracy (%), mean ± s.e. over seeds")
    right.errorbar(x, [r["difference"] * 100 for r in test],
                   yerr=[zero_if_nan(r["difference_stderr"]) * 100 for r in test],
                   fmt="o", capsize=4, color="C2")  # fmt: skip
    right.axhline(0.0, color="gray", lw=1)
    right.set_ylabel("async − sync, paired (points), ± s.e.")
    for ax in (left, right):
        ax.set_xticks(x, labels, fontsize="small")
        ax.grid(alpha=0.3)
    left.legend()
    seeds = max((r["paired_seeds"] for r in test), default=0)
    fig.suptitle(f"{title}, {seeds} seeds")
    return save_figure(fig, path)


# --async-mode -> (the async runs' folder name, their overrides besides max_staleness=1).
ASYNC_MODES = {
    "one-step-off": ("async", {}),
    "continuous": ("continuous", CONTINUOUS_OVERRIDES),
}


def plan(args, out: Path) -> list[PlannedRun]:
    key, values = args.vary
    async_folder, async_overrides = ASYNC_MODES[args.async_mode]
    runs = []
    for value in values:
        variant = variant_label(key, value)
        for seed in args.seeds:  # a seed's two modes one after the other: partial results pair
            for mode, staleness in MODES.items():
                mode_folder = "sync" if mode == "sync" else async_folder
                folder = out / variant / mode_folder / f"seed{seed}"
                overrides = common_overrides(args, folder, args.steps)
                overrides |= {"seed": seed, "max_staleness": staleness, "sync_every": 1,
                              "num_mini_batches": 0, "eval.every": args.eval_every,
                              "eval.test": True, "eval.test_every": args.eval_every}  # fmt: skip
                if mode == "async":
                    overrides |= async_overrides
                if key:
                    overrides[key] = value
                labels = {"variant": variant, "mode": mode, "seed": seed}
                runs.append(PlannedRun(labels, folder, {**overrides, **args.passthrough}))
    return runs


def _parse_args(argv: Sequence[str] | None):
    parser = argparse.ArgumentParser(
        prog="python -m jaxrlhf.experiments.async_vs_sync", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--steps", type=int, default=16, help="updates per run")
    parser.add_argument("--eval-every", type=int, default=8, help="updates between evaluations")
    parser.add_argument("--vary", default="", help="KEY=V1,V2: one config key's values")
    parser.add_argument(
        "--async-mode",
        choices=list(ASYNC_MODES),
        default="one-step-off",
        help="how the async runs generate (module docstring)",
    )
    parser.add_argument("--out", default="runs/async_vs_sync")
    return parse_experiment_args(parser, argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    runner, out = runner_from_args(args, "async_vs_sync")
    keys = ("seeds", "model", "steps", "eval_every", "vary", "async_mode", "last", "passthrough")
    settings = {key: getattr(args, key) for key in keys}

    continuous = args.async_mode == "continuous"
    # --async-mode continuous writes beside the one-step-off comparison, not over it.
    results_file = out / ("results-continuous.json" if continuous else "results.json")
    figure_file = out / ("continuous_vs_sync.png" if continuous else "async_vs_sync.png")

    def write(entries):
        rows = comparisons(entries, args.steps, args.eval_every)
        results = {"settings": settings, "chosen": chosen_variant(rows, args.steps),
                   "comparisons": rows, "runs": entries}  # fmt: skip
        results_file.write_text(json.dumps(results, indent=2))

    entries = runner.run_all(plan(args, out), args.last, write)
    rows = comparisons(entries, args.steps, args.eval_every)
    chosen = chosen_variant(rows, args.steps)
    print(f"async: {args.async_mode} (max_staleness=1)")
    print(markdown_table(rows, chosen))
    if chosen is not None:
        print(f"chosen on validation: {chosen}")
    if rows:
        title = "Continuous async vs sync" if continuous else "One-step-off async vs sync"
        print(f"figure: {plot_results(rows, figure_file, title)}")
    print(f"results: {results_file}")


if __name__ == "__main__":
    main()

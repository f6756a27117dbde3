"""The paper's compute-optimal settings as curves: test accuracy and KL against updates and time.

    # training-bound (the offline default): Online DPO with K = 2 vs 4 samples per prompt
    python -m jaxrlhf.experiments.compute --vary rollout.samples_per_prompt=2,4 \
        --steps 16 --eval-every 4 --seeds 0,1,2 --out runs/compute_k
    # generation-bound: 1, 2 and 4 updates per batch, generator and learner on a core each
    python -m jaxrlhf.experiments.compute --workload generation-bound \
        --vary train.updates_per_batch=1,2,4 --steps 16 --eval-every 8 --seeds 0,1,2 \
        --cpus-generator 1 --cpus-learner 0 --out runs/compute_updates
    # a pipeline check on the tiny random model (no learning signal)
    python -m jaxrlhf.experiments.compute --model tiny --vary rollout.samples_per_prompt=2,4 \
        --steps 2 --eval-every 1 --seeds 0 --out /tmp/compute-tiny
    # redraw the table and figure from the runs already in --out
    python -m jaxrlhf.experiments.compute --vary ... --report-only

For each value of one config key (`--vary KEY=V1,V2,...`) and each seed (`--seeds`), the
workload runs `--steps` updates one step off-policy (the paper's asynchronous setting:
`max_staleness=1`, weights published after every update, drain swaps), with greedy accuracy on
the validation split (128 prompts) and on the whole test split every `--eval-every` updates and
at the end. Workloads (`--workload`; extra `--config.KEY=VALUE` arguments go to every run):

- `default`: `configs/default.py` as `make run` trains it (SmolLM2-135M, arithmetic, Online DPO
  on each prompt's best and worst of K samples, 8 prompts per batch): training-bound (the
  learner never waits for a batch; K changes generation, not the learner's work, since only the
  pair is trained on).
- `generation-bound`: the default with every response exactly 16 tokens
  (`rollout.min_response_tokens=16`, no missing-EOS penalty, so the reward still comes from the
  answer), its rollouts sampled one sequence at a time (`rollout.max_running=1`: a call's
  samples go through the engine one after another, GenerateRequest.max_running, while the
  greedy evaluations get the whole engine), and a Generate deadline of 600 s (a call takes its
  samples' times added up). Run it with the generator and the learner on cores of their own
  (`--cpus-generator 1 --cpus-learner 0` on 2 cores), as on separate devices: shared, each
  slows the other and no side waits for the other alone. So measured on the development
  machine (4 updates each, `--config.eval.at_start=false`): a batch of 32 samples generated in
  42 s, against a learner step of 27-33 s at 1 update per batch (`learner_idle_fraction` 0.2-0.5
  after the first step). Earlier designs were not generation-bound: an engine of 4 sequences
  for everything (`generator.max_num_seqs=4`) generated a batch in 25 s against a learner step
  of 31 s, unpinned (learner_idle_fraction 0), and 14 s against 28 s pinned; at an engine of 1
  sequence, each greedy evaluation of 960 prompts took about a quarter of an hour. Each run's
  `learner_idle_fraction` (printed) shows how generation-bound it was. Its KL is computed from
  the learner's recompute of the samples' log-probs (`loss_params.old_logprobs=learner`, one
  more forward per batch): the sampler's, under min_tokens, are of a distribution without EOS.

Time is the learner's: the sum of `step_s` (waiting for the batch, the update, publishing)
over the steps, evaluations excluded. A one-step-off producer keeps generating while the
learner evaluates during the run, so the step after such an evaluation waits less than it
would have: its time is replaced by the median step time of the run's other steps (the same
correction for every variant). The first step keeps its own time (the first batch, which
nothing overlaps, and the learner's compilation).

Per variant and evaluation step: test and validation accuracy and KL (mean of the step's `kl`),
mean ± standard error over the seeds, at the mean time. "Time to a target accuracy": the
target is the lowest final mean *validation* accuracy of the variants (a level every variant
reaches on average, chosen without the test split); per seed, the updates and seconds at the
first evaluation where the *test* accuracy reaches it (seeds that never do are counted apart),
and the KL there. Outputs: `{out}/results.json`, `{out}/compute.png` (test accuracy and KL
against updates and against time, one line per variant, ± 1 s.e.) and markdown tables on
stdout. Runs: `{out}/{variant}/seed{S}/`, each a plain `python -m jaxrlhf.main`
(`jaxrlhf.experiments.runner`). Measured tables: BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments import read_run, save_figure
from jaxrlhf.experiments.runner import (
    PlannedRun,
    common_overrides,
    parse_experiment_args,
    runner_from_args,
    variant_label,
)
from jaxrlhf.experiments.stats import format_mean_stderr, mean_stderr, zero_if_nan

WORKLOADS = {
    "default": {},
    "generation-bound": {
        "rollout.min_response_tokens": 16,
        "loss_params.missing_eos_penalty": False,
        # A rollout call's samples go through the engine one at a time (GenerateRequest.
        # max_running); evaluations get the whole engine.
        "rollout.max_running": 1,
        # So a call takes the time of its samples one after another: the default per-call
        # deadline (30 s + rows × max_tokens / 50) does not count that, and expired calls made
        # the run fail over to no replica and back, every few steps.
        "generator.generate_timeout_s": 600.0,
        # The sampler's log-probs under min_tokens are of a distribution with EOS masked out:
        # the learner's own recompute gives the KL (rollout.min_response_tokens in config/keys.py).
        "loss_params.old_logprobs": "learner",
    },
}
SPLITS = {"test": "test_accuracy", "validation": "eval_accuracy"}


def run_curve(
    records: Sequence[dict[str, Any]], summary: dict[str, Any], sync_every: int = 1
) -> list[dict[str, Any]]:
    """One run's points, one per evaluation (step 0 when it was evaluated before training):
    step, seconds (the learner's time so far, module docstring), kl, and the accuracies.

    A point's step is the number of updates in the weights it measured: an evaluation reads
    the generators' weights, which between two publishes (`sync_every` > 1) are the last
    publish's. Records since the evaluator wrote it hold it (`evaluated_updates`); for older
    ones it is the step rounded down to a multiple of `sync_every` (every run publishes then
    and at its last step). A second evaluation of the same weights (e.g. the start model's,
    again at step 16 of a run publishing every 64) adds no point."""
    records = sorted(records, key=lambda r: r["step"])
    evaluated = {r["step"] for r in records if any(k in r for k in SPLITS.values())}
    last = records[-1]["step"] if records else 0
    if summary.get("test_accuracy_end") is not None:
        evaluated.add(last)
    after_eval = {step + 1 for step in evaluated}
    plain = [r["step_s"] for r in records if r["step"] not in after_eval]
    typical = statistics.median(plain) if plain else None
    seconds_at, kl_at, seconds = {0: 0.0}, {0: 0.0}, 0.0
    for r in records:
        corrected = r["step"] in after_eval and typical is not None
        seconds += typical if corrected else r["step_s"]
        seconds_at[r["step"]], kl_at[r["step"]] = seconds, r.get("kl")
    points = []
    if start := _start_point(summary):
        points.append(start)
    for r in records:
        if r["step"] not in evaluated:
            continue
        at = r["step"] if r["step"] == last else r["step"] - r["step"] % sync_every
        at = r.get("evaluated_updates", at)
        if any(p["step"] == at for p in points):
            continue
        # (a resumed run's records may begin after the weights it evaluated)
        point = {"step": at, "seconds": seconds_at.get(at), "kl": kl_at.get(at)}
        for split, key in SPLITS.items():
            value = r.get(key)
            if value is None and r["step"] == last:
                value = summary.get(f"{key}_end")
            point[split] = value
        points.append(point)
    return points


def learner_idle(records: Sequence[dict[str, Any]], curve: Sequence[dict[str, Any]]) -> float:
    """The run's mean `learner_idle_fraction` over its steps, leaving out the first (no batch
    can be ready before it) and each one right after an evaluation (module docstring)."""
    after_eval = {p["step"] + 1 for p in curve}
    values = [r["learner_idle_fraction"] for r in records
              if r["step"] > 1 and r["step"] not in after_eval]  # fmt: skip
    return sum(values) / len(values) if values else math.nan


def _start_point(summary: dict[str, Any]) -> dict[str, Any] | None:
    if summary.get("test_accuracy_start") is None:
        return None
    return {"step": 0, "seconds": 0.0, "kl": 0.0, "test": summary["test_accuracy_start"],
            "validation": summary.get("eval_accuracy_start")}  # fmt: skip


def curves(runs: dict[str, dict[int, list[dict[str, Any]]]]) -> dict[str, list[dict[str, Any]]]:
    """Per variant ({variant: {seed: run_curve}}) and evaluation step: each figure's mean and
    standard error over the seeds that have the point."""
    out = {}
    for variant, by_seed in runs.items():
        steps = sorted({p["step"] for curve in by_seed.values() for p in curve})
        rows = []
        for step in steps:
            points = [p for curve in by_seed.values() for p in curve if p["step"] == step]
            row: dict[str, Any] = {"step": step, "seeds": len(points)}
            for key in ("seconds", "kl", *SPLITS):
                values = [p[key] for p in points if p.get(key) is not None]
                row[key], row[f"{key}_stderr"] = mean_stderr(values)
            rows.append(row)
        out[variant] = rows
    return out


def time_to_target(
    runs: dict[str, dict[int, list[dict[str, Any]]]], table: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    """The target (the lowest final mean validation accuracy over the variants) and, per
    variant, the updates, seconds and KL at each seed's first evaluation whose test accuracy
    reaches it: mean ± s.e. over the seeds that reach it, and how many do."""
    finals = [rows[-1]["validation"] for rows in table.values() if rows]
    finals = [f for f in finals if math.isfinite(f)]
    if not finals:
        return {"target": None, "variants": {}}
    target = min(finals)
    variants = {}
    for variant, by_seed in runs.items():
        reached = []
        for curve in by_seed.values():
            first = next((p for p in curve if p.get("test") is not None
                          and p["test"] >= target), None)  # fmt: skip
            if first is not None:
                reached.append(first)
        cell: dict[str, Any] = {"reached": len(reached), "seeds": len(by_seed)}
        for key in ("step", "seconds", "kl"):
            cell[key], cell[f"{key}_stderr"] = mean_stderr([p[key] for p in reached])
        variants[variant] = cell
    return {"target": target, "variants": variants}


def markdown(table: dict[str, list[dict[str, Any]]], target: dict[str, Any]) -> str:
    lines = ["| variant | updates | time (s) | test % | validation % | KL | seeds |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for variant, rows in table.items():
        for r in rows:
            cells = [
                format_mean_stderr(r["seconds"], r["seconds_stderr"], digits=0),
                format_mean_stderr(r["test"], r["test_stderr"], 100),
                format_mean_stderr(r["validation"], r["validation_stderr"], 100),
                format_mean_stderr(r["kl"], r["kl_stderr"], digits=2),
            ]
            lines.append(f"| {variant} | {r['step']} | {' | '.join(cells)} | {r['seeds']} |")
    if target["target"] is not None:
        lines += ["", f"Time to {target['target'] * 100:.1f}% test accuracy (the lowest final "
                  "validation accuracy of the variants):", "",
                  "| variant | reached (seeds) | updates | time (s) | KL there |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for variant, cell in target["variants"].items():
            cells = [
                format_mean_stderr(cell["step"], cell["step_stderr"]),
                format_mean_stderr(cell["seconds"], cell["seconds_stderr"], digits=0),
                format_mean_stderr(cell["kl"], cell["kl_stderr"], digits=2),
            ]
            lines.append(f"| {variant} | {cell['reached']}/{cell['seeds']} | "
                         f"{' | '.join(cells)} |")  # fmt: skip
    return "\n".join(lines)


def plot(table: dict[str, list[dict[str, Any]]], path: str | Path, title: str) -> Path:
    """Test accuracy (top) and KL (bottom) against updates (left) and time (right)."""
    from matplotlib.figure import Figure

    if not any(table.values()):
        raise ValueError("no finished run to plot")
    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(2, 2)
    for variant, rows in table.items():
        for i, (key, scale) in enumerate((("test", 100.0), ("kl", 1.0))):
            y = [r[key] * scale for r in rows]
            err = [zero_if_nan(r[f"{key}_stderr"]) * scale for r in rows]
            for j, x_key in enumerate(("step", "seconds")):
                x = [r[x_key] for r in rows]
                axes[i][j].errorbar(x, y, yerr=err, fmt="o-", capsize=3, label=variant)
    for j, label in enumerate(("updates", "learner time (s), evaluations excluded")):
        axes[1][j].set_xlabel(label)
    for i, label in enumerate(("test accuracy (%)", "KL to the reference")):
        axes[i][0].set_ylabel(f"{label}, mean ± s.e.")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    seeds = max((r["seeds"] for rows in table.values() for r in rows), default=0)
    fig.suptitle(f"{title}, {seeds} seeds")
    return save_figure(fig, path)


def plan(args, out: Path) -> list[PlannedRun]:
    key, values = args.vary
    runs = []
    for value in values:
        variant = variant_label(key, value)
        for seed in args.seeds:
            folder = out / variant / f"seed{seed}"
            overrides = common_overrides(args, folder, args.steps)
            overrides |= WORKLOADS[args.workload]
            overrides |= {"seed": seed, "max_staleness": 1, "sync_every": 1,
                          "num_mini_batches": 0, "generator.swap_mode": "drain",
                          "eval.every": args.eval_every, "eval.test": True,
                          "eval.test_every": args.eval_every}  # fmt: skip
            if key:
                overrides[key] = value
            labels = {"variant": variant, "seed": seed}
            runs.append(PlannedRun(labels, folder, {**overrides, **args.passthrough}))
    return runs


def collect(entries: Sequence[dict[str, Any]]) -> tuple[dict, dict[str, tuple[float, float]]]:
    """{variant: {seed: run_curve}} of the finished runs, and per variant the learner's idle
    fraction (`learner_idle`), mean ± s.e. over the seeds."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {}
    idle: dict[str, list[float]] = {}
    for entry in entries:
        runs.setdefault(entry["variant"], {})
        idle.setdefault(entry["variant"], [])
        if entry["status"] != "ok":
            continue
        records, summary = read_run(entry["output_dir"])
        curve = run_curve(records, summary)
        runs[entry["variant"]][entry["seed"]] = curve
        idle[entry["variant"]].append(learner_idle(records, curve))
    return runs, {variant: mean_stderr(values) for variant, values in idle.items()}


def _parse_args(argv: Sequence[str] | None):
    parser = argparse.ArgumentParser(
        prog="python -m jaxrlhf.experiments.compute", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--workload", choices=list(WORKLOADS), default="default")
    parser.add_argument("--steps", type=int, default=16, help="updates per run")
    parser.add_argument("--eval-every", type=int, default=4, help="updates between evaluations")
    parser.add_argument("--vary", default="", help="KEY=V1,V2: one config key's values")
    parser.add_argument("--out", default="runs/compute")
    args = parse_experiment_args(parser, argv)
    if args.eval_every < 1 or args.steps % args.eval_every:
        parser.error(f"--eval-every {args.eval_every} must divide --steps {args.steps}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    runner, out = runner_from_args(args, "compute")
    keys = ("seeds", "model", "workload", "steps", "eval_every", "vary", "passthrough")
    settings = {key: getattr(args, key) for key in keys}

    def report(entries):
        runs, idle = collect(entries)
        table = curves(runs)
        return table, time_to_target(runs, table), idle, runs

    def write(entries):
        table, target, idle, runs = report(entries)
        results = {"settings": settings, "curves": table, "time_to_target": target,
                   "learner_idle_fraction": idle, "per_seed": runs, "runs": entries}  # fmt: skip
        (out / "results.json").write_text(json.dumps(results, indent=2))

    entries = runner.run_all(plan(args, out), args.last, write)
    write(entries)
    table, target, idle, _ = report(entries)
    print(f"workload: {args.workload}, one step off-policy")
    print(markdown(table, target))
    print("learner idle fraction (waiting for a batch; first step and steps after an "
          "evaluation left out): " + ", ".join(
              f"{variant} {format_mean_stderr(*value, digits=2)}"
              for variant, value in idle.items()))  # fmt: skip
    if any(table.values()):
        key = args.vary[0] or "default"
        print(f"figure: {plot(table, out / 'compute.png', f'{args.workload}: {key}')}")
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()

"""The paper's off-policyness test bed: how final reward, accuracy and KL change with N.

    # the full sweep: 3 losses x N in {1, 2, 4, 8, 16, 64}, 64 updates each (a day or more on CPU)
    python -m jaxrlhf.experiments.offpolicy
    # the short CPU setting (see below; ~80 min on 2 cores)
    python -m jaxrlhf.experiments.offpolicy --mini-batches 1,2,4,8 --steps 8 --prompts-per-batch 4
    # a pipeline check on the tiny random model (no learning signal: rewards stay ~0)
    python -m jaxrlhf.experiments.offpolicy --model tiny --losses online_dpo,rloo \
        --mini-batches 1,2 --steps 4 --out /tmp/offpolicy-tiny
    # redraw the table and figure from the runs already in --out
    python -m jaxrlhf.experiments.offpolicy --report-only

For each loss (`--losses`, default online_dpo,ppo,rloo) and each N (`--mini-batches`) the RLHF
stage runs with `num_mini_batches=N` (N mini-batches generated with one policy, then N updates,
then the weights are published: `sync_every=N`, `max_staleness=N-1`), on the offline default's
model and task (`configs/default.py`; `configs/tiny.py` for `--model tiny`). Every run takes the
same number of updates, `--steps`, which must be a multiple of every N; by default the least
common multiple of the N values (= the largest N for powers of two). N = 1 is on-policy
(synchronous). Runs share the prompts and the generation seeds, so batch 0 is the same in all.

One generator service is started for the whole sweep and every run connects to it
(`--config.generator.addresses`), saving the engine start (~45 s) per run; each run publishes
its initial weights first, since the service serves the previous run's. Each run is a plain
`python -m jaxrlhf.main` in `{out}/{loss}/N{N}/` (`run.log`, `metrics.jsonl`, `summary.json`,
`training.png`); its checkpoints are deleted after the run (`--keep-checkpoints` keeps them:
~1.6 GB each for SmolLM2 with Adam state). A run whose folder holds a finished run with the
same settings is reused (`--rerun` runs it again); a failed run is recorded and the sweep goes
on.

Figures per run: final reward = mean `reward_mean` (task reward, before the missing-EOS
penalty) over the last `--last` steps (default 5); KL = mean `kl` over the same steps;
held-out greedy accuracy before and after training (`summary.json`); mean staleness over all
steps. Outputs: `{out}/results.json`, `{out}/offpolicy.png` (final reward, held-out accuracy
and KL against N on a log2 axis, one line per loss) and a markdown table on stdout. The
held-out accuracy is the figure to compare across N: it scores the final weights on fresh
greedy responses, while the training batches behind `reward_mean` and `kl` were sampled up to
N - 1 versions earlier (with N = --steps, every batch comes from the initial policy).

Short CPU settings (2 cores, SmolLM2-135M), measured on 2026-11-30 (BENCHMARKS.md):

    python -m jaxrlhf.experiments.offpolicy --mini-batches 1,2,4,8 --steps 8 --prompts-per-batch 4

12 runs in ~80 min: 4.5–6.7 min per Online DPO or RLOO run, 7.6–11.4 min per PPO run (a value
model to run and train), plus ~1 min for the one engine start. `--mini-batches 1,4,16 --steps
16` with the default 8 prompts per update is ~4x that. Measured as well: the tiny pipeline check
(`--model tiny --losses online_dpo,rloo --mini-batches 1,2 --steps 4`) took 140 s in all. At
these sizes 64 held-out prompts (±~9 accuracy points, 95%) and 8 updates show the direction of
the paper's result at best (Online DPO flat in N, RLOO −9 points at N = 8, PPO not learning
yet); separating the losses the way the paper does needs the full sweep on accelerators.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments import (
    config_file_for,
    load_config,
    log_tail,
    main_command,
    read_run,
    run_main,
)

DEFAULT_LOSSES = ("online_dpo", "ppo", "rloo")
DEFAULT_MINI_BATCHES = (1, 2, 4, 8, 16, 64)
SETTINGS_FILE = "experiment.json"  # in each run's folder: the overrides it ran with


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


def run_dir(out: Path, loss: str, num_mini_batches: int) -> Path:
    return Path(out) / loss / f"N{num_mini_batches}"


def summarize_run(
    records: Sequence[dict[str, Any]], summary: dict[str, Any], last: int
) -> dict[str, Any]:
    """The figures of one finished run (module docstring)."""
    if not records:
        raise ValueError("the run has no metrics records")
    tail = list(records)[-last:]
    mean = lambda key, rows: float(sum(r[key] for r in rows) / len(rows))
    return {
        "final_reward": mean("reward_mean", tail),
        "final_kl": mean("kl", tail),
        "eval_accuracy_start": summary.get("eval_accuracy_start"),
        "eval_accuracy_end": summary.get("eval_accuracy_end"),
        "staleness_mean": mean("staleness_mean", records),
        "staleness_max": max(r["staleness_max"] for r in records),
        "steps_done": len(records),
        "wall_seconds": summary.get("wall_seconds"),
    }


def markdown_table(results: Sequence[dict[str, Any]], last: int) -> str:
    """One row per run: loss, N, final reward, accuracy start -> end, KL, staleness, minutes."""

    def cell(value: Any, fmt: str = ".3f") -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        f"| loss | N | reward (last {last}) | held-out accuracy start → end | KL (last {last}) "
        "| staleness mean / max | minutes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["loss"], r["num_mini_batches"])):
        minutes = cell(r["seconds"] / 60, ".1f") if r.get("seconds") is not None else "-"
        if r["status"] != "ok":
            lines.append(
                f"| {r['loss']} | {r['num_mini_batches']} | {r['status']} | - | - | - | {minutes} |"
            )
            continue
        lines.append(
            f"| {r['loss']} | {r['num_mini_batches']} | {cell(r['final_reward'])} | "
            f"{cell(r['eval_accuracy_start'])} → {cell(r['eval_accuracy_end'])} | "
            f"{cell(r['final_kl'])} | {r['staleness_mean']:.2f} / {r['staleness_max']} "
            f"| {minutes} |"
        )
    return "\n".join(lines)


def plot_results(results: Sequence[dict[str, Any]], path: str | Path, last: int) -> Path:
    """PNG: final reward, held-out accuracy at the end and KL against N (log2 axis), one line
    per loss; the accuracy before training as a dashed line. Failed runs are left out."""
    from matplotlib.figure import Figure

    done = [r for r in results if r["status"] == "ok"]
    if not done:
        raise ValueError("no finished run to plot")
    panels = (
        ("final_reward", f"final reward (mean of last {last} steps)"),
        ("eval_accuracy_end", "held-out accuracy after training"),
        ("final_kl", f"KL to reference (mean of last {last} steps)"),
    )
    fig = Figure(figsize=(4.5 * len(panels), 4.0), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    ticks = sorted({r["num_mini_batches"] for r in done})
    for ax, (key, label) in zip(axes, panels, strict=True):
        for loss in sorted({r["loss"] for r in done}):
            points = sorted(
                (r["num_mini_batches"], r[key])
                for r in done
                if r["loss"] == loss and r[key] is not None
            )
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, "o-", label=loss)
        if key == "eval_accuracy_end":
            starts = [
                r["eval_accuracy_start"] for r in done if r["eval_accuracy_start"] is not None
            ]
            if starts:
                ax.axhline(starts[0], color="gray", ls="--", lw=1, label="before training")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("N (mini-batches per policy)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    steps = sorted({r["steps"] for r in done})
    fig.suptitle(f"Off-policy RLHF: {'/'.join(map(str, steps))} updates per run")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def run_overrides(args, loss: str, num_mini_batches: int, output_dir: Path) -> dict[str, Any]:
    """The run's `--config.KEY=VALUE`s, without the generator address (it changes per sweep)."""
    overrides: dict[str, Any] = {
        "output_dir": str(output_dir),
        "loss": loss,
        "num_mini_batches": num_mini_batches,
        "total_steps": args.steps,
        "checkpoint.every": args.steps,
        "export": False,
    }
    if args.cpus_learner:
        overrides["learner_cpus"] = args.cpus_learner
    if args.model not in ("smollm2", "tiny"):
        overrides["model.path"] = args.model
    for flag, key in (
        ("prompts_per_batch", "rollout.prompts_per_batch"),
        ("samples_per_prompt", "rollout.samples_per_prompt"),
        ("learning_rate", "train.learning_rate"),
    ):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    return {**overrides, **args.passthrough}


def finished_with(folder: Path, overrides: dict[str, Any]) -> bool:
    """Whether `folder` holds a finished run made with exactly these overrides."""
    settings = folder / SETTINGS_FILE
    return (
        (folder / "summary.json").exists()
        and settings.exists()
        and json.loads(settings.read_text()) == json.loads(json.dumps(overrides))
    )


def _parse_args(argv: Sequence[str] | None):
    parser = argparse.ArgumentParser(
        prog="python -m jaxrlhf.experiments.offpolicy", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--losses", default=",".join(DEFAULT_LOSSES))
    parser.add_argument("--mini-batches", default=",".join(map(str, DEFAULT_MINI_BATCHES)))
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, or a model folder")
    parser.add_argument("--steps", type=int, help="updates per run (default: lcm of the N values)")
    parser.add_argument("--prompts-per-batch", type=int)
    parser.add_argument("--samples-per-prompt", type=int)
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--last", type=int, default=5, help="steps averaged for the final figures")
    parser.add_argument("--out", default="runs/offpolicy")
    parser.add_argument("--cpus-generator", default="", help='e.g. "1" (default: not pinned)')
    parser.add_argument("--cpus-learner", default="", help='e.g. "0" (default: not pinned)')
    parser.add_argument(
        "--generator-addresses", default="", help="use running services instead of starting one"
    )
    parser.add_argument("--rerun", action="store_true", help="rerun runs already finished")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument(
        "--report-only", action="store_true", help="only read the runs already in --out"
    )
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if not a.startswith("--config.")]
    if unknown:
        parser.error(f"unknown arguments {unknown} (only --config.KEY=VALUE pass through)")
    args.passthrough = dict(a.removeprefix("--config.").split("=", 1) for a in extra)
    args.losses = [name.strip() for name in args.losses.split(",") if name.strip()]
    args.mini_batches = sorted({int(n) for n in args.mini_batches.split(",") if n.strip()})
    args.steps = args.steps or default_steps(args.mini_batches)
    try:
        check_steps(args.steps, args.mini_batches)
    except ValueError as error:
        parser.error(str(error))
    return args


def _start_generator(args, config_file: Path, out: Path):
    """One generator service for the whole sweep, with the run configs' engine settings."""
    from jaxrlhf.models.paths import resolve_model
    from jaxrlhf.rl.service import start_server

    overrides = run_overrides(args, args.losses[0], args.mini_batches[0], out)
    config = load_config(config_file, overrides)
    gen = config.generator
    engine_args = [
        "--dtype", gen.dtype, "--max-model-len", str(gen.max_model_len), "--seed", str(gen.seed),
    ]  # fmt: skip
    cpus = [int(c) for c in args.cpus_generator.split(",")] if args.cpus_generator else None
    log = out / "generator.log"
    print(f"[offpolicy] starting a generator service (log: {log})", flush=True)
    return start_server(resolve_model(config.model.path), log, engine_args, cpus=cpus)


def run_entry(loss: str, num_mini_batches: int, steps: int, folder: Path, last: int) -> dict:
    """A results entry from a run folder: the run's figures, or the reason there are none."""
    entry: dict[str, Any] = {
        "loss": loss,
        "num_mini_batches": num_mini_batches,
        "steps": steps,
        "output_dir": str(folder),
    }
    try:
        records, summary = read_run(folder)
        entry.update(status="ok", **summarize_run(records, summary, last))
        entry["seconds"] = summary.get("total_seconds")
    except (FileNotFoundError, ValueError) as error:
        entry.update(status="missing", error=str(error), seconds=None)
    return entry


class _Sweep:
    """Runs the planned (loss, N) runs one after another against one generator service."""

    def __init__(self, args, out: Path):
        self.args, self.out = args, out
        self.config_file = config_file_for(args.model)
        self.address = args.generator_addresses
        self.server = None

    def needs_run(self, loss: str, n: int) -> bool:
        folder = run_dir(self.out, loss, n)
        overrides = run_overrides(self.args, loss, n, folder)
        return not self.args.report_only and (
            self.args.rerun or not finished_with(folder, overrides)
        )

    def run(self, loss: str, n: int) -> tuple[int, float]:
        """(exit code, seconds) of one run; starts the shared service on first use."""
        if not self.address:
            self.server = _start_generator(self.args, self.config_file, self.out)
            self.address = self.server.address
        if self.server is not None and self.server.process.poll() is not None:
            sys.exit(f"the generator service exited:\n{self.server.log_tail()}")
        folder = run_dir(self.out, loss, n)
        overrides = run_overrides(self.args, loss, n, folder)
        if folder.exists():
            shutil.rmtree(folder)
        command = main_command(self.config_file, {**overrides, "generator.addresses": self.address})
        returncode, seconds = run_main(command, folder / "run.log")
        if returncode == 0:
            (folder / SETTINGS_FILE).write_text(json.dumps(overrides, indent=2))
        else:
            print(log_tail(folder / "run.log"), flush=True)
        if not self.args.keep_checkpoints:
            shutil.rmtree(folder / "checkpoints", ignore_errors=True)
        return returncode, seconds

    def close(self) -> None:
        if self.server is not None:
            self.server.terminate()


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sweep = _Sweep(args, out)
    plan = [(loss, n) for loss in args.losses for n in args.mini_batches]
    pending = [(loss, n) for loss, n in plan if sweep.needs_run(loss, n)]
    results: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        for loss, n in plan:
            folder = run_dir(out, loss, n)
            returncode, seconds = None, None
            if (loss, n) in pending:
                done = pending.index((loss, n))
                print(f"[offpolicy] run {done + 1}/{len(pending)}: {loss} N={n} -> {folder}",
                      flush=True)  # fmt: skip
                returncode, seconds = sweep.run(loss, n)
            entry = run_entry(loss, n, args.steps, folder, args.last)
            if returncode:
                entry["status"] = f"failed (exit {returncode}, log {folder / 'run.log'})"
            entry["seconds"] = seconds or entry["seconds"]
            results.append(entry)
            (out / "results.json").write_text(
                json.dumps({"settings": _settings(args), "runs": results}, indent=2)
            )
            if returncode is not None:
                left = (time.perf_counter() - started) / (done + 1) * (len(pending) - done - 1)
                print(f"[offpolicy] {loss} N={n}: {entry['status']} in {seconds:.0f} s; "
                      f"about {left / 60:.0f} min left", flush=True)  # fmt: skip
    finally:
        sweep.close()
    print(markdown_table(results, args.last))
    if any(r["status"] == "ok" for r in results):
        print(f"figure: {plot_results(results, out / 'offpolicy.png', args.last)}")
    print(f"results: {out / 'results.json'}")


def _settings(args) -> dict[str, Any]:
    keys = ("losses", "mini_batches", "model", "steps", "prompts_per_batch",
            "samples_per_prompt", "learning_rate", "last", "passthrough")  # fmt: skip
    return {key: getattr(args, key) for key in keys}


if __name__ == "__main__":
    main()

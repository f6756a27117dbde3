"""Drain vs in-flight weight swaps on a generation-bound workload, side by side.

    python bench/swap_modes.py                       # tiny Llama, 96-token responses, 10 updates
    python bench/swap_modes.py --repeats 3           # 3 runs per mode, alternating order
    python bench/swap_modes.py --analyze-only        # recompute from the runs in --out

The same asynchronous run (`configs/tiny.py`, or `--model`: one step off-policy, weights
published after every update, long responses so that generating a batch takes longer than
learning from one: g > t) is run with its generator started in each swap mode
(`generator.swap_mode=drain` / `in-flight`, `python -m generator_service --swap-mode`). The
generator is pinned to `--cpus-generator`, the learner to `--cpus-learner`. Each run is a plain
`python -m jaxrlhf.main` in `{out}/{mode}-{repeat}` (what an earlier invocation left there is
deleted first); runs alternate the order of the modes from one repeat to the next.

Per run, means over the steady-state steps `warmup+1 .. steps` of metrics.jsonl:

- time per update: step_s;
- learner idle: wait_for_generation_s (waiting for the next batch) + weight_sync_s (the publish,
  which in drain mode returns only once the running generation has finished), and each part;
- generator idle: generator_idle_s, the seconds within the step during which the generator
  generated nothing (no request running, or paused for a swap; from GetStatus.idle_seconds), and
  generator_requests_mean, the requests it was generating on average;
- token staleness: token_staleness_mean, and mixed_version_fraction (samples that span a swap).

Over repeats: mean ± standard error of the per-run means, and the in-flight/drain ratio of the
means. Prints one JSON line, then a table; writes the JSON to `{out}/results.json`. Extra
`--config.KEY=VALUE` arguments go to every run.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

from jaxrlhf.experiments import config_file_for, log_tail, main_command, read_run, run_main

MODES = ("drain", "in-flight")
FIGURES = (
    ("time per update (s)", "step_s"),
    ("learner idle (s)", "learner_idle_s"),
    ("  waiting for a batch", "wait_for_generation_s"),
    ("  publishing", "weight_sync_s"),
    ("generator idle (s)", "generator_idle_s"),
    ("generator requests (mean)", "generator_requests_mean"),
    ("generation per batch (s)", "generate_s"),
    ("learning per batch (s)", "train_s"),
    ("token staleness (mean)", "token_staleness_mean"),
    ("samples spanning a swap", "mixed_version_fraction"),
)


def run_figures(records: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    window = [r for r in records if r["step"] > warmup]
    if len(window) < 2:
        raise ValueError(f"{len(records)} steps with --warmup={warmup}: run at least warmup + 2")
    out = {}
    for _, key in FIGURES:
        if key == "learner_idle_s":
            values = [r["wait_for_generation_s"] + r["weight_sync_s"] for r in window]
        else:
            values = [r[key] for r in window]
        out[key] = sum(values) / len(values)
    return out


def summarize(per_run: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Mean and standard error over the runs of each mode, and in-flight / drain."""
    out: dict[str, Any] = {}
    for mode, runs in per_run.items():
        out[mode] = {}
        for _, key in FIGURES:
            values = [run[key] for run in runs]
            mean = sum(values) / len(values)
            spread = (
                math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))
                if len(values) > 1
                else float("nan")
            )
            out[mode][key] = {"mean": mean, "stderr": spread, "runs": values}
    out["ratio"] = {
        key: out["in-flight"][key]["mean"] / out["drain"][key]["mean"]
        if out["drain"][key]["mean"]
        else float("nan")
        for _, key in FIGURES
    }
    return out


def table(result: dict[str, Any]) -> str:
    def cell(figure: dict[str, Any]) -> str:
        if math.isnan(figure["stderr"]):
            return f"{figure['mean']:.3f}"
        return f"{figure['mean']:.3f} ± {figure['stderr']:.3f}"

    lines = [f"{'':<28}{'drain':>18}{'in-flight':>18}{'in-flight/drain':>17}"]
    for label, key in FIGURES:
        lines.append(
            f"{label:<28}{cell(result['drain'][key]):>18}{cell(result['in-flight'][key]):>18}"
            f"{result['ratio'][key]:>17.3f}"
        )
    return "\n".join(lines)


def overrides_for(args, mode: str, folder: Path) -> dict[str, Any]:
    overrides: dict[str, Any] = {
        "output_dir": str(folder),
        "generator.swap_mode": mode,
        "generator.in_flight_kv": args.in_flight_kv,
        "max_staleness": args.max_staleness,
        "sync_every": 1,
        "num_mini_batches": 0,
        "total_steps": args.steps,
        "checkpoint.every": args.steps,
        "export": False,
        "eval.every": 0,
        "eval.at_start": False,
        "eval.at_end": False,
        "rollout.max_response_tokens": args.max_response_tokens,
        "rollout.prompts_per_batch": args.prompts_per_batch,
        "generator.max_model_len": 64 + args.max_response_tokens,
    }
    if args.cpus_generator:
        overrides["generator.cpus"] = args.cpus_generator
    if args.cpus_learner:
        overrides["learner_cpus"] = args.cpus_learner
    if args.model not in ("smollm2", "tiny"):
        overrides["model.path"] = args.model
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2, or a model folder")
    parser.add_argument("--steps", type=int, default=10, help="updates per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--max-response-tokens", type=int, default=96)
    parser.add_argument("--prompts-per-batch", type=int, default=8)
    parser.add_argument("--in-flight-kv", default="keep", choices=("keep", "recompute"))
    parser.add_argument("--cpus-generator", default="1")
    parser.add_argument("--cpus-learner", default="0")
    parser.add_argument("--out", default="runs/swap_modes", help="folder for the runs")
    parser.add_argument("--analyze-only", action="store_true")
    args, extra = parser.parse_known_args()
    unknown = [a for a in extra if not a.startswith("--config.")]
    if unknown:
        parser.error(f"unknown arguments {unknown} (only --config.KEY=VALUE pass through)")
    passthrough = dict(a.removeprefix("--config.").split("=", 1) for a in extra)
    out = Path(args.out).resolve()
    config_file = config_file_for(args.model)
    per_run: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            folder = out / f"{mode}-{repeat}"
            log = folder / "run.log"
            if not args.analyze_only:
                shutil.rmtree(folder, ignore_errors=True)
                print(f"[swap_modes] {mode} run {repeat + 1}/{args.repeats}, log: {log}",
                      flush=True)  # fmt: skip
                overrides = {**overrides_for(args, mode, folder), **passthrough}
                returncode, _ = run_main(main_command(config_file, overrides), log)
                if returncode != 0:
                    sys.exit(f"the {mode} run failed ({returncode}):\n{log_tail(log)}")
            records, _ = read_run(folder)
            per_run[mode].append(run_figures(records, args.warmup))
    result = {
        "model": args.model,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "max_staleness": args.max_staleness,
        "max_response_tokens": args.max_response_tokens,
        "prompts_per_batch": args.prompts_per_batch,
        "in_flight_kv": args.in_flight_kv,
        **summarize(per_run),
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    print(table(result))


if __name__ == "__main__":
    main()

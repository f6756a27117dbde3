"""Synchronous, one-step-off batch at a time, and continuous in-flight generation, side by side.

    python bench/pipeline_modes.py --workload long-tail   # tiny Llama, heavy-tailed lengths
    python bench/pipeline_modes.py --workload default     # the offline default (SmolLM2)
    python bench/pipeline_modes.py --workload balanced    # SmolLM2 with g about t
    python bench/pipeline_modes.py --workload bed --modes sync,continuous,continuous-grouped
    python bench/pipeline_modes.py --analyze-only         # recompute from the runs in --out

The same workload runs once per mode (`--modes`) and repeat (`--repeats`; the order of the
modes rotates from one repeat to the next), each a plain `python -m jaxrlhf.main` in
`{out}/{mode}-{repeat}` (what an earlier invocation left there is deleted first), generator
pinned to `--cpus-generator` and learner to `--cpus-learner` (disjoint cores stand for separate
accelerators). Modes with the same swap setting share one generator service (`sync` and
`one-step-off` both drain; one service at a time, so a repeat whose order returns to a setting
starts its service again), or run against the running service `--generators` gives for it
(`drain=HOST:PORT,in-flight-keep=HOST:PORT`; jaxrlhf/experiments/services.py):

- `sync`: max_staleness 0, drain swaps, one Generate call per batch;
- `one-step-off`: max_staleness 1 (`--max-staleness`), drain swaps, one call per batch (the
  paper's async mode);
- `continuous`: max_staleness 1 (`--max-staleness`), in-flight swaps (KV kept),
  `rollout.continuous` (prompt by prompt, several batches in flight as the bound allows);
- `continuous-grouped` (only when `--modes` names it): the same with `--prompts-per-call`
  consecutive prompts a call (`rollout.prompts_per_call`, default 8).

Workloads (`--workload`; extra `--config.KEY=VALUE` arguments go to every run):

- `default`: `configs/default.py` as `make run` trains it (SmolLM2-135M, arithmetic,
  8 prompts x 4 samples): learner-bound.
- `balanced`: the default with generation made as long as learning (g ≈ t, where a one-step
  overlap could double the update rate): every response exactly 16 tokens
  (`rollout.min_response_tokens=16`, the default `max_response_tokens`; no missing-EOS penalty,
  so rewards still come from the answer) and an engine capacity of 2 sequences
  (`generator.max_num_seqs=2`, a sixteenth of a batch). How g and t were matched: a sync run
  of this workload with a capacity of 4 measured g 15.7-16.5 s and t 32-34 s (steps 3-4, the
  learner compiled), and g grows with the rounds of sequences the capacity allows while t does
  not depend on it, so a capacity of 2 doubles g to about t. The sync runs of the bench measure
  both (printed as the ideal).
- `bed`: `configs/bed.py`, the claims' test bed (64 prompts x 8 samples of answers about 4
  tokens long): a batch is many tiny calls in continuous generation, one in the others.
- `long-tail`: `configs/tiny.py` on the tiny Llama with 1024 positions (`model.path=tiny-long`),
  each prompt's response budget drawn from a Pareto law of shape 1.0 and minimum 32 tokens,
  capped at 448 (`rollout.length_law=pareto:1.0:32`; P(a budget reaches the cap) = 32/448; the
  median is 64; the random model also ends a response by sampling EOS, ~1/384 per token), 8
  prompts x 2 samples, engine capacity 4 sequences (`generator.max_num_seqs`, a quarter of a
  batch): generation-bound, the engine the bottleneck. Measured with `--max-staleness 2`
  (BENCHMARKS.md): a batch at a time cannot use a bound beyond one batch ahead, continuous
  generation can.

Per run, means over steps `warmup+1 .. steps-1` of metrics.jsonl (the last step is left out:
nothing is generated after it); per mode, the mean ± standard error of those over the repeats
(rates: repeat by repeat, then mean ± s.e.):

- time per update: step_s, and the update rate relative to sync (sync's ÷ this mode's);
- the ideal: (g + t) / max(g, t) from the sync run, where g = generate_s and t = step_s −
  wait_for_generation_s (there generation and learning never overlap, so each is alone);
  efficiency = rate ÷ ideal;
- generator_occupancy (requests generating ÷ capacity), learner_idle_fraction (waiting for a
  batch ÷ step), token staleness mean and max (over the window's steps);
- the publish's seconds (weight_sync_s) and the learner's wait on it (publish_blocked_s: with
  `generator.publish_in_background`, the default, a publish runs beside the next step).

Prints one JSON line, then a table; writes the JSON to `{out}/results.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ as a package
from bench.flags import add_timed_run_arguments, parse_timed_run_args  # noqa: E402
from jaxrlhf.experiments import (
    config_file_for,
    placement_overrides,
    read_run,
    timed_run_overrides,
)
from jaxrlhf.experiments.services import run_side_by_side
from jaxrlhf.experiments.stats import mean_stderr

MODES = {  # name -> overrides
    "sync": {"max_staleness": 0, "generator.swap_mode": "drain", "rollout.continuous": False},
    "one-step-off": {
        "max_staleness": 1, "generator.swap_mode": "drain", "rollout.continuous": False,
    },
    "continuous": {
        "max_staleness": 1, "generator.swap_mode": "in-flight", "generator.in_flight_kv": "keep",
        "rollout.continuous": True,
    },
}  # fmt: skip
MODES["continuous-grouped"] = MODES["continuous"]  # + rollout.prompts_per_call (overrides_for)
DEFAULT_MODES = ("sync", "one-step-off", "continuous")
WORKLOADS = {  # name -> (model, overrides)
    "default": ("smollm2", {}),
    "bed": ("bed", {}),
    "balanced": (
        "smollm2",
        {
            "rollout.min_response_tokens": 16,
            "loss_params.missing_eos_penalty": False,
            "generator.max_num_seqs": 2,
        },
    ),
    "long-tail": (
        "tiny",
        {
            "model.path": "tiny-long",
            "rollout.length_law": "pareto:1.0:32",
            "rollout.max_response_tokens": 448,
            "rollout.prompts_per_batch": 8,
            "generator.max_model_len": 512,
            "generator.max_num_seqs": 4,
        },
    ),
}
FIGURES = (  # (label, key, how the window's steps are combined)
    ("time per update (s)", "step_s", "mean"),
    ("generation per batch (s)", "generate_s", "mean"),
    ("generator occupancy", "generator_occupancy", "mean"),
    ("learner idle fraction", "learner_idle_fraction", "mean"),
    ("publish (s)", "weight_sync_s", "mean"),
    ("learner waiting on publish (s)", "publish_blocked_s", "mean"),
    ("token staleness (mean)", "token_staleness_mean", "mean"),
    ("token staleness (max)", "token_staleness_max", "max"),
)


def run_figures(records: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    last = max(r["step"] for r in records)
    window = [r for r in records if warmup < r["step"] < last]
    if not window:
        raise ValueError(f"{len(records)} steps with --warmup={warmup}: run at least warmup + 2")
    out: dict[str, float] = {}
    for _, key, how in FIGURES:
        values = [r[key] for r in window if key in r]
        out[key] = (max(values) if how == "max" else sum(values) / len(values)) if values else 0.0
    out["learner_s"] = sum(r["step_s"] - r["wait_for_generation_s"] for r in window) / len(window)
    return out


def compare(per_run: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Per mode: each figure's mean over the repeats (`{key}_stderr` beside it), the update
    rate relative to sync (per repeat: sync's step_s ÷ this mode's, then mean ± s.e.), the ideal
    from the sync runs, efficiency; continuous ÷ one-step-off and continuous-grouped ÷
    continuous the same way."""
    per_mode = {mode: _means(runs) for mode, runs in per_run.items()}
    sync = per_mode["sync"]
    g, t = sync["generate_s"], sync["learner_s"]
    ideal = (g + t) / max(g, t)
    out: dict[str, Any] = {"ideal_speedup": ideal, "sync_generate_s": g, "sync_learner_s": t}
    for mode, figures in per_mode.items():
        rate, rate_stderr = _rate(per_run["sync"], per_run[mode])
        out[mode] = {**figures, "rate_vs_sync": rate, "rate_vs_sync_stderr": rate_stderr,
                     "efficiency": rate / ideal, "repeats": len(per_run[mode])}  # fmt: skip
    for base, mode in (("one-step-off", "continuous"), ("continuous", "continuous-grouped")):
        if base in per_run and mode in per_run:
            key = f"{mode}_vs_{base}".replace("-", "_")
            out[key], out[f"{key}_stderr"] = _rate(per_run[base], per_run[mode])
    return out


def _means(runs: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in runs[0]:
        out[key], out[f"{key}_stderr"] = mean_stderr([run[key] for run in runs])
    return out


def _rate(base: list[dict[str, float]], other: list[dict[str, float]]) -> tuple[float, float]:
    """Mean ± s.e. over repeats of base's step_s ÷ other's, repeat by repeat."""
    return mean_stderr([b["step_s"] / o["step_s"] for b, o in zip(base, other, strict=True)])


def _cell(value: float, stderr: float) -> str:
    return f"{value:.3f}" if math.isnan(stderr) else f"{value:.3f} ± {stderr:.3f}"


def table(result: dict[str, Any], modes: list[str]) -> str:
    lines = [f"{'':<28}" + "".join(f"{m:>18}" for m in modes)]
    rows = [(label, key) for label, key, _ in FIGURES]
    rows += [("update rate / sync", "rate_vs_sync"), ("efficiency (÷ ideal)", "efficiency")]
    for label, key in rows:
        cells = [_cell(result[m][key], result[m].get(f"{key}_stderr", math.nan)) for m in modes]
        lines.append(f"{label:<28}" + "".join(f"{c:>18}" for c in cells))
    g, t = result["sync_generate_s"], result["sync_learner_s"]
    lines.append(f"ideal speedup (g + t) / max(g, t) from sync: {result['ideal_speedup']:.3f} "
                 f"(g {g:.2f} s, t {t:.2f} s)")  # fmt: skip
    for base, mode in (("one-step-off", "continuous"), ("continuous", "continuous-grouped")):
        key = f"{mode}_vs_{base}".replace("-", "_")
        if key in result:
            ratio = _cell(result[key], result[f"{key}_stderr"])
            lines.append(f"{mode} / {base} update rate: {ratio}")
    lines.append(f"repeats per mode: {result[modes[0]]['repeats']}")
    return "\n".join(lines)


def overrides_for(args, mode: str, folder: Path, workload: dict[str, Any]) -> dict[str, Any]:
    return {
        **timed_run_overrides(folder, args.steps),
        **workload,
        **MODES[mode],
        **({"max_staleness": args.max_staleness} if mode != "sync" else {}),
        **(
            {"rollout.prompts_per_call": args.prompts_per_call}
            if mode == "continuous-grouped"
            else {}
        ),  # fmt: skip
        **placement_overrides(args.model, args.cpus_generator, args.cpus_learner),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="long-tail", choices=list(WORKLOADS))
    add_timed_run_arguments(parser, model="", out="runs/pipeline_modes", generators=True)
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode (the order of "
                        "the modes rotates from one repeat to the next)")  # fmt: skip
    parser.add_argument("--max-staleness", type=int, default=1, help="of the asynchronous "
                        "modes (sync: 0)")  # fmt: skip
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help="sync first, then any "
                        f"of {list(MODES)[1:]}")  # fmt: skip
    parser.add_argument("--prompts-per-call", type=int, default=8, help="continuous-grouped's "
                        "prompts per Generate call (rollout.prompts_per_call)")  # fmt: skip
    args, passthrough, given = parse_timed_run_args(parser)
    model, workload = WORKLOADS[args.workload]
    args.model = args.model or model
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if modes[:1] != ["sync"] or not set(modes) <= set(MODES):
        parser.error(f"--modes: sync first, then any of {list(MODES)[1:]}")
    out = Path(args.out).resolve()
    config_file = config_file_for(args.model)
    per_run = run_side_by_side(
        f"pipeline_modes {args.workload}", modes, args.repeats, out, config_file, given,
        lambda mode, folder: {**overrides_for(args, mode, folder, workload), **passthrough},
        lambda folder: run_figures(read_run(folder)[0], args.warmup), args.analyze_only,
    )  # fmt: skip
    result = {
        "workload": args.workload,
        "model": args.model,
        "steps": args.steps,
        "warmup": args.warmup,
        "modes": modes,
        "overrides": {**workload, **passthrough},
        "repeats": args.repeats,
        "prompts_per_call": args.prompts_per_call,
        **compare(per_run),
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    print(table(result, modes))


if __name__ == "__main__":
    main()

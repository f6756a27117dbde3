"""Drain vs in-flight weight swaps on a generation-bound workload, side by side.

    python bench/swap_modes.py                       # tiny Llama, 96-token responses, 10 updates
    python bench/swap_modes.py --repeats 3           # 3 runs per variant, alternating order
    python bench/swap_modes.py --analyze-only        # recompute from the runs in --out

The same asynchronous run (`configs/tiny.py`, or `--model`: one step off-policy, weights
published after every update, long responses so that generating a batch takes longer than
learning from one: g > t) is run with its generator in each variant (`--variants`): `drain`,
`in-flight-keep` and `in-flight-recompute` (`generator.swap_mode`, `generator.in_flight_kv`;
`python -m generator_service --swap-mode --in-flight-kv`), with preloaded swaps (the default),
and `drain-no-preload`, `in-flight-keep-no-preload` loading each update in the pause
(`generator.preload=false`, `--no-preload`). A variant's runs share one service,
started by its first run, or the running one `--generators` gives for it
(`drain=HOST:PORT,...`; jaxrlhf/experiments/services.py). The
generator is pinned to `--cpus-generator`, the learner to `--cpus-learner`. Each run is a plain
`python -m jaxrlhf.main` in `{out}/{variant}-{repeat}` (what an earlier invocation left there is
deleted first); the order of the variants rotates from one repeat to the next.

Per run, means over the steady-state steps `warmup+1 .. steps-1` of metrics.jsonl (the last
step is left out: no batch is generated after it, so its publish never waits in any mode):

- time per update: step_s;
- learner idle: wait_for_generation_s (waiting for the next batch) + publish_blocked_s (waiting
  on the publish, which in drain mode returns only once the running generation has finished;
  weight_sync_s in records older than it), and each part, with the publish's own seconds
  (weight_sync_s: with `generator.publish_in_background` it runs beside the learner's step);
- generator idle: generator_idle_s, the seconds within the step during which the generator
  generated nothing (no request running, or paused for a swap; from GetStatus.idle_seconds),
  of which generator_pause_s paused for the swaps of the step's publishes, and
  generator_requests_mean, the requests it was generating on average, and generator_occupancy,
  that mean ÷ its capacity (max_num_seqs);
- token staleness: token_staleness_mean, and mixed_version_fraction (samples that span a swap).

Over repeats: mean ± standard error of the per-run means, and each variant's ratio of means to
drain's. Prints one JSON line, then a table; writes the JSON to `{out}/results.json`. Extra
`--config.KEY=VALUE` arguments go to every run.
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
from jaxrlhf.experiments.services import SWAP_SETTINGS, run_side_by_side

# name -> (generator.swap_mode, generator.in_flight_kv, generator.preload)
VARIANTS = {
    **{name: (*setting, True) for name, setting in SWAP_SETTINGS.items()},
    "drain-no-preload": ("drain", "keep", False),
    "in-flight-keep-no-preload": ("in-flight", "keep", False),
}
FIGURES = (
    ("time per update (s)", "step_s"),
    ("learner idle (s)", "learner_idle_s"),
    ("  waiting for a batch", "wait_for_generation_s"),
    ("  waiting on publishing", "publish_blocked_s"),
    ("publish (s)", "weight_sync_s"),
    ("generator idle (s)", "generator_idle_s"),
    ("  paused for swaps", "generator_pause_s"),
    ("generator requests (mean)", "generator_requests_mean"),
    ("generator occupancy", "generator_occupancy"),
    ("generation per batch (s)", "generate_s"),
    ("learning per batch (s)", "train_s"),
    ("token staleness (mean)", "token_staleness_mean"),
    ("samples spanning a swap", "mixed_version_fraction"),
)


def _blocked(record: dict[str, Any]) -> float:
    """The learner's wait on publishing (weight_sync_s in records older than the field)."""
    return record.get("publish_blocked_s", record["weight_sync_s"])


def run_figures(records: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    last = max(r["step"] for r in records)
    window = [r for r in records if warmup < r["step"] < last]
    if not window:
        raise ValueError(f"{len(records)} steps with --warmup={warmup}: run at least warmup + 2")
    out = {}
    for _, key in FIGURES:
        if key == "learner_idle_s":
            values = [r["wait_for_generation_s"] + _blocked(r) for r in window]
        elif key == "publish_blocked_s":
            values = [_blocked(r) for r in window]
        else:
            values = [r[key] for r in window]
        out[key] = sum(values) / len(values)
    return out


def summarize(per_run: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Mean and standard error over the runs of each variant, and its ratio to drain's."""
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
    drain = out["drain"]
    out["ratio_to_drain"] = {
        variant: {
            key: out[variant][key]["mean"] / drain[key]["mean"]
            if drain[key]["mean"]
            else float("nan")
            for _, key in FIGURES
        }
        for variant in per_run
        if variant != "drain"
    }
    return out


def table(result: dict[str, Any]) -> str:
    def cell(figure: dict[str, Any]) -> str:
        if math.isnan(figure["stderr"]):
            return f"{figure['mean']:.3f}"
        return f"{figure['mean']:.3f} ± {figure['stderr']:.3f}"

    variants = [v for v in VARIANTS if v in result]
    lines = [f"{'':<28}" + "".join(f"{v:>21}" for v in variants)]
    for label, key in FIGURES:
        lines.append(f"{label:<28}" + "".join(f"{cell(result[v][key]):>21}" for v in variants))
    for variant, ratios in result["ratio_to_drain"].items():
        lines.append(
            f"{variant} / drain: time per update {ratios['step_s']:.3f}, learner idle "
            f"{ratios['learner_idle_s']:.3f}, generator idle {ratios['generator_idle_s']:.3f}, "
            f"token staleness {ratios['token_staleness_mean']:.3f}"
        )
    return "\n".join(lines)


def overrides_for(args, variant: str, folder: Path) -> dict[str, Any]:
    swap_mode, in_flight_kv, preload = VARIANTS[variant]
    overrides: dict[str, Any] = {
        **timed_run_overrides(folder, args.steps),
        "generator.swap_mode": swap_mode,
        "generator.in_flight_kv": in_flight_kv,
        "generator.preload": preload,
        "max_staleness": args.max_staleness,
        "rollout.max_response_tokens": args.max_response_tokens,
        "rollout.prompts_per_batch": args.prompts_per_batch,
        "generator.max_model_len": 64 + args.max_response_tokens,
        **placement_overrides(args.model, args.cpus_generator, args.cpus_learner),
    }
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_timed_run_arguments(parser, model="tiny", out="runs/swap_modes", generators=True)
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--max-response-tokens", type=int, default=96)
    parser.add_argument("--prompts-per-batch", type=int, default=8)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"among {', '.join(VARIANTS)}; drain first"
    )
    args, passthrough, given = parse_timed_run_args(parser)
    out = Path(args.out).resolve()
    config_file = config_file_for(args.model)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if variants[:1] != ["drain"] or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants: drain first, then any of {list(VARIANTS)[1:]}")
    per_run = run_side_by_side(
        "swap_modes", variants, args.repeats, out, config_file, given,
        lambda variant, folder: {**overrides_for(args, variant, folder), **passthrough},
        lambda folder: run_figures(read_run(folder)[0], args.warmup), args.analyze_only,
    )  # fmt: skip
    result = {
        "model": args.model,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "max_staleness": args.max_staleness,
        "max_response_tokens": args.max_response_tokens,
        "prompts_per_batch": args.prompts_per_batch,
        "variants": variants,
        **summarize(per_run),
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    print(table(result))


if __name__ == "__main__":
    main()

"""Synchronous vs asynchronous RLHF on one workload: ideal and achieved speedup, side by side.

    python bench/async_speedup.py                          # SmolLM2-135M, arithmetic, 10 updates
    python bench/async_speedup.py --model tiny --steps 6   # the tiny random Llama: a quick check
    python bench/async_speedup.py --analyze-only           # recompute from the runs in --out

One workload (the offline default's model and task, `configs/default.py`; `configs/tiny.py`
for `--model tiny`) is run twice in one invocation, `--steps` updates each: synchronously
(`max_staleness=0`) and one step off-policy asynchronously (`max_staleness=1`), weights published
after every update. The generator service is pinned to `--cpus-generator` and the learner to
`--cpus-learner` (disjoint cores stand for separate accelerators). Each run is a plain
`python -m jaxrlhf.main` in `{out}/sync` and `{out}/async` (log: `run.log`; what an earlier
invocation left there is deleted first); checkpoints are written only at the end and no
`hf_export/`, so neither run pays for them inside the loop.

How each figure is computed (per-step keys of metrics.jsonl):

- Window: the steady state, steps `warmup+1 .. steps` (`--warmup`, default 2: step 1 compiles the
  learner's jitted functions, and in async mode step 2 finds its batch generated during step 1's
  compilation). The same window for both runs; every figure below is a mean over it.
- Generation time per batch g_i = tokens_i / generation_tokens_per_s_i, where tokens_i =
  response_length_mean_i × prompts_per_batch × samples_per_prompt is exactly the batch's
  generated tokens and generation_tokens_per_s_i = tokens_i / the producer's wall time of the
  batch's Generate call, so g_i is that wall time (the records hold no per-batch generation
  seconds; when a record has `generate_s`, it is used as is).
- Learner time per update t_i = step_s_i − wait_for_generation_s_i: everything the learner does
  for one update (scoring, `prepare_s`: reference/behaviour log-probs and loss inputs, `train_s`,
  publishing), i.e. the step without waiting.
- g and t are the sync run's means: there the generator and the learner never run at the same
  time, so each is measured alone.
- Ideal speedup = (g + t) / max(g, t): a synchronous step costs g + t, a perfectly overlapped
  asynchronous one max(g, t).
- Achieved speedup = mean step_s of the sync run / mean step_s of the async run (same window).
  (`loop_speedup` = the ratio of the runs' whole-loop `wall_seconds`, compilation included, is
  reported beside it.)
- Efficiency = achieved / ideal. It can exceed 1 slightly: the sync step also pays the hand-off
  from "weights published" to "generation started" (`sync.handoff_s` = wait − g), which the
  ideal model leaves out.
- Weight-sync share = the learner's mean publishing time / mean step_s, per run (also the largest
  per-step share), where the learner's publishing time is `publish_blocked_s` (with
  `generator.publish_in_background`, the publish runs beside the next step and the learner only
  waits for one still running; records older than it: `weight_sync_s`).
- Where the time went (printed when efficiency < 0.9, recorded always): the async step exceeds
  its ideal max(g, t) by `learner_slowdown_s` (the async run's t minus the sync run's t: the
  learner slowed by generation running beside it, weight sync included) plus `extra_wait_s` (the
  async run's mean wait minus the max(0, g − t) the ideal overlap leaves); the async run's own
  g shows whether generation itself slowed. Each learner phase is listed for both runs.
- Quality (one seed; the paired comparison over seeds is `python -m
  jaxrlhf.experiments.async_vs_sync`): reward = mean reward_mean over the last `--last` steps
  (default 5); greedy accuracy on the test split from summary.json (`test_accuracy_start`,
  `test_accuracy_end`, n = `test_prompts`). "Within noise": |Δ accuracy_end| ≤ 1.96 ·
  sqrt(2 p(1 − p) / n), the 95% band of the difference of two accuracies on the same n test
  prompts (p = their mean) — evaluation sampling noise only, not the seed-to-seed spread.
- Target: efficiency ≥ 0.9 and the accuracy within noise.

Prints one JSON line with every figure, then a table; writes the JSON to `{out}/results.json`.
Extra `--config.KEY=VALUE` arguments are passed to both runs.

Runtime on the 2-core CPU machine, measured: 907 s (sync) + 820 s (async) for SmolLM2 with the
defaults (~70 s per update on one core each, engine start and compilation included; results in
BENCHMARKS.md); `--model tiny --steps 5` took 160 s + 134 s.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ as a package
from bench.flags import add_timed_run_arguments, parse_timed_run_args  # noqa: E402
from jaxrlhf.experiments import (
    config_file_for,
    load_config,
    log_tail,
    main_command,
    placement_overrides,
    read_run,
    run_main,
    timed_run_overrides,
)

MODES = {"sync": 0, "async": 1}  # mode -> max_staleness
TARGET_EFFICIENCY = 0.9


def generation_seconds(record: dict[str, Any], rows_per_batch: int) -> float:
    """Wall time of the batch's Generate call (see the module docstring)."""
    if "generate_s" in record:
        return float(record["generate_s"])
    tokens = record["response_length_mean"] * rows_per_batch
    return tokens / record["generation_tokens_per_s"]


def steady_window(records: Sequence[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    window = [r for r in records if r["step"] > warmup]
    if len(window) < 2:
        raise ValueError(
            f"{len(records)} steps with --warmup={warmup} leave {len(window)} steady-state "
            f"step(s): run at least warmup + 2 steps"
        )
    return window


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def learner_publish_s(record: dict[str, Any]) -> float:
    """The seconds of the step the learner spent publishing: publish_blocked_s (a publish in
    the background costs the learner only its wait), weight_sync_s in older records."""
    return record.get("publish_blocked_s", record["weight_sync_s"])


def mode_figures(
    records: Sequence[dict[str, Any]], rows_per_batch: int, warmup: int
) -> dict[str, Any]:
    """One run's means over its steady-state window (seconds per update)."""
    window = steady_window(records, warmup)
    step = _mean(r["step_s"] for r in window)
    wait = _mean(r["wait_for_generation_s"] for r in window)
    parts = {k: _mean(r[k] for r in window) for k in ("prepare_s", "train_s")}
    parts["weight_sync_s"] = _mean(learner_publish_s(r) for r in window)
    learner = step - wait
    return {
        "window": [window[0]["step"], window[-1]["step"]],
        "step_s": step,
        "wait_for_generation_s": wait,
        "learner_s": learner,
        **parts,
        # scoring, rollout → arrays, bookkeeping: the rest of the learner's step
        "other_s": learner - sum(parts.values()),
        "generation_s": _mean(generation_seconds(r, rows_per_batch) for r in window),
        "weight_sync_share": parts["weight_sync_s"] / step,
        "weight_sync_share_max": max(learner_publish_s(r) / r["step_s"] for r in window),
    }


def speedup_figures(
    sync_records: Sequence[dict[str, Any]],
    async_records: Sequence[dict[str, Any]],
    rows_per_batch: int,
    warmup: int,
) -> dict[str, Any]:
    """Ideal and achieved speedup, efficiency and where the time went (module docstring)."""
    sync = mode_figures(sync_records, rows_per_batch, warmup)
    asyn = mode_figures(async_records, rows_per_batch, warmup)
    if sync["window"] != asyn["window"]:
        raise ValueError(
            f"the runs cover different steps (sync {sync['window']}, async {asyn['window']}): "
            f"compare runs of the same length"
        )
    sync["handoff_s"] = sync["wait_for_generation_s"] - sync["generation_s"]
    g, t = sync["generation_s"], sync["learner_s"]
    ideal = (g + t) / max(g, t)
    achieved = sync["step_s"] / asyn["step_s"]
    return {
        "generation_s": g,
        "learner_s": t,
        "ideal_speedup": ideal,
        "achieved_speedup": achieved,
        "efficiency": achieved / ideal,
        "ideal_async_step_s": max(g, t),
        "learner_slowdown_s": asyn["learner_s"] - t,
        "extra_wait_s": asyn["wait_for_generation_s"] - max(0.0, g - t),
        "generation_slowdown_s": asyn["generation_s"] - g,
        "sync": sync,
        "async": asyn,
    }


def accuracy_noise(p_a: float, p_b: float, n: int) -> float:
    """Half-width of the 95% band of the difference of two accuracies on n prompts each."""
    p = (p_a + p_b) / 2
    return 1.96 * math.sqrt(2 * p * (1 - p) / n)


def quality_figures(
    runs: dict[str, tuple[Sequence[dict[str, Any]], dict[str, Any]]], last: int
) -> dict[str, Any]:
    """Final reward and test accuracy of each run, and whether async is within noise."""
    out: dict[str, Any] = {}
    for mode, (records, summary) in runs.items():
        tail = list(records)[-last:]
        out[mode] = {
            "reward_last": _mean(r["reward_mean"] for r in tail),
            "kl_last": _mean(r["kl"] for r in tail) if all("kl" in r for r in tail) else None,
            "test_accuracy_start": summary.get("test_accuracy_start"),
            "test_accuracy_end": summary.get("test_accuracy_end"),
            "test_prompts": summary.get("test_prompts"),
        }
    a, b = out["sync"]["test_accuracy_end"], out["async"]["test_accuracy_end"]
    if a is not None and b is not None:
        out["accuracy_difference"] = b - a
        out["accuracy_noise"] = accuracy_noise(a, b, out["sync"]["test_prompts"])
        out["within_noise"] = abs(b - a) <= out["accuracy_noise"] + 1e-12
    out["reward_difference"] = out["async"]["reward_last"] - out["sync"]["reward_last"]
    return out


def where_time_went(figures: dict[str, Any]) -> list[str]:
    """Sentences naming what kept the async step above its ideal max(g, t)."""
    sync, asyn = figures["sync"], figures["async"]
    excess = asyn["step_s"] - figures["ideal_async_step_s"]
    lines = [
        f"async step {asyn['step_s']:.2f} s vs ideal max(g, t) = "
        f"{figures['ideal_async_step_s']:.2f} s: {excess:+.2f} s per update, of which"
    ]
    lines.append(
        f"  learner slower beside generation: {figures['learner_slowdown_s']:+.2f} s "
        f"(t {sync['learner_s']:.2f} -> {asyn['learner_s']:.2f} s)"
    )
    for key, label in (
        ("prepare_s", "prepare"),
        ("train_s", "train"),
        ("weight_sync_s", "weight sync"),
        ("other_s", "other (scoring, batching)"),
    ):
        change = asyn[key] - sync[key]
        lines.append(f"    {label}: {sync[key]:.2f} -> {asyn[key]:.2f} s ({change:+.2f})")
    lines.append(
        f"  waiting for generation beyond the ideal: {figures['extra_wait_s']:+.2f} s "
        f"(generation per batch g {sync['generation_s']:.2f} -> {asyn['generation_s']:.2f} s)"
    )
    return lines


def table(figures: dict[str, Any], quality: dict[str, Any]) -> str:
    sync, asyn = figures["sync"], figures["async"]
    rows = [
        ("time per update (s)", "step_s"),
        ("  waiting for generation", "wait_for_generation_s"),
        ("  learner (t)", "learner_s"),
        ("    prepare", "prepare_s"),
        ("    train", "train_s"),
        ("    weight sync", "weight_sync_s"),
        ("    other", "other_s"),
        ("generation per batch (g)", "generation_s"),
    ]
    lines = [f"{'steps ' + '..'.join(map(str, sync['window'])):<28}{'sync':>10}{'async':>10}"]
    lines += [f"{label:<28}{sync[key]:>10.2f}{asyn[key]:>10.2f}" for label, key in rows]
    lines.append(
        f"{'weight-sync share':<28}{sync['weight_sync_share']:>10.1%}"
        f"{asyn['weight_sync_share']:>10.1%}"
    )
    for label, key in (
        ("reward (last steps)", "reward_last"),
        ("test accuracy start", "test_accuracy_start"),
        ("test accuracy end", "test_accuracy_end"),
    ):
        a, b = quality["sync"][key], quality["async"][key]
        lines.append(f"{label:<28}{_cell(a):>10}{_cell(b):>10}")
    met = "met" if figures["efficiency"] >= TARGET_EFFICIENCY else "NOT met"
    lines.append(
        f"g = {figures['generation_s']:.2f} s, t = {figures['learner_s']:.2f} s: ideal speedup "
        f"{figures['ideal_speedup']:.3f}, achieved {figures['achieved_speedup']:.3f}, "
        f"efficiency {figures['efficiency']:.3f} (target >= {TARGET_EFFICIENCY}: {met})"
    )
    if "within_noise" in quality:
        lines.append(
            f"accuracy end: async - sync = {quality['accuracy_difference']:+.3f}, noise "
            f"+-{quality['accuracy_noise']:.3f}: "
            f"{'within noise' if quality['within_noise'] else 'OUTSIDE noise'}"
        )
    if figures["efficiency"] < TARGET_EFFICIENCY:
        lines += ["where the time went:", *where_time_went(figures)]
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def run_overrides(args, mode: str, out: Path) -> dict[str, Any]:
    overrides = timed_run_overrides(out / mode, args.steps, evaluate=True)
    overrides["max_staleness"] = MODES[mode]
    overrides |= placement_overrides(args.model, args.cpus_generator, args.cpus_learner)
    for flag, key in (
        ("prompts_per_batch", "rollout.prompts_per_batch"),
        ("samples_per_prompt", "rollout.samples_per_prompt"),
        ("max_response_tokens", "rollout.max_response_tokens"),
    ):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    return overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_timed_run_arguments(parser, model="smollm2", out="runs/async_speedup")
    parser.add_argument("--last", type=int, default=5, help="steps averaged for the reward")
    parser.add_argument("--prompts-per-batch", type=int)
    parser.add_argument("--samples-per-prompt", type=int)
    parser.add_argument("--max-response-tokens", type=int)
    args, passthrough, _ = parse_timed_run_args(parser)
    if not (args.cpus_generator and args.cpus_learner) or set(args.cpus_generator.split(",")) & set(
        args.cpus_learner.split(",")
    ):
        print("warning: generator and learner share cores; the speedup then measures contention")
    out = Path(args.out).resolve()
    config_file = config_file_for(args.model)
    config = load_config(config_file, {**run_overrides(args, "sync", out), **passthrough})
    rows_per_batch = config.rollout.prompts_per_batch * config.rollout.samples_per_prompt
    runs = {}
    for mode in MODES:
        overrides = {**run_overrides(args, mode, out), **passthrough}
        log = out / mode / "run.log"
        if not args.analyze_only:
            shutil.rmtree(out / mode, ignore_errors=True)  # this benchmark's earlier run of it
            print(f"[async_speedup] {mode} run ({args.steps} updates), log: {log}", flush=True)
            returncode, seconds = run_main(main_command(config_file, overrides), log)
            if returncode != 0:
                sys.exit(f"{mode} run failed (exit {returncode}); log tail:\n{log_tail(log)}")
            print(f"[async_speedup] {mode} run done in {seconds:.0f} s", flush=True)
        runs[mode] = read_run(out / mode)
    figures = speedup_figures(runs["sync"][0], runs["async"][0], rows_per_batch, args.warmup)
    quality = quality_figures(runs, args.last)
    walls = {mode: summary["wall_seconds"] for mode, (_, summary) in runs.items()}
    result = {
        "model": args.model,
        "config": str(config_file.relative_to(config_file.parents[1])),
        "steps": args.steps,
        "warmup": args.warmup,
        "rows_per_batch": rows_per_batch,
        "cpus_generator": args.cpus_generator,
        "cpus_learner": args.cpus_learner,
        "overrides": passthrough,
        **figures,
        "loop_seconds": walls,
        "loop_speedup": walls["sync"] / walls["async"],
        "quality": quality,
        "target_met": figures["efficiency"] >= TARGET_EFFICIENCY
        and quality.get("within_noise", False),
        "where_time_went": where_time_went(figures),
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    print(table(figures, quality))
    print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    main()

"""Checkpoint evaluation figures and training plots: pure metric functions (win rate against
reference responses under a gold reward model, perplexity under the SFT model, pass@1), a JSON
report built from them, and PNG figures of an evaluation and of a run's metrics.jsonl.

`python -m jaxrlhf.evaluate` generates the responses and scores; this module only computes and
draws. Figures use matplotlib's `Figure` directly (Agg canvas), never pyplot, so no display and no
global backend change.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Per-sample keys of `samples` that write_report draws from.
POLICY_SCORE = "policy_score"
REFERENCE_SCORE = "reference_score"
RESPONSE_LENGTH = "response_length"

# metrics.jsonl keys holding a step's duration: RL trainer (MetricsWriter), SFT stage.
_STEP_TIME_KEYS = ("step_s", "step_seconds")


def preference_outcomes(
    policy_scores: Sequence[float], reference_scores: Sequence[float], *, tie_tolerance: float = 0.0
) -> np.ndarray:
    """Per prompt: 1.0 if policy score > reference score, 0.5 on a tie (|Δ| <= tie_tolerance),
    0.0 otherwise."""
    policy = _vector(policy_scores, "policy_scores")
    reference = _vector(reference_scores, "reference_scores")
    _check_lengths({"policy_scores": len(policy), "reference_scores": len(reference)})
    if len(policy) == 0:
        raise ValueError("policy_scores and reference_scores are empty: nothing to compare")
    if tie_tolerance < 0:
        raise ValueError(f"tie_tolerance must be >= 0, got {tie_tolerance}")
    if not (np.all(np.isfinite(policy)) and np.all(np.isfinite(reference))):
        raise ValueError("scores must be finite; a NaN or inf score cannot be ranked")
    delta = policy - reference
    return np.where(np.abs(delta) <= tie_tolerance, 0.5, np.where(delta > 0, 1.0, 0.0))


def win_rate(
    policy_scores: Sequence[float], reference_scores: Sequence[float], *, tie_tolerance: float = 0.0
) -> tuple[float, float]:
    """(win rate, standard error) of policy vs reference responses under a gold reward model.

    Win rate = mean over prompts of the outcome (1 win, 0.5 tie, 0 loss; see preference_outcomes).
    Standard error = s / sqrt(n) with s the sample standard deviation (ddof=1) of the outcomes;
    NaN for a single prompt, where it is undefined.
    """
    outcomes = preference_outcomes(policy_scores, reference_scores, tie_tolerance=tie_tolerance)
    n = len(outcomes)
    stderr = float(outcomes.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    return float(outcomes.mean()), stderr


def perplexity(response_logprobs: Sequence[np.ndarray]) -> tuple[float, float]:
    """(perplexity, mean NLL per token), token-weighted over all responses.

    NLL = -Σ_responses Σ_tokens logp / Σ_responses num_tokens; perplexity = exp(NLL). Each array
    holds one response's per-token log-probs (natural log) under the SFT model, unpadded.
    """
    if len(response_logprobs) == 0:
        raise ValueError("perplexity needs at least one response, got none")
    total_logprob = 0.0
    total_tokens = 0
    for i, logprobs in enumerate(response_logprobs):
        array = np.asarray(logprobs, dtype=np.float64)
        if array.ndim != 1:
            raise ValueError(
                f"response {i} log-probs have shape {array.shape}, expected 1-D (one value per "
                "response token, padding removed)"
            )
        total_logprob += float(array.sum())
        total_tokens += array.size
    if total_tokens == 0:
        raise ValueError(f"all {len(response_logprobs)} responses are empty: no tokens to score")
    nll = -total_logprob / total_tokens
    return float(math.exp(nll)), float(nll)


def pass_at_1(correct: Sequence[bool | float]) -> float:
    """Mean per-prompt correctness: bools, or fractions in [0, 1] (share of k samples correct)."""
    values = _vector(correct, "correct")
    if len(values) == 0:
        raise ValueError("pass_at_1 needs at least one prompt, got none")
    if np.any((values < 0) | (values > 1)):
        raise ValueError("correct must hold bools or fractions in [0, 1]")
    return float(values.mean())


def build_report(
    *,
    response_lengths: Sequence[int],
    policy_scores: Sequence[float] | None = None,
    reference_scores: Sequence[float] | None = None,
    sft_logprobs: Sequence[np.ndarray] | None = None,
    correct: Sequence[bool | float] | None = None,
    extra: dict[str, Any] | None = None,
    tie_tolerance: float = 0.0,
) -> dict[str, Any]:
    """A JSON-serialisable summary of one checkpoint's evaluation, one entry per prompt in each
    input. Keys: num_prompts, response_length_mean, response_length_max; with scores also
    win_rate, win_rate_stderr (None for one prompt), gold_reward_policy_mean,
    gold_reward_reference_mean, ties; with sft_logprobs sft_perplexity, sft_nll_per_token; with
    correct pass_at_1; then `extra`, whose keys must not clash with these.
    """
    if (policy_scores is None) != (reference_scores is None):
        raise ValueError("give both policy_scores and reference_scores, or neither")
    lengths = _vector(response_lengths, "response_lengths")
    if len(lengths) == 0:
        raise ValueError("response_lengths is empty: no prompts were evaluated")
    given = {"response_lengths": len(lengths)}
    for name, values in (
        ("policy_scores", policy_scores),
        ("reference_scores", reference_scores),
        ("sft_logprobs", sft_logprobs),
        ("correct", correct),
    ):
        if values is not None:
            given[name] = len(values)
    _check_lengths(given)

    report: dict[str, Any] = {
        "num_prompts": len(lengths),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": _plain(np.max(np.asarray(response_lengths))),
    }
    if policy_scores is not None:
        rate, stderr = win_rate(policy_scores, reference_scores, tie_tolerance=tie_tolerance)
        outcomes = preference_outcomes(policy_scores, reference_scores, tie_tolerance=tie_tolerance)
        report.update(
            win_rate=rate,
            win_rate_stderr=None if math.isnan(stderr) else stderr,
            gold_reward_policy_mean=float(np.mean(policy_scores)),
            gold_reward_reference_mean=float(np.mean(reference_scores)),
            ties=int(np.sum(outcomes == 0.5)),
        )
    if sft_logprobs is not None:
        ppl, nll = perplexity(sft_logprobs)
        report.update(sft_perplexity=ppl, sft_nll_per_token=nll)
    if correct is not None:
        report["pass_at_1"] = pass_at_1(correct)
    for key, value in (extra or {}).items():
        if key in report:
            raise ValueError(f"extra key {key!r} clashes with a computed report key; rename it")
        report[key] = _plain(value)
    return report


def write_report(
    report: dict[str, Any],
    samples: list[dict[str, Any]],
    out_dir: str | Path,
    *,
    tie_tolerance: float = 0.0,
) -> dict[str, Path]:
    """Write out_dir/report.json (indent 2), out_dir/samples.jsonl (one line per sample dict, keys
    as given) and out_dir/report.png. The figure has the panels its samples allow: gold reward
    histograms (policy vs reference, from 'policy_score' / 'reference_score'), a histogram of
    'response_length', and win/tie/loss counts (samples with both scores). Returns
    {"report": ..., "samples": ..., "plot": ...} paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "report": out / "report.json",
        "samples": out / "samples.jsonl",
        "plot": out / "report.png",
    }
    paths["report"].write_text(json.dumps(report, indent=2, default=_plain) + "\n")
    with open(paths["samples"], "w") as f:
        for sample in samples:
            f.write(json.dumps(sample, default=_plain) + "\n")
    _report_figure(report, samples, tie_tolerance).savefig(paths["plot"], dpi=100)
    return paths


def plot_training(
    metrics_path: str | Path,
    out_png: str | Path,
    *,
    x: str = "step",
    eval_points: Sequence[tuple[int, float]] = (),
    window: int | None = None,
) -> Path:
    """PNG of a run's metrics.jsonl (jaxrlhf.rl.metrics.MetricsWriter): reward_mean with a trailing
    moving average of `window` steps (default ~1/10 of the run, at most 25), eval_accuracy where
    recorded plus `eval_points` (e.g. [(0, accuracy before training)]), and kl. Panels whose key no
    record has are left out. x: "step", or "time" for cumulative step time in minutes (from step_s
    or step_seconds).
    """
    path = Path(metrics_path)
    records = sorted(_read_jsonl(path), key=lambda r: r.get("step", 0))
    if not records:
        raise ValueError(f"{path} has no records: the run wrote no steps")
    x_of_step = _x_axis(records, x, path)
    x_label = "step" if x == "step" else "training time (min, sum of step times)"

    def series(key: str) -> tuple[np.ndarray, np.ndarray]:
        kept = [r for r in records if isinstance(r.get(key), (int, float))]
        return (
            np.array([x_of_step[r["step"]] for r in kept], dtype=float),
            np.array([r[key] for r in kept], dtype=float),
        )

    panels = []
    reward_x, reward = series("reward_mean")
    if len(reward):
        panels.append("reward")
    eval_x, eval_y = series("eval_accuracy")
    for step, value in eval_points:
        if step not in x_of_step:
            raise ValueError(f"eval point at step {step} has no record in {path} to place it on")
        eval_x, eval_y = np.append(eval_x, x_of_step[step]), np.append(eval_y, value)
    if len(eval_y):
        panels.append("eval")
    kl_x, kl = series("kl")
    if len(kl):
        panels.append("kl")
    if not panels:
        raise ValueError(
            f"{path} has none of reward_mean, eval_accuracy, kl; its keys: {sorted(records[0])}"
        )

    from matplotlib.ticker import MaxNLocator

    fig = _figure(len(panels))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels, strict=True):
        if panel == "reward":
            w = window or max(1, min(25, len(reward) // 10))
            ax.plot(reward_x, reward, color="tab:blue", alpha=0.35 if w > 1 else 1.0, lw=1,
                    label="per step")  # fmt: skip
            if w > 1:
                ax.plot(reward_x, moving_average(reward, w), color="tab:blue", lw=2,
                        label=f"moving average ({w} steps)")  # fmt: skip
                ax.legend(loc="best", fontsize="small")
            ax.set_ylabel("reward (mean)")
        elif panel == "eval":
            order = np.argsort(eval_x, kind="stable")
            ax.plot(eval_x[order], eval_y[order], "o-", color="tab:green")
            ax.set_ylabel("held-out accuracy")
        else:
            ax.plot(kl_x, kl, color="tab:red")
            ax.set_ylabel("KL to reference")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel(x_label)
    if x == "step":
        axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"Training run: {path.parent.name or path.name} ({len(records)} steps)")
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` values; the first window-1 points average what exists,
    so the curve starts at the first step."""
    if window < 1:
        raise ValueError(f"moving average window must be >= 1, got {window}")
    values = np.asarray(values, dtype=float)
    sums = np.cumsum(np.insert(values, 0, 0.0))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def _report_figure(report: dict[str, Any], samples: list[dict[str, Any]], tie_tolerance: float):
    policy = _sample_values(samples, POLICY_SCORE)
    reference = _sample_values(samples, REFERENCE_SCORE)
    lengths = _sample_values(samples, RESPONSE_LENGTH)
    paired = [
        s for s in samples if _number(s.get(POLICY_SCORE)) and _number(s.get(REFERENCE_SCORE))
    ]
    panels = [
        name
        for name, present in (("reward", policy or reference), ("length", lengths), ("wtl", paired))
        if present
    ]
    fig = _figure(max(len(panels), 1), horizontal=True)
    axes = fig.subplots(1, max(len(panels), 1), squeeze=False)[0]
    for ax, panel in zip(axes, panels, strict=False):
        if panel == "reward":
            bins = np.histogram_bin_edges(policy + reference, bins="auto")
            if policy:
                ax.hist(policy, bins=bins, alpha=0.5, color="tab:blue", label="policy")
            if reference:
                ax.hist(reference, bins=bins, alpha=0.5, color="tab:orange", label="reference")
            ax.set_xlabel("gold reward")
            ax.set_ylabel("responses")
            ax.legend(loc="best", fontsize="small")
        elif panel == "length":
            ax.hist(lengths, bins="auto", color="tab:purple")
            ax.set_xlabel("response length (tokens)")
            ax.set_ylabel("responses")
        else:
            outcomes = preference_outcomes(
                [s[POLICY_SCORE] for s in paired],
                [s[REFERENCE_SCORE] for s in paired],
                tie_tolerance=tie_tolerance,
            )
            counts = [int(np.sum(outcomes == v)) for v in (1.0, 0.5, 0.0)]
            bars = ax.bar(
                ["win", "tie", "loss"], counts, color=["tab:green", "tab:gray", "tab:red"]
            )
            ax.bar_label(bars)
            ax.set_ylabel("prompts")
            ax.set_title("policy vs reference")
    if not panels:
        axes[0].axis("off")
        axes[0].text(0.5, 0.5, "no per-sample scores or lengths to plot", ha="center")
    fig.suptitle(_headline(report))
    return fig


def _headline(report: dict[str, Any]) -> str:
    parts = [f"{report.get('num_prompts', '?')} prompts"]
    if report.get("win_rate") is not None:
        stderr = report.get("win_rate_stderr")
        parts.append(
            f"win rate {report['win_rate']:.3f}"
            + (f" ± {stderr:.3f}" if stderr is not None else "")
        )
    if report.get("sft_perplexity") is not None:
        parts.append(f"SFT perplexity {report['sft_perplexity']:.3g}")
    if report.get("pass_at_1") is not None:
        parts.append(f"pass@1 {report['pass_at_1']:.3f}")
    return ", ".join(parts)


def _figure(num_panels: int, horizontal: bool = False):
    from matplotlib.figure import Figure

    size = (4.5 * num_panels, 4.0) if horizontal else (8.0, 2.8 * num_panels + 0.8)
    return Figure(figsize=size, layout="constrained")


def _x_axis(records: list[dict[str, Any]], x: str, path: Path) -> dict[int, float]:
    """Map each step (and step 0) to its x coordinate."""
    if any("step" not in r for r in records):
        raise ValueError(f"{path} has records without a 'step' key")
    if x == "step":
        return {0: 0.0, **{r["step"]: float(r["step"]) for r in records}}
    if x != "time":
        raise ValueError(f"x must be 'step' or 'time', got {x!r}")
    key = next((k for k in _STEP_TIME_KEYS if all(k in r for r in records)), None)
    if key is None:
        raise ValueError(f"x='time' needs one of {_STEP_TIME_KEYS} on every record of {path}")
    minutes = np.cumsum([r[key] for r in records]) / 60.0
    return {0: 0.0, **{r["step"]: float(m) for r, m in zip(records, minutes, strict=True)}}


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _sample_values(samples: list[dict[str, Any]], key: str) -> list[float]:
    return [float(s[key]) for s in samples if _number(s.get(key))]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def _vector(values: Sequence[Any], name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} has shape {array.shape}, expected one value per prompt (1-D)")
    return array


def _check_lengths(lengths: dict[str, int]) -> None:
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{name}={n}" for name, n in lengths.items())
        raise ValueError(f"inputs must have one entry per prompt, got lengths {listed}")


def _plain(value: Any) -> Any:
    """numpy scalars and arrays to Python numbers and lists, for json."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value

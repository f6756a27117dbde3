"""The checks a soak (`bench/soak.py`) ends with: pure functions of what the runs logged and what
the sampler saw, each returning a `Check` that says what was measured.

What "equal to an undisturbed run" can mean under failover, with seeded generation
(`rollout.seeded`): a batch's samples depend on (seed, batch, weights) and on which replica
slot and failover round generated each prompt (`GeneratorPool._part_sampling`). A replica that
is down, hung past its deadline or rejoining changes that split, so from the first batch a
replica fault touches, samples, rewards, losses and weights differ from the undisturbed run's.
So:

- on every step: what the schedule alone decides: the prompts (`prompt_ids`), the samples that
  came back (`samples_returned`: each prompt's k samples exactly once), the version numbering
  (`policy_version` - base = step) and the staleness bound;
- on the steps before the first replica fault (which include the steps after the first learner
  kill and resume): every metric the resume test compares, which drain mode makes a function
  of (seed, schedule, weights) only.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

from bench.soak_fleet import Usage

# Metrics a resumed run must reproduce in drain mode (tests/rl/test_resume.py), and the
# tolerance it uses: the learner's float32 numbers through a checkpoint.
RESUME_METRICS = ("loss", "reward_mean", "score_mean", "kl", "staleness_mean", "staleness_max",
                  "eos_rate", "response_length_mean")  # fmt: skip
RTOL, ATOL = 1e-5, 1e-6
FLEET_COUNTERS = ("generator_failures", "generator_failovers", "generator_rejoins",
                  "generator_restarts", "generator_publish_retries")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def steps_complete(records: Sequence[dict], total: int, returncode: int | None) -> Check:
    """The run ended with exit 0 and logged steps 1..total, each once, in order."""
    steps = [r["step"] for r in records]
    ok = returncode == 0 and steps == list(range(1, total + 1))
    detail = f"exit {returncode}, {len(steps)} of {total} steps logged"
    if not ok and steps != list(range(1, len(steps) + 1)):
        detail += f" (out of order or repeated: {steps[:5]}...)"
    return Check("run completed", ok, detail)


def exactly_once(records: Sequence[dict], schedule: Callable[[int], list[str]], k: int) -> Check:
    """Every step trained its scheduled prompts (`schedule(step - 1)`: prompt ids) and, per
    prompt, samples 0..k-1 exactly once as they came back (`samples_returned`)."""
    problems = []
    for r in records:
        step, want_ids = r["step"], list(schedule(r["step"] - 1))
        if r.get("prompt_ids") != want_ids:
            problems.append(f"step {step}: prompts {r.get('prompt_ids')} != schedule {want_ids}")
            continue
        if "samples_returned" not in r:
            problems.append(f"step {step}: no samples_returned in metrics.jsonl")
            continue
        got = collections.Counter((str(p), int(s)) for p, s in r["samples_returned"])
        want = collections.Counter((p, s) for p in want_ids for s in range(k))
        if got != want:
            missing, extra = want - got, got - want
            problems.append(f"step {step}: missing {sorted(missing)}, extra {sorted(extra)}")
    detail = f"{len(records)} steps x {k} samples per prompt"
    return Check("each prompt trained exactly once", not problems, _with(detail, problems))


def versions_within_bound(records: Sequence[dict], max_staleness: int) -> Check:
    """Versions count one per step from the run's base, and no sample (nor token) was older
    than `max_staleness` versions when trained on."""
    problems = []
    base = records[0]["policy_version"] - records[0]["step"] if records else 0
    worst = 0
    for r in records:
        if r["policy_version"] - base != r["step"]:
            problems.append(f"step {r['step']}: version {r['policy_version']}, base {base}")
        stale = max(r["staleness_max"], r.get("token_staleness_max", 0))
        worst = max(worst, stale)
        if not 0 <= r["staleness_max"] <= stale <= max_staleness:
            problems.append(f"step {r['step']}: staleness {stale} (bound {max_staleness})")
    detail = f"max staleness {worst} (bound {max_staleness}), versions base+step"
    return Check("versions within the bound", not problems, _with(detail, problems))


def undisturbed_steps(records: Sequence[dict], first_fault_step: int | None) -> int:
    """The last step whose batch no replica fault can have touched: before the step at which
    the first replica fault was injected and before any step that saw a fleet event."""
    limit = first_fault_step - 1 if first_fault_step is not None else math.inf
    for r in records:
        if r.get("generators_live", 2) < 2 or any(r.get(k, 0) for k in FLEET_COUNTERS):
            limit = min(limit, r["step"] - 1)
            break
    steps = [r["step"] for r in records if r["step"] <= limit]
    return max(steps, default=0)


def equals_reference(
    records: Sequence[dict], reference: Sequence[dict], upto: int, must_cover: int
) -> Check:
    """The run's steps 1..upto against the undisturbed reference run's: prompts, samples and
    version numbering exactly, the resume metrics within the resume test's tolerance.
    `must_cover`: a step the comparison must reach (one after the first learner resume), or
    it proves nothing about resuming."""
    name = "metrics equal the undisturbed run's (drain)"
    ref = {r["step"]: r for r in reference}
    upto = min(upto, max(ref, default=0))
    if upto < must_cover:
        return Check(name, False, f"compared only steps 1..{upto}; step {must_cover} (after "
                     "the first learner resume) is needed: raise --reference-steps")  # fmt: skip
    base_run = records[0]["policy_version"] - 1
    base_ref = reference[0]["policy_version"] - 1
    problems, worst = [], 0.0
    for r in records[:upto]:
        want = ref[r["step"]]
        for key in ("prompt_ids", "prompts", "samples"):
            if r.get(key) != want.get(key):
                problems.append(f"step {r['step']}: {key} differs")
        if _returned(r) != _returned(want):
            problems.append(f"step {r['step']}: samples_returned differ")
        if r["policy_version"] - base_run != want["policy_version"] - base_ref:
            problems.append(f"step {r['step']}: version numbering differs")
        for key in RESUME_METRICS:
            a, b = float(r[key]), float(want[key])
            worst = max(worst, abs(a - b) / max(abs(b), 1e-12) if a != b else 0.0)
            if not math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL):
                problems.append(f"step {r['step']}: {key} {a!r} != {b!r}")
    resumed = must_cover - 1
    detail = f"steps 1..{upto} (learner resumed at step {resumed}), max rel. diff {worst:.1e}"
    return Check(name, not problems, _with(detail, problems))


@dataclasses.dataclass(frozen=True)
class Trend:
    """One process's usage after its warm-up: the medians of its first and last 3 samples."""

    label: str
    seconds: float  # from the first to the last sample measured
    rss_mb: tuple[float, float]
    tree_rss_mb: tuple[float, float]
    threads: tuple[int, int]
    fds: tuple[int, int]

    def growth(self, pair: tuple[float, float]) -> float:
        return pair[1] / pair[0] - 1.0 if pair[0] else math.inf


def trend(label: str, series: Sequence[Usage], after: float, min_samples: int = 6) -> Trend | None:
    """The Trend of samples taken from soak time `after` on; None when too few to tell."""
    window = [u for u in series if u.t >= after]
    if len(window) < min_samples:
        return None
    head, tail = window[:3], window[-3:]

    def pair(field: str, scale: float = 1.0):
        return tuple(statistics.median(getattr(u, field) for u in part) / scale
                     for part in (head, tail))  # fmt: skip

    return Trend(label, window[-1].t - window[0].t, pair("rss_kb", 1024), pair("tree_rss_kb", 1024),
                 pair("threads"), pair("fds"))  # fmt: skip


def resources_flat(
    trends: Sequence[Trend], max_rss_growth: float, thread_slack: int, fd_slack: int
) -> Check:
    """Each server's resident memory (its own, and with its engine processes) grew at most
    `max_rss_growth` after warm-up, and its threads and descriptors by at most a few."""
    if not trends:
        return Check("server memory, threads, fds flat", False,
                     "no server lived long enough past its warm-up to measure")  # fmt: skip
    problems = []
    for t in trends:
        for what, pair in (("RSS", t.rss_mb), ("RSS with engine", t.tree_rss_mb)):
            if t.growth(pair) > max_rss_growth:
                problems.append(f"{t.label}: {what} {pair[0]:.0f} -> {pair[1]:.0f} MB")
        for what, pair, slack in (("threads", t.threads, thread_slack), ("fds", t.fds, fd_slack)):
            if pair[1] - pair[0] > slack:
                problems.append(f"{t.label}: {what} {pair[0]} -> {pair[1]}")
    worst = max(max(t.growth(t.rss_mb), t.growth(t.tree_rss_mb)) for t in trends)
    detail = (f"{len(trends)} server process(es), RSS growth <= {100 * worst:.1f}% (bound "
              f"{100 * max_rss_growth:.0f}%)")  # fmt: skip
    return Check("server memory, threads, fds flat", not problems, _with(detail, problems))


def learner_memory_flat(trends: Sequence[Trend], max_rss_growth: float) -> Check:
    """Each learner process's resident memory grew at most `max_rss_growth` after its warm-up:
    the loop keeps no per-step state (its records stream to metrics.jsonl)."""
    name = "learner memory flat"
    if not trends:
        return Check(name, False, "no learner process ran long enough past its warm-up to measure")
    problems = [f"{t.label}: RSS {t.rss_mb[0]:.0f} -> {t.rss_mb[1]:.0f} MB over {t.seconds:.0f} s"
                for t in trends if t.growth(t.rss_mb) > max_rss_growth]  # fmt: skip
    worst = max(t.growth(t.rss_mb) for t in trends)
    detail = (f"{len(trends)} learner process(es), RSS growth <= {100 * worst:.1f}% (bound "
              f"{100 * max_rss_growth:.0f}%)")  # fmt: skip
    return Check(name, not problems, _with(detail, problems))


def no_orphans(left: Sequence[tuple[int, str]]) -> Check:
    detail = "none" if not left else "; ".join(f"{pid}: {cmd[:80]}" for pid, cmd in left)
    return Check("no orphan processes", not left, detail)


def _returned(record: dict) -> list[tuple[str, int]] | None:
    """The (prompt id, sample index) pairs that came back, in a canonical order."""
    pairs = record.get("samples_returned")
    return None if pairs is None else sorted((str(p), int(s)) for p, s in pairs)


def _with(detail: str, problems: Sequence[str], shown: int = 5) -> str:
    if not problems:
        return detail
    more = f" (+{len(problems) - shown} more)" if len(problems) > shown else ""
    return f"{detail}; " + "; ".join(problems[:shown]) + more


def markdown_table(rows: Sequence[tuple[str, str]]) -> str:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows]
    return "\n".join(lines)

"""What each step's record says beyond the loss: the generators' health and occupancy since the
last step, how stale the batch was, and which samples came back."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from jaxrlhf.fleet.pool import GeneratorPool
from jaxrlhf.rl.rollout import Rollout


class FleetWatch:
    """The generators' health and occupancy for each step's record, as changes since the end of
    the previous step (or the start of the loop): whatever happens between two steps (an
    evaluation, a checkpoint) counts in the next, and nothing is lost."""

    COUNTERS = ("failures", "failovers", "restarts", "rejoins", "publish_retries")

    def __init__(self, pool: GeneratorPool):
        self.pool = pool
        self._counts, self._busy = pool.metrics(), pool.occupancy()
        self._at = time.perf_counter()

    def step(self) -> dict[str, Any]:
        counts, busy, now = self.pool.metrics(), self.pool.occupancy(), time.perf_counter()
        record: dict[str, Any] = {"generators_live": counts["generators_live"]}
        record |= {f"generator_{k}": counts[k] - self._counts[k] for k in self.COUNTERS}
        record |= occupancy_metrics(self._busy, busy, now - self._at)
        self._counts, self._busy, self._at = counts, busy, now
        return record


def occupancy_metrics(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Between two `GeneratorPool.occupancy` readings, averaged over the replicas that answered
    both times: generator_window_s, the seconds between the readings on each replica's own
    clock (its uptime_seconds; the learner's `seconds` for a replica that does not report
    it); generator_idle_s, the seconds of that window a replica generated nothing (no request,
    or paused for a swap); generator_requests_mean, how many requests it was generating on
    average; generator_occupancy, that mean ÷ its capacity (max_num_seqs), in [0, 1] (a
    replica reporting no capacity, older than the field, is left out of it). Each replica's
    figures are over its own clock's window, which its totals cover exactly: the learner's
    interval between two answers differs from it by the answers' latencies."""
    both = [target for target in after if target in before]
    if not both or seconds <= 0:
        return {}
    windows = {t: (after[t][3] - before[t][3]) if after[t][3] > 0 else seconds for t in both}
    both = [t for t in both if windows[t] > 0]
    if not both:
        return {}
    idle = [after[t][0] - before[t][0] for t in both]
    requests = {t: (after[t][1] - before[t][1]) / windows[t] for t in both}
    out = {
        "generator_window_s": float(np.mean([windows[t] for t in both])),
        "generator_idle_s": float(np.mean(idle)),
        "generator_requests_mean": float(np.mean(list(requests.values()))),
    }
    shares = [requests[t] / after[t][2] for t in both if after[t][2]]
    if shares:
        out["generator_occupancy"] = float(np.mean(shares))
    return out


def staleness_metrics(rollout: Rollout, learner_version: int) -> dict[str, float]:
    """How many versions behind `learner_version` (the parameters the update starts from) the
    batch was sampled: staleness_mean/max per sample (its oldest token, the first), and
    token_staleness_mean/max over every response token. mixed_version_fraction: the share of
    samples whose tokens come from more than one version (in-flight swaps)."""
    samples = rollout.samples
    oldest = learner_version - np.array([s.oldest_version for s in samples])
    tokens = learner_version - np.concatenate([np.asarray(s.token_versions) for s in samples])
    return {
        "staleness_mean": float(oldest.mean()),
        "staleness_max": int(oldest.max()),
        "token_staleness_mean": float(tokens.mean()) if tokens.size else 0.0,
        "token_staleness_max": int(tokens.max()) if tokens.size else 0,
        "mixed_version_fraction": float(np.mean([len(set(s.token_versions)) > 1 for s in samples])),
    }


def samples_returned(rollout: Rollout) -> list[list]:
    """[prompt id, sample index] of each sample, in the order the generators returned them:
    what came back, to check against the schedule (`prompt_ids`) for a lost or doubled sample."""
    return [[rollout.prompts[s.prompt_index].id, s.sample_index] for s in rollout.samples]

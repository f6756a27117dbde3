"""Greedy evaluations of the held-out splits on the weights the generators serve: before
training (its responses cached per model folder: `eval_cache`), during it and after it.

`evaluate_greedy` scores the greedy responses of the driver's generators on every process (a
reward model runs on the whole mesh); `Evaluator` runs the configured ones for the loop, never
counted as a step (left out of the progress bar's rate and ETA).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from jaxrlhf.distributed import broadcast, is_driver
from jaxrlhf.fleet.pool import GeneratorPool
from jaxrlhf.rl.eval_cache import EvaluationCache, folder_digest
from jaxrlhf.rl.learner import Learner
from jaxrlhf.rl.metrics import MetricsWriter
from jaxrlhf.rl.publisher import Publisher
from jaxrlhf.rl.rollout import PromptItem, Rollout
from jaxrlhf.rl.tasks import Task

_SPLIT_NAMES = {"eval": "validation", "test": "test"}


def greedy_sampling(max_tokens: int) -> dict[str, Any]:
    """The sampling of every evaluation: one greedy response per prompt."""
    return dict(n=1, temperature=0.0, max_tokens=max_tokens)


def greedy_responses(
    pool: GeneratorPool, prompts: list[PromptItem], max_tokens: int
) -> tuple[list[tuple[int, ...]], set[int]]:
    """The greedy response to each prompt, in order, from the weights the generator serves now,
    and the versions of the weights that generated them (the replicas' own tags: between two
    publishes, after a resume's rollback or a rejoin, not what the schedule last released)."""
    samples = pool.generate([p.token_ids for p in prompts], greedy_sampling(max_tokens))
    versions = {v for s in samples for v in (s.policy_version, *s.token_versions)}
    return [s.token_ids for s in samples], versions  # prompt-major, one per prompt


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Each split's per-prompt scores, and the policy versions of the weights that generated
    the responses (none for responses read from a cache)."""

    scores: dict[str, np.ndarray]
    versions: frozenset[int] = frozenset()


def evaluate_greedy(
    pool: GeneratorPool | None,
    task: Task,
    prompts: list[PromptItem],
    max_tokens: int,
    learner: Learner,
    cache: EvaluationCache | None = None,
    wait=None,
) -> np.ndarray:
    """Per-prompt scores (correctness for verifiable tasks, else reward-model reward) of greedy
    responses to `prompts` with the weights the generator serves now: `evaluate` of one
    split, without the versions."""
    splits = {"prompts": prompts}
    return evaluate(pool, task, splits, max_tokens, learner, cache, wait).scores["prompts"]


def evaluate(
    pool: GeneratorPool | None,
    task: Task,
    splits: dict[str, list[PromptItem]],
    max_tokens: int,
    learner: Learner,
    cache: EvaluationCache | None = None,
    wait=None,
) -> Evaluation:
    """Each split's per-prompt scores of greedy responses with the weights the generator serves
    now, and the versions of the weights that generated them. The driver reads a split's
    responses from `cache` (which must describe those weights) or generates them, every split
    it must generate in one call (one batch keeps the engine fuller than one call a split:
    `make run`'s validation split alone half-filled it); every process scores (a reward model
    runs on the whole mesh). `wait(generate)`: how every process waits for the driver's
    `generate()` (None elsewhere) and gets its result; by default a plain call (the loop's,
    `in_background`, rejoins replicas meanwhile)."""

    def generate() -> tuple[dict[str, list[tuple[int, ...]]], frozenset[int]]:
        sampling = greedy_sampling(max_tokens)
        responses, missing, versions = {}, [], set()
        for name, prompts in splits.items():
            ids = [p.token_ids for p in prompts]
            responses[name] = cache.load(ids, sampling) if cache is not None else None
            if responses[name] is None:
                missing.append(name)
        prompts = [p for name in missing for p in splits[name]]
        generated = []
        if prompts:
            generated, versions = greedy_responses(pool, prompts, max_tokens)
        start = 0
        for name in missing:
            ids = [p.token_ids for p in splits[name]]
            responses[name], start = generated[start : start + len(ids)], start + len(ids)
            if cache is not None:
                cache.store(ids, sampling, responses[name], note=f"{task.name}: {len(ids)} prompts")
        return responses, frozenset(versions)

    responses, versions = (wait or call_on_driver)(generate if is_driver() else None)
    scores = {name: learner.score(task, splits[name], responses[name]) for name in splits}
    return Evaluation(scores, versions)


def call_on_driver(fn):
    """fn() on the driver (None elsewhere), its result broadcast to every process."""
    return broadcast(fn() if fn is not None else None)


def start_evaluation_cache(pool: GeneratorPool, model_path: Path) -> EvaluationCache:
    """The cache of the greedy responses of `model_path`'s own weights as the pool's generators
    serve them (the driver's; only valid while they serve that folder's weights, version 0)."""
    fields = ("vllm_version", "dtype", "max_model_len")
    generators = sorted(
        {tuple(str(getattr(s, f, "")) for f in fields) for s in pool.wait_until_serving()}
    )
    return EvaluationCache(folder_digest(model_path), {"generators": generators})


def standard_error(scores: np.ndarray) -> float:
    """Standard error of the mean of per-prompt scores (for 0/1 scores: sqrt(p(1 − p)/n))."""
    return float(np.std(scores) / np.sqrt(len(scores))) if len(scores) else float("nan")


class Evaluator:
    """Greedy evaluations of the held-out splits (validation "eval", and "test" with
    `eval.test`) on the weights the generators serve, rejoining replicas meanwhile; never
    counted as a step (left out of the progress bar's rate and ETA)."""

    def __init__(self, cfg, task: Task, publisher: Publisher, writer: MetricsWriter | None):
        self.cfg, self.task, self.publisher, self.writer = cfg, task, publisher, writer
        self.name = "accuracy" if task.verifiable else "reward"
        self.splits = {"eval": task.eval_prompts}
        if cfg.eval.test and task.test_prompts:
            self.splits["test"] = task.test_prompts

    def key(self, split: str) -> str:
        """The metric's name: eval_accuracy (validation), test_accuracy (or _reward)."""
        return f"{split}_{self.name}"

    def scores(self, splits, cache: EvaluationCache | None = None) -> dict[str, np.ndarray]:
        """The per-prompt scores of each of `splits` (names), generated in one call."""
        return self.evaluate(splits, cache).scores

    def evaluate(self, splits, cache: EvaluationCache | None = None) -> Evaluation:
        """`scores`, with the versions of the weights that generated the responses."""
        with self.writer.paused() if self.writer is not None else contextlib.nullcontext():
            return evaluate(self.publisher.pool, self.task,
                            {split: self.splits[split] for split in splits},
                            self.cfg.rollout.max_response_tokens, self.publisher.learner,
                            cache, self.publisher.in_background)  # fmt: skip

    def before_training(self, model_path: Path | None, log) -> dict[str, float]:
        """Every split's mean score; `model_path`: the generators serve its own weights, whose
        responses may be cached (the driver's; None elsewhere)."""
        cache = None
        if model_path is not None:
            cache = start_evaluation_cache(self.publisher.pool, model_path)
        at_start = {}
        for split, scores in self.scores(self.splits, cache).items():
            at_start[split] = float(np.mean(scores))
            log(f"{_SPLIT_NAMES[split]} greedy {self.name} before training: "
                f"{at_start[split]:.3f}")  # fmt: skip
        if cache is not None and cache.hits:
            log(f"(responses of the unchanged model to the unchanged prompts read from "
                f"{cache.root}: delete it to generate them again)")  # fmt: skip
        return at_start

    def during(self, step: int) -> dict[str, float]:
        """The evaluations due after `step` (`eval.every`, `eval.test_every`; the end of the
        run is evaluated by `after_training`), and where they belong (`placed`)."""
        last = step == self.cfg.total_steps
        due = [
            split
            for split, every in (("eval", self.cfg.eval.every), ("test", self.cfg.eval.test_every))
            if every and step % every == 0 and not (last and self.cfg.eval.at_end)
            and split in self.splits
        ]  # fmt: skip
        if not due:
            return {}
        evaluation = self.evaluate(due)
        out = {self.key(split): float(np.mean(s)) for split, s in evaluation.scores.items()}
        if "eval" in due:
            out |= self.policy_kl("policy_kl")
        return out | self.placed(evaluation.versions)

    def policy_kl(self, key: str) -> dict[str, float]:
        """{key: the KL of the served policy from the reference on its own samples} of the
        first `eval.kl_prompts` validation prompts, one sample each at the rollout's
        temperature (`Learner.sample_kl`; seeded as the run's batches are); {} when off or
        without a reference."""
        count, learner = self.cfg.eval.kl_prompts, self.publisher.learner
        if not count or learner.ref_params is None:
            return {}
        prompts = self.task.eval_prompts[:count]
        sampling: dict[str, Any] = dict(
            n=1,
            temperature=self.cfg.rollout.temperature,
            max_tokens=self.cfg.rollout.max_response_tokens,
        )
        if self.cfg.rollout.seeded and not self.cfg.rollout.continuous:
            sampling["seed"] = self.cfg.seed

        def generate():
            return self.publisher.pool.generate([p.token_ids for p in prompts], sampling)

        with self.writer.paused() if self.writer is not None else contextlib.nullcontext():
            samples = self.publisher.in_background(generate if is_driver() else None)
        kl = learner.sample_kl(Rollout(0, list(prompts), samples, 0, 0.0), self.task.pad_id)
        return {key: kl}

    def placed(self, versions: frozenset[int]) -> dict[str, int]:
        """`evaluated_updates`: the updates in the weights an evaluation measured, read from the
        versions the replicas tagged its responses with. The fleet serves the last publish's
        weights between two publishes (sync_every > 1: fewer updates than the step), the
        checkpoint's after a resume until the next publish (`trainer.begin`'s rollback: more
        than the schedule's last publish), and a replica that rejoined meanwhile the learner's:
        what the schedule released (`publisher.served`) would misplace the point, or make it
        a duplicate. Responses of several versions (a replica rejoined between two publishes)
        are placed at the oldest, `evaluated_updates_newest` naming the newest."""
        base = self.publisher.base_version
        if not versions:  # nothing generated: what the schedule released
            return {"evaluated_updates": self.publisher.served - base}
        out = {"evaluated_updates": min(versions) - base}
        if len(versions) > 1:
            out["evaluated_updates_newest"] = max(versions) - base
        return out

    def after_training(self) -> dict[str, float]:
        out = {}
        for split, scores in self.scores(self.splits).items():
            out[f"{self.key(split)}_end"] = float(np.mean(scores))
            out[f"{self.key(split)}_end_stderr"] = standard_error(scores)
            out[f"{split}_prompts"] = len(scores)
        if "eval" in self.splits:
            out |= self.policy_kl("policy_kl_end")
        return out

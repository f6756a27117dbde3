"""Greedy evaluations of the held-out splits on the weights the generators serve: before
training (its responses cached per model folder: `eval_cache`), during it and after it.

`evaluate_greedy` scores the greedy responses of the driver's generators on every process (a
reward model runs on the whole mesh); `Evaluator` runs the configured ones for the loop, never
counted as a step (left out of the progress bar's rate and ETA).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np

from jaxrlhf.distributed import broadcast, is_driver
from jaxrlhf.rl.eval_cache import EvaluationCache, folder_digest
from jaxrlhf.rl.learner import Learner
from jaxrlhf.rl.metrics import MetricsWriter
from jaxrlhf.rl.pool import GeneratorPool
from jaxrlhf.rl.publisher import Publisher
from jaxrlhf.rl.rollout import PromptItem
from jaxrlhf.rl.tasks import Task

_SPLIT_NAMES = {"eval": "validation", "test": "test"}


def greedy_sampling(max_tokens: int) -> dict[str, Any]:
    """The sampling of every evaluation: one greedy response per prompt."""
    return dict(n=1, temperature=0.0, max_tokens=max_tokens)


def greedy_responses(
    pool: GeneratorPool, prompts: list[PromptItem], max_tokens: int
) -> list[tuple[int, ...]]:
    """The greedy response to each prompt, in order, from the weights the generator serves now."""
    samples = pool.generate([p.token_ids for p in prompts], greedy_sampling(max_tokens))
    return [s.token_ids for s in samples]  # prompt-major, one per prompt


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
    responses to `prompts` with the weights the generator serves now: `evaluate_splits` of
    one split."""
    splits = {"prompts": prompts}
    return evaluate_splits(pool, task, splits, max_tokens, learner, cache, wait)["prompts"]


def evaluate_splits(
    pool: GeneratorPool | None,
    task: Task,
    splits: dict[str, list[PromptItem]],
    max_tokens: int,
    learner: Learner,
    cache: EvaluationCache | None = None,
    wait=None,
) -> dict[str, np.ndarray]:
    """Each split's per-prompt scores of greedy responses with the weights the generator serves
    now. The driver reads a split's responses from `cache` (which must describe those weights)
    or generates them, every split it must generate in one call (one batch keeps the engine
    fuller than one call a split: `make run`'s validation split alone half-filled it); every
    process scores (a reward model runs on the whole mesh). `wait(generate)`: how every process
    waits for the driver's `generate()` (None elsewhere) and gets its result; by default a
    plain call (the loop's, `in_background`, rejoins replicas meanwhile)."""

    def generate() -> dict[str, list[tuple[int, ...]]]:
        sampling = greedy_sampling(max_tokens)
        responses, missing = {}, []
        for name, prompts in splits.items():
            ids = [p.token_ids for p in prompts]
            responses[name] = cache.load(ids, sampling) if cache is not None else None
            if responses[name] is None:
                missing.append(name)
        prompts = [p for name in missing for p in splits[name]]
        generated = greedy_responses(pool, prompts, max_tokens) if prompts else []
        start = 0
        for name in missing:
            ids = [p.token_ids for p in splits[name]]
            responses[name], start = generated[start : start + len(ids)], start + len(ids)
            if cache is not None:
                cache.store(ids, sampling, responses[name], note=f"{task.name}: {len(ids)} prompts")
        return responses

    responses = (wait or call_on_driver)(generate if is_driver() else None)
    return {name: learner.score(task, splits[name], responses[name]) for name in splits}


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
        with self.writer.paused() if self.writer is not None else contextlib.nullcontext():
            return evaluate_splits(self.publisher.pool, self.task,
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
        run is evaluated by `after_training`), and `evaluated_updates`: the updates in the
        weights they measured (the generators serve the last publish's, `step` rounded down
        to a multiple of `sync_every` in a run without a resume)."""
        last = step == self.cfg.total_steps
        due = [
            split
            for split, every in (("eval", self.cfg.eval.every), ("test", self.cfg.eval.test_every))
            if every and step % every == 0 and not (last and self.cfg.eval.at_end)
            and split in self.splits
        ]  # fmt: skip
        if not due:
            return {}
        out = {self.key(split): float(np.mean(s)) for split, s in self.scores(due).items()}
        # The weights evaluated are those served (their publish finished first): between two
        # publishes (sync_every > 1) they hold fewer updates than `step`.
        out["evaluated_updates"] = self.publisher.served - self.publisher.base_version
        return out

    def after_training(self) -> dict[str, float]:
        out = {}
        for split, scores in self.scores(self.splits).items():
            out[f"{self.key(split)}_end"] = float(np.mean(scores))
            out[f"{self.key(split)}_end_stderr"] = standard_error(scores)
            out[f"{split}_prompts"] = len(scores)
        return out

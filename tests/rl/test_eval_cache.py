"""The cache of a run's starting evaluation (`jaxrlhf.rl.eval_cache`): a cached figure is the one
a fresh evaluation gives, and a changed model, split, generator or sampling never reuses an entry.
Also: evaluations stay out of the progress bar's rate and ETA."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import transformers
from safetensors.numpy import load_file, save_file

from jaxrlhf.fleet.pool import GeneratorPool
from jaxrlhf.rl.eval_cache import EvaluationCache, folder_digest
from jaxrlhf.rl.evaluator import evaluate_greedy, greedy_sampling, start_evaluation_cache
from jaxrlhf.rl.metrics import MetricsWriter
from jaxrlhf.rl.trainer import run_rlhf
from tests.rl.jax_generator import JaxGenerator
from tests.rl.test_learning import learning_config, target_task

MAX_TOKENS = 8


def changed_copy(model_dir, target):
    """A copy of the model folder with one weight changed by one step of its last bit."""
    shutil.copytree(model_dir, target)
    tensors = load_file(target / "model.safetensors")
    name = sorted(tensors)[0]
    flat = tensors[name].reshape(-1).copy()
    flat[0] = np.nextafter(flat[0], np.float32(np.inf), dtype=flat.dtype)
    tensors[name] = flat.reshape(tensors[name].shape)
    save_file(tensors, target / "model.safetensors")
    return target


class Scorer:
    """The learner's scoring of a verifiable task (`Learner.score` without a reward model)."""

    @staticmethod
    def score(task, prompts, responses) -> np.ndarray:
        return np.array([task.score(p, r) for p, r in zip(prompts, responses, strict=True)])


class NoGenerator:
    """A pool that must not be asked: the responses have to come from the cache."""

    def generate(self, *args, **kwargs):
        raise AssertionError("the evaluation generated instead of reading the cache")


def test_folder_digest_follows_every_weight_and_ignores_markers(tiny_llama, tmp_path):
    digest = folder_digest(tiny_llama)
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama, copy)
    (copy / ".complete").write_text("a marker, not the model")
    assert folder_digest(copy) == digest
    assert folder_digest(changed_copy(tiny_llama, tmp_path / "changed")) != digest


def test_an_entry_is_found_only_under_everything_it_was_stored_with(tmp_path):
    prompts, sampling = [(1, 2, 3), (4, 5)], greedy_sampling(MAX_TOKENS)
    generator = {"generators": [("0.32.0", "float32", "256")]}
    cache = EvaluationCache("a" * 64, generator, root=tmp_path)
    assert cache.load(prompts, sampling) is None
    cache.store(prompts, sampling, [(7, 8), (9,)])
    assert cache.load(prompts, sampling) == [(7, 8), (9,)]
    assert cache.load([(1, 2, 3), (4, 6)], sampling) is None  # another split
    assert cache.load(prompts, greedy_sampling(MAX_TOKENS + 1)) is None
    assert EvaluationCache("b" * 64, generator, root=tmp_path).load(prompts, sampling) is None
    other = {"generators": [("0.32.0", "bfloat16", "256")]}
    assert EvaluationCache("a" * 64, other, root=tmp_path).load(prompts, sampling) is None
    with pytest.raises(ValueError, match="1 responses for 2 prompts"):
        cache.store(prompts, sampling, [(7,)])


def test_a_cached_evaluation_equals_a_fresh_one_from_vllm(tiny_llama, generator_address, tmp_path):
    """A real evaluation through the vLLM generator, then the cached one: the same responses and
    scores; the model changed by one bit, or another split, misses."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    task = target_task(tokenizer, prompts=24)
    split, other_split = task.eval_prompts, task.train_prompts[:8]
    pool = GeneratorPool([generator_address])
    try:
        cache = start_evaluation_cache(pool, tiny_llama)
        cache.root = tmp_path / "cache"
        fresh = evaluate_greedy(pool, task, split, MAX_TOKENS, Scorer())
        stored = evaluate_greedy(pool, task, split, MAX_TOKENS, Scorer(), cache)
    finally:
        pool.close()
    ids, sampling = [p.token_ids for p in split], greedy_sampling(MAX_TOKENS)
    responses = cache.load(ids, sampling)
    assert responses is not None and any(responses)
    assert np.array_equal(stored, fresh)
    cached = evaluate_greedy(NoGenerator(), task, split, MAX_TOKENS, Scorer(), cache)
    assert np.array_equal(cached, fresh)
    assert cache.load([p.token_ids for p in other_split], sampling) is None
    changed = EvaluationCache(
        folder_digest(changed_copy(tiny_llama, tmp_path / "changed")), cache.generator, cache.root
    )
    assert changed.load(ids, sampling) is None


class CountingGenerator(JaxGenerator):
    """Counts the greedy (evaluation) calls it answers."""

    greedy_calls = 0

    def generate(self, prompts, sampling, *args, **kwargs):
        self.greedy_calls += sampling.get("temperature") == 0.0
        return super().generate(prompts, sampling, *args, **kwargs)


def start_figure(model_dir, output_dir) -> tuple[float, int]:
    """A one-step run that evaluates its start: (the figure, greedy calls it made)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    generator = CountingGenerator(model_dir, tokenizer.eos_token_id, tokenizer.pad_token_id)
    config = learning_config(output_dir, "online_dpo", 1, 1e-3)
    config.eval.at_start = True
    config.rollout.max_response_tokens = MAX_TOKENS
    result = run_rlhf(config, model_dir, target_task(tokenizer), generator, lambda message: None)
    return result.summary["eval_accuracy_start"], generator.greedy_calls


def test_a_run_evaluates_its_starting_model_once(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRLHF_CACHE", str(tmp_path / "cache"))
    fresh, calls = start_figure(tiny_llama, tmp_path / "first")
    assert calls == 1
    assert start_figure(tiny_llama, tmp_path / "again") == (fresh, 0)
    changed = changed_copy(tiny_llama, tmp_path / "changed-model")
    assert start_figure(changed, tmp_path / "changed")[1] == 1


def test_evaluations_stay_out_of_the_progress_rate_and_eta(tmp_path):
    writer = MetricsWriter(tmp_path, total_steps=4, start_step=0, resume=False)
    clock = [1000.0]
    writer._bar._time = lambda: clock[0]
    writer._bar.start_t = writer._bar.last_print_t = clock[0]
    try:
        with writer.paused():
            clock[0] += 600.0  # an evaluation of the starting model
        clock[0] += 10.0  # the first step
        writer.write(1, {"reward_mean": 0.5})
        shown = writer._bar.format_dict
        assert shown["elapsed"] == pytest.approx(10.0)
        assert (shown["total"] - shown["n"]) / shown["rate"] == pytest.approx(30.0)
    finally:
        writer.close()


def test_splits_are_generated_in_one_call_and_cached_each(tiny_llama, tmp_path):
    """`evaluate`: the splits it must generate go in one greedy call, with the responses
    each split gets alone; each split is cached under its own prompts, and a split found in the
    cache is not generated again."""
    from jaxrlhf.rl.evaluator import evaluate

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    task = target_task(tokenizer, prompts=24)
    splits = {"eval": task.eval_prompts, "train": task.train_prompts[:8]}
    generator = CountingGenerator(tiny_llama, tokenizer.eos_token_id, tokenizer.pad_token_id)
    cache = EvaluationCache("a" * 64, {"generators": []}, root=tmp_path)
    together = evaluate(generator, task, splits, MAX_TOKENS, Scorer(), cache).scores
    assert generator.greedy_calls == 1
    for name, prompts in splits.items():
        alone = evaluate_greedy(generator, task, prompts, MAX_TOKENS, Scorer())
        assert np.array_equal(together[name], alone), name
    cached = evaluate(NoGenerator(), task, splits, MAX_TOKENS, Scorer(), cache).scores
    assert all(np.array_equal(cached[name], together[name]) for name in splits)
    half = EvaluationCache("b" * 64, {"generators": []}, root=tmp_path)
    sampling, asked = greedy_sampling(MAX_TOKENS), []
    half.store([p.token_ids for p in splits["eval"]], sampling, cache.load(
        [p.token_ids for p in splits["eval"]], sampling))  # fmt: skip

    class Asked(CountingGenerator):
        def generate(self, prompts, sampling, *args, **kwargs):
            asked.append(len(prompts))
            return super().generate(prompts, sampling, *args, **kwargs)

    other = Asked(tiny_llama, tokenizer.eos_token_id, tokenizer.pad_token_id)
    again = evaluate(other, task, splits, MAX_TOKENS, Scorer(), half).scores
    assert asked == [len(splits["train"])]
    assert all(np.array_equal(again[name], together[name]) for name in splits)

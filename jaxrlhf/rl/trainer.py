"""The asynchronous RLHF loop (the learner process).

    for each step:
        rollout  <- producer (generated ≤ max_staleness versions ago, tagged with its version)
        scores   <- task reward (+ missing-EOS penalty)
        ref/old  <- reference log-probs, behaviour log-probs (sampler's or recomputed), values
        update   <- one optimizer step on the configured loss (jitted, on the mesh)
        publish  <- every `sync_every` updates, stream the weights to the generator(s)
        log, checkpoint

Generation happens in the generator service(s) while this process trains; the producer thread
only waits on gRPC. Checkpoints hold everything needed to continue exactly (see `resume`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrlhf import losses
from jaxrlhf.checkpointing import Checkpointer
from jaxrlhf.models import (
    hf_tensor_specs,
    iter_hf_tensors,
    load_pretrained,
    logprobs_from_logits,
    save_pretrained,
)
from jaxrlhf.rl.batch import prompt_width, rollout_arrays
from jaxrlhf.rl.generators import GeneratorPool
from jaxrlhf.rl.metrics import MetricsWriter
from jaxrlhf.rl.objectives import StepInputs, build_objective, value_estimates
from jaxrlhf.rl.rewards import apply_eos_penalty
from jaxrlhf.rl.rollout import PromptItem, Rollout, RolloutProducer, Sample
from jaxrlhf.rl.tasks import Task
from jaxrlhf.sharding import activate, make_mesh, shard_batch
from jaxrlhf.train_state import (
    build_train_step,
    create_train_state,
    params_shardings,
    state_shardings,
)


@dataclasses.dataclass
class RunResult:
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]


def _sampling(config) -> dict[str, Any]:
    rollout = config.rollout
    return dict(
        n=rollout.samples_per_prompt,
        temperature=rollout.temperature,
        top_p=1.0,
        top_k=-1,
        max_tokens=rollout.max_response_tokens,
    )


class Learner:
    """Policy (+ value) train state on the mesh, the frozen reference, and jitted helpers."""

    def __init__(self, config, model_path: Path, mesh):
        cfg = config
        self.mesh = mesh
        self.temperature = cfg.rollout.temperature
        self.spec = losses.get_loss_spec(cfg.loss)
        self.policy, policy_params = load_pretrained(
            model_path,
            dtype=cfg.model.dtype,
            mesh=mesh,
            remat=cfg.model.remat,
            contraction_block=cfg.model.contraction_block,
        )
        params = {"policy": policy_params}
        shardings = {"policy": params_shardings(self.policy, mesh)}
        self.value = None
        if self.spec.needs_value_model:
            value_path = cfg.loss_params.value_model_path or model_path
            self.value, params["value"] = load_pretrained(
                value_path,
                dtype=cfg.model.dtype,
                head="score",
                mesh=mesh,
                seed=cfg.seed,
                contraction_block=cfg.model.contraction_block,
            )
            shardings["value"] = params_shardings(self.value, mesh)
        self.ref_params = None
        if self.spec.needs_reference_logprobs or cfg.loss_params.kl_coef:
            # The reference is the initial policy: a frozen copy on the mesh.
            self.ref_params = jax.tree.map(jnp.copy, policy_params)
        optimizer = optax.chain(
            optax.clip_by_global_norm(cfg.train.max_grad_norm),
            optax.adamw(cfg.train.learning_rate, weight_decay=cfg.train.weight_decay),
        )
        self.shardings = state_shardings(shardings, optimizer, params, mesh)
        self.state = create_train_state(params, optimizer, self.shardings)
        self.objective = build_objective(
            cfg.loss,
            self.policy,
            self.value,
            cfg.rollout.samples_per_prompt,
            cfg.loss_params,
            cfg.rollout.temperature,
        )
        self._optimizer = optimizer
        self._steps: dict[tuple, Any] = {}
        policy, temperature = self.policy, self.temperature

        def logprobs(params, input_ids, attention_mask):
            with activate(mesh):
                logits = policy.apply({"params": params}, input_ids, attention_mask)
                return logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature)

        self.logprobs = jax.jit(logprobs)
        self.values = jax.jit(value_estimates(self.value)) if self.value else None
        self.reward = None
        if cfg.task.reward_model:
            from jaxrlhf.models.paths import resolve_model
            from jaxrlhf.stages.reward import RewardScorer

            self.reward = RewardScorer(resolve_model(cfg.task.reward_model), mesh, cfg.model.dtype)
            if self.reward.model.config.vocab_size != self.policy.config.vocab_size:
                raise ValueError(
                    f"config.task.reward_model={cfg.task.reward_model!r} has a vocabulary of "
                    f"{self.reward.model.config.vocab_size}, the policy "
                    f"{self.policy.config.vocab_size}: the reward model must share the "
                    f"policy's tokenizer"
                )
        self.rows_per_batch = cfg.rollout.prompts_per_batch * cfg.rollout.samples_per_prompt
        self.prompt_len = cfg.rollout.max_prompt_tokens
        self.prompt_pad_multiple = cfg.rollout.prompt_pad_multiple
        self.response_len = cfg.rollout.max_response_tokens

    def prompt_width(self, rollout: Rollout) -> int:
        """The prompt columns of this batch's arrays (see config rollout.prompt_pad_multiple)."""
        return prompt_width(rollout, self.prompt_len, self.prompt_pad_multiple)

    def score(self, task: Task, prompts, responses, arrays=None) -> np.ndarray:
        """Rewards of (prompt, response ids) pairs: the task's verifier or the reward model
        (scored in chunks of one rollout batch, so the jitted scorer compiles once)."""
        if self.reward is None:
            return np.array(
                [task.score(p, r) for p, r in zip(prompts, responses, strict=True)], np.float32
            )
        if arrays is None:
            rollout = Rollout(0, list(prompts), [
                Sample(i, 0, tuple(r), (), "stop", 0) for i, r in enumerate(responses)
            ], 0, 0.0)  # fmt: skip
            arrays = rollout_arrays(
                rollout, task.pad_id, self.prompt_width(rollout), self.response_len
            )
        ids, mask, n = arrays.input_ids, arrays.attention_mask, len(arrays.input_ids)
        out = []
        for start in range(0, n, self.rows_per_batch):
            rows = np.arange(start, start + self.rows_per_batch) % n  # the last chunk wraps
            out.append(self.reward(ids[rows], mask[rows])[: n - start])
        return np.concatenate(out)[:n]

    def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        shapes = tuple(sorted((k, v.shape) for k, v in batch.items()))
        if shapes not in self._steps:
            self._steps[shapes] = build_train_step(
                self.objective.loss_fn, self._optimizer, self.mesh, self.shardings, dict(shapes)
            )
        self.state, metrics = self._steps[shapes](self.state, shard_batch(batch, self.mesh))
        return {k: float(v) for k, v in jax.device_get(metrics).items()}


def prompts_for_batch_fn(task: Task, prompts_per_batch: int, seed: int):
    """batch index -> its prompts; a pure function of (seed, index), so a resumed run gets the
    same prompts. Each epoch over the training prompts is a fresh permutation."""
    items = task.train_prompts
    count = len(items)

    def prompts_for_batch(index: int) -> list[PromptItem]:
        out = []
        for position in range(index * prompts_per_batch, (index + 1) * prompts_per_batch):
            epoch, offset = divmod(position, count)
            order = np.random.default_rng([seed, epoch]).permutation(count)
            out.append(items[order[offset]])
        return out

    return prompts_for_batch


def evaluate_greedy(pool: GeneratorPool, task: Task, max_tokens: int, learner: Learner) -> float:
    """Mean held-out score (accuracy for verifiable tasks, else reward-model reward) of greedy
    responses with the weights the generator serves now."""
    prompts = task.eval_prompts
    samples = pool.generate([p.token_ids for p in prompts], dict(n=1, temperature=0.0,
                            max_tokens=max_tokens))  # fmt: skip
    scores = learner.score(
        task, [prompts[s.prompt_index] for s in samples], [s.token_ids for s in samples]
    )
    return float(np.mean(scores))


def publish(learner: Learner, pool: GeneratorPool, version: int, dtype: str | None, rollback=False):
    policy_params = learner.state.params["policy"]
    specs = hf_tensor_specs(learner.policy, policy_params, dtype)
    return pool.publish_weights(
        lambda: iter_hf_tensors(learner.policy, policy_params, dtype), len(specs), version,
        allow_rollback=rollback, specs=specs,
    )  # fmt: skip


def run_rlhf(config, model_path: Path, task: Task, pool: GeneratorPool, log) -> RunResult:
    """Runs (or resumes) the RLHF loop against already-serving generator replicas."""
    cfg = config
    out = Path(cfg.output_dir)
    mesh = make_mesh(tuple(cfg.mesh.shape))
    learner = Learner(cfg, model_path, mesh)
    k = cfg.rollout.samples_per_prompt
    learner.spec.check(k, has_value_model=learner.value is not None)
    checkpointer = Checkpointer(out / "checkpoints", cfg.checkpoint.every)
    sync_dtype = cfg.rollout.weight_sync_dtype or None
    # Versions are the generator's: a run starts at the version serving when it begins, and
    # step i's update publishes base_version + i + 1.
    statuses = pool.wait_until_serving()
    serving = max(status.policy_version for status in statuses)
    same_start = serving == 0 and all(
        Path(status.model).expanduser().resolve() == Path(model_path).resolve()
        for status in statuses
    )
    start_step, base_version, version = 0, serving, serving
    pending: list[Rollout] = []
    if cfg.resume and checkpointer.latest_step() is not None:
        learner.state, meta = checkpointer.restore(None, learner.state)
        start_step, base_version = meta["step"], meta["base_version"]
        version = meta["policy_version"]
        pending = [Rollout.from_json(r) for r in meta["pending_rollouts"]]
        log(f"resumed from step {start_step} (policy version {version})")
        # The generator may have kept serving weights published after the checkpoint: roll it
        # back to the checkpoint's weights under the checkpoint's version.
        publish(learner, pool, version, sync_dtype, rollback=True)
    else:
        if cfg.resume:
            log("resume requested but no checkpoint found: starting fresh")
        if not same_start:
            # The generator serves other weights (an earlier run's, or another model folder):
            # publish this run's initial ones.
            base_version = version = serving + 1
            publish(learner, pool, version, sync_dtype)
    writer = MetricsWriter(out, cfg.total_steps, start_step, resume=start_step > 0)
    eval_tokens = cfg.rollout.max_response_tokens
    eval_start = None
    metric = "eval_accuracy" if task.verifiable else "eval_reward"
    if cfg.eval.at_start and start_step == 0:
        eval_start = evaluate_greedy(pool, task, eval_tokens, learner)
        log(f"held-out greedy {metric[5:]} before training: {eval_start:.3f}")
    producer = RolloutProducer(
        pool,
        prompts_for_batch_fn(task, cfg.rollout.prompts_per_batch, cfg.seed),
        _sampling(cfg),
        max_staleness=cfg.max_staleness,
        start_batch=start_step,
        published_version=version,
        end_batch=cfg.total_steps,
        base_version=base_version,
        generation_seed=cfg.seed if cfg.rollout.seeded else None,
        pending=pending,
    )
    started = time.perf_counter()
    records = []
    try:
        for step in range(start_step, cfg.total_steps):
            record = train_one_step(
                learner, producer, pool, task, cfg, version, base_version, sync_dtype
            )
            version = record["policy_version"]
            if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
                record[metric] = evaluate_greedy(pool, task, eval_tokens, learner)
            writer.write(step + 1, record)
            records.append({"step": step + 1, **record})
            last = step + 1 == cfg.total_steps
            if last or checkpointer.due(step + 1):
                meta = {
                    "step": step + 1,
                    "policy_version": version,
                    "base_version": base_version,
                    "seed": cfg.seed,
                    # Batches generated on older weights and not trained on yet (async mode).
                    "pending_rollouts": [] if last else [
                        r.to_json() for r in producer.snapshot(version)
                    ],
                }  # fmt: skip
                checkpointer.save(step + 1, learner.state, meta, force=True)
    finally:
        producer.close()
        writer.close()
        checkpointer.close()
    summary = {
        "steps": cfg.total_steps,
        "policy_version": version,
        "wall_seconds": time.perf_counter() - started,
        f"{metric}_start": eval_start,
    }
    if cfg.eval.at_end:
        summary[f"{metric}_end"] = evaluate_greedy(pool, task, eval_tokens, learner)
    if records:
        tail = records[-min(len(records), 5) :]
        for key in ("reward_mean", "kl", "staleness_mean"):
            summary[f"{key}_last5"] = float(np.mean([r[key] for r in tail]))
    if records:
        from jaxrlhf.report import plot_training

        points = []
        if metric == "eval_accuracy":  # the plot's eval panel: before, during (records), after
            end = summary.get(f"{metric}_end")
            points = [(0, eval_start)] if eval_start is not None else []
            points += [(records[-1]["step"], end)] if end is not None else []
        summary["plot"] = str(plot_training(out / "metrics.jsonl", out / "training.png",
                                            eval_points=points, x="time"))  # fmt: skip
    if cfg.export:
        folder = save_pretrained(learner.policy, learner.state.params["policy"],
                                 out / "hf_export", tokenizer_from=model_path)  # fmt: skip
        summary["export_dir"] = str(folder)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return RunResult(summary, records)


def train_one_step(
    learner, producer, pool, task, cfg, version, base_version, sync_dtype
) -> dict[str, Any]:
    t0 = time.perf_counter()
    rollout = producer.next()
    wait_s = time.perf_counter() - t0
    arrays = rollout_arrays(
        rollout, task.pad_id, learner.prompt_width(rollout), learner.response_len
    )
    raw = learner.score(
        task,
        [rollout.prompts[s.prompt_index] for s in rollout.samples],
        [s.token_ids for s in rollout.samples],
        arrays,
    )
    scores = apply_eos_penalty(raw, arrays.finished, cfg.loss_params.penalty_reward_value)
    t1 = time.perf_counter()
    ids, mask = arrays.input_ids, arrays.attention_mask
    device_ids, device_mask = shard_batch({"i": ids, "m": mask}, learner.mesh).values()
    learner_lp = np.asarray(
        learner.logprobs(learner.state.params["policy"], device_ids, device_mask)
    )
    ref_lp = None
    if learner.ref_params is not None:
        ref_lp = np.asarray(learner.logprobs(learner.ref_params, device_ids, device_mask))
    old_values = None
    if learner.values is not None:
        old_values = np.asarray(learner.values(learner.state.params["value"], device_ids,
                                               device_mask))  # fmt: skip
    loss_mask = arrays.loss_mask
    old_lp = arrays.sampler_logprobs if cfg.loss_params.old_logprobs == "sampler" else learner_lp
    weights = None
    if cfg.loss_params.truncated_is_cap:
        weights = (
            np.asarray(
                losses.truncated_importance_weights(
                    learner_lp, arrays.sampler_logprobs, cfg.loss_params.truncated_is_cap
                )  # fmt: skip
            )
            * loss_mask
        )
    batch = learner.objective.prepare(
        StepInputs(arrays, scores, ref_lp, old_lp * loss_mask, weights, old_values)
    )
    t2 = time.perf_counter()
    metrics = learner.train_step(batch)
    train_s = time.perf_counter() - t2
    version += 1
    sync_s = 0.0
    updates = version - base_version
    if updates % cfg.sync_every == 0 or updates == cfg.total_steps:
        producer.wait_admitted()
        stats = publish(learner, pool, version, sync_dtype)
        producer.publish(version)
        sync_s = stats.seconds
    staleness = (version - 1) - arrays.policy_versions
    tokens = float(loss_mask.sum())
    record = {
        "policy_version": version,
        "loss": metrics["loss"],
        "reward_mean": float(raw.mean()),
        "score_mean": float(scores.mean()),
        "kl": float(((learner_lp - ref_lp) * loss_mask).sum(-1).mean())
        if ref_lp is not None
        else 0.0,
        "staleness_mean": float(staleness.mean()),
        "staleness_max": int(staleness.max()),
        "eos_rate": float(arrays.finished.mean()),
        "response_length_mean": float(arrays.response_lengths.mean()),
        "logprob_gap": float(np.abs(arrays.sampler_logprobs - learner_lp)[loss_mask > 0].mean()),
        "generation_tokens_per_s": rollout.num_tokens / max(rollout.generate_seconds, 1e-9),
        "train_tokens_per_s": tokens / max(train_s, 1e-9),
        "wait_for_generation_s": wait_s,
        "generate_s": rollout.generate_seconds,  # the Generate call of this batch, wall time
        "prepare_s": t2 - t1,
        "train_s": train_s,
        "weight_sync_s": sync_s,
        "step_s": time.perf_counter() - t0,
    }
    record.update({f"loss/{k}": v for k, v in metrics.items() if k != "loss"})
    return record

"""The learner's state and its one update: a rollout batch in, an optimizer step out.

`Learner.learn(rollout, task)` is everything between "a batch arrived" and "the parameters
changed": rewards (the task's verifier or a reward model) and the missing-EOS penalty, the
forwards the loss needs before the update (the reference's, the learner's recompute of π_old,
PPO's value estimates; each only when needed), the loss's batch preparation, and one jitted,
mesh-sharded train step (`train.updates_per_batch` of them, on the same prepared batch). The
loop around it (`jaxrlhf.rl.trainer`) owns generation, versions, publishing and checkpoints.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrlhf import losses
from jaxrlhf.config import model_options
from jaxrlhf.distributed import shard_global, to_host
from jaxrlhf.fleet.sample import Sample
from jaxrlhf.losses import LossInputs
from jaxrlhf.models import load_pretrained, next_token_logprobs
from jaxrlhf.models import lora as lora_lib
from jaxrlhf.rl.batch import RolloutArrays, prompt_width, rollout_arrays
from jaxrlhf.rl.eval_cache import folder_digest
from jaxrlhf.rl.objectives import build_objective, value_estimates
from jaxrlhf.rl.rewards import apply_eos_penalty
from jaxrlhf.rl.rollout import Rollout
from jaxrlhf.rl.tasks import Task
from jaxrlhf.sharding import activate
from jaxrlhf.train_state import (
    build_train_step,
    create_train_state,
    forward_in_micro_batches,
    micro_batch_count,
    params_shardings,
    state_shardings,
)


class Learner:
    """Policy (+ value) train state on the mesh, the frozen reference, and jitted helpers."""

    def __init__(self, config, model_path: Path, mesh, reward_model=None):
        """`reward_model(mesh)`: the scorer of the task's reward model on `mesh` (a
        `jaxrlhf.stages.reward.RewardScorer`), made by the caller when `task.reward_model` is
        set; None: the task's verifier scores."""
        cfg = config
        self.mesh = mesh
        self.temperature = cfg.rollout.temperature
        self.spec = losses.get_loss_spec(cfg.loss)
        self.loss_params = cfg.loss_params
        params, shardings = self._load_models(cfg, model_path, mesh)
        # The learner's own log-probs of the sampled tokens, before the update: π_old of the
        # ratio when old_logprobs="learner" (the off-policy corrections need it too: the config
        # refuses one without it). Otherwise π_old is the sampler's, and this forward is skipped.
        self.recompute_old = cfg.loss_params.old_logprobs == "learner"
        optimizer = optax.chain(
            optax.clip_by_global_norm(cfg.train.max_grad_norm),
            optax.adamw(cfg.train.learning_rate, weight_decay=cfg.train.weight_decay),
        )
        self.shardings = state_shardings(shardings, optimizer, params, mesh)
        if self.frozen is not None:
            self.frozen_shardings = {"policy": params_shardings(self.base_policy, mesh)}
            self._merge = jax.jit(functools.partial(lora_lib.merged_on_device,
                                                    self.policy.config))  # fmt: skip
        self.state = create_train_state(params, optimizer, self.shardings)
        self.loss_params = cfg.loss_params
        self.objective = build_objective(
            cfg.loss, self.policy, self.value, cfg.loss_params, cfg.rollout.temperature
        )
        self._optimizer = optimizer
        self._steps: dict[tuple, Any] = {}
        # Whether a train step leaves the parameters it read valid (not donated): a publish
        # in the background then sends them as they are, with no copy (rl/publisher.py).
        self.keep_params = False
        self.micro_batch_size = cfg.train.micro_batch_size
        self.updates_per_batch = cfg.train.updates_per_batch
        self._build_forwards(mesh)
        self.reward = None if reward_model is None else reward_model(mesh)
        if self.reward is not None:
            if self.reward.model.config.vocab_size != self.policy.config.vocab_size:
                raise ValueError(
                    f"config.task.reward_model={cfg.task.reward_model!r} has a vocabulary of "
                    f"{self.reward.model.config.vocab_size}, the policy "
                    f"{self.policy.config.vocab_size}: the reward model must share the "
                    f"policy's tokenizer"
                )
        self.samples_per_prompt = cfg.rollout.samples_per_prompt
        self.rows_per_batch = cfg.rollout.prompts_per_batch * cfg.rollout.samples_per_prompt
        self.prompt_len = cfg.rollout.max_prompt_tokens
        self.prompt_pad_multiple = cfg.rollout.prompt_pad_multiple
        self.response_len = cfg.rollout.max_response_tokens
        penalty = cfg.loss_params.penalty_reward_value
        self.eos_penalty = penalty if cfg.loss_params.missing_eos_penalty else None

    def _load_models(self, cfg, model_path: Path, mesh) -> tuple[dict, dict]:
        """The policy (a LoRA run's: its adapters and the frozen base), the value model and the
        reference; (the trained params, their shardings)."""
        self.policy, policy_params = load_pretrained(
            model_path, mesh=mesh, **model_options(cfg.model)
        )
        # The model whose weights a publish sends and the export writes (`published`).
        self.base_policy = self.policy
        self.model_path = Path(model_path)
        # A LoRA run trains the adapters alone: they are the state's "policy"; the base is
        # read by every policy forward and never trained, donated or copied.
        self.frozen = None
        # Generators in "lora" mode take the adapter alone (`rl/publisher.publish_adapter`);
        # any other gets the merged weights.
        self.sends_adapter = bool(cfg.model.lora.rank) and cfg.generator.swap_mode == "lora"
        if cfg.model.lora.rank:
            # Never trained: held in the compute dtype, as a reference is (no master weights).
            compute = jnp.dtype(cfg.model.dtype)
            base_params = jax.tree.map(lambda p: p.astype(compute), policy_params)
            self.policy, policy_params = lora_policy(self.policy, cfg.model.lora, cfg.seed, mesh)
            self.frozen = {"policy": base_params}
        params = {"policy": policy_params}
        shardings = {"policy": params_shardings(self.policy, mesh)}
        if self.frozen is not None:
            shardings["policy"] = lora_lib.split(shardings["policy"])[0]
        self.value = None
        if self.spec.needs_value_model:
            value_path = cfg.loss_params.value_model_path or model_path
            self.value, params["value"] = load_pretrained(
                value_path, head="score", mesh=mesh, seed=cfg.seed, **model_options(cfg.model)
            )
            shardings["value"] = params_shardings(self.value, mesh)
        self.ref_params = None
        if self.spec.needs_reference(cfg.loss_params) and self.frozen is not None:
            # A LoRA run's reference is its base, adapters off: no second copy.
            self.ref_params = self.frozen["policy"]
        elif self.spec.needs_reference(cfg.loss_params):
            # The reference is the initial policy: a frozen copy on the mesh, in the compute
            # dtype (it is never updated, so it needs no master weights).
            compute = jnp.dtype(cfg.model.dtype)
            self.ref_params = jax.tree.map(lambda p: p.astype(compute, copy=True), policy_params)
        return params, shardings

    def _build_forwards(self, mesh) -> None:
        """The jitted forwards: log π of the policy (`policy_params`) and of the reference
        (`ref_params`: a LoRA run's base, through the base model), and the value estimates."""
        temperature = self.temperature

        def logprobs_of(model):
            def logprobs(params, input_ids, attention_mask):
                with activate(mesh):
                    return next_token_logprobs(model, params, input_ids, attention_mask,
                                               temperature)  # fmt: skip

            return jax.jit(forward_in_micro_batches(logprobs, self.micro_batch_size))

        self.logprobs = logprobs_of(self.policy)
        self.ref_logprobs = self.logprobs if self.frozen is None else logprobs_of(self.base_policy)
        self.values = None
        if self.value is not None:
            self.values = jax.jit(
                forward_in_micro_batches(value_estimates(self.value), self.micro_batch_size)
            )

    def policy_params(self, params=None):
        """The policy's whole parameters (a LoRA run's adapters with its base) from the
        state's, or from `params` (the state's "policy" entry, or a copy of it)."""
        params = self.state.params["policy"] if params is None else params
        return params if self.frozen is None else lora_lib.merge(params, self.frozen["policy"])

    def published(self, params=None):
        """The parameters a publish sends and the export writes, of `base_policy`'s layout:
        the policy's own, or a LoRA run's merged (each adapter folded into its kernel)."""
        params = self.state.params["policy"] if params is None else params
        if self.frozen is None:
            return params
        return self._merge(params, self.frozen["policy"])

    @functools.cached_property
    def lora_base(self) -> dict[str, str] | None:
        """What a LoRA run's adapters apply to: its base's folder and `folder_digest` (every
        file's bytes), kept in its checkpoints; None when the whole policy trains."""
        if self.frozen is None:
            return None
        return {"path": str(self.model_path), "digest": folder_digest(self.model_path)}

    def prompt_width(self, rollout: Rollout) -> int:
        """The prompt columns of this batch's arrays (see config rollout.prompt_pad_multiple)."""
        return prompt_width(rollout, self.prompt_len, self.prompt_pad_multiple)

    def arrays(self, rollout: Rollout, pad_id: int) -> RolloutArrays:
        return rollout_arrays(rollout, pad_id, self.prompt_width(rollout), self.response_len)

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
            arrays = self.arrays(rollout, task.pad_id)
        ids, mask, n = arrays.input_ids, arrays.attention_mask, len(arrays.input_ids)
        out = []
        for start in range(0, n, self.rows_per_batch):
            rows = np.arange(start, start + self.rows_per_batch) % n  # the last chunk wraps
            out.append(self.reward(ids[rows], mask[rows])[: n - start])
        return np.concatenate(out)[:n]

    def loss_inputs(self, arrays: RolloutArrays, scores: np.ndarray) -> tuple[LossInputs, dict]:
        """The loss's inputs, with the forwards it needs run before the update, and the
        learner's own log-probs of the batch when they were computed (else None)."""
        mask = arrays.loss_mask
        ids, attention = shard_global(
            {"i": arrays.input_ids, "m": arrays.attention_mask}, self.mesh
        ).values()
        policy = self.policy_params()
        learner_lp = None
        if self.recompute_old:
            learner_lp = to_host(self.logprobs(policy, ids, attention)) * mask
        ref_lp = None
        if self.ref_params is not None:
            ref_lp = self._reference_logprobs(arrays, scores, ids, attention)
        old_values = None
        if self.values is not None:
            old_values = to_host(self.values(self.state.params["value"], ids, attention))
        inputs = LossInputs(
            input_ids=arrays.input_ids,
            attention_mask=arrays.attention_mask,
            loss_mask=mask,
            scores=scores,
            samples_per_prompt=self.samples_per_prompt,
            sampler_logprobs=arrays.sampler_logprobs,
            old_logprobs=learner_lp if learner_lp is not None else arrays.sampler_logprobs,
            ref_logprobs=ref_lp,
            old_values=old_values,
        )
        return inputs, {"learner_logprobs": learner_lp}

    def _reference_logprobs(self, arrays: RolloutArrays, scores, ids, attention) -> np.ndarray:
        """log π_ref of the batch's tokens (0 off-response): of every row, or only of the rows
        the loss reads (`LossSpec.reference_rows`; NaN elsewhere)."""
        mask = arrays.loss_mask
        if self.spec.reference_rows is None:
            return to_host(self.ref_logprobs(self.ref_params, ids, attention)) * mask
        rows = self.spec.reference_rows(scores, self.samples_per_prompt)
        subset = shard_global(
            {"i": arrays.input_ids[rows], "m": arrays.attention_mask[rows]}, self.mesh
        )
        out = np.full(mask.shape, np.nan, np.float32)
        out[rows] = to_host(self.ref_logprobs(self.ref_params, subset["i"], subset["m"]))
        out[rows] *= mask[rows]
        return out

    def sample_kl(self, rollout: Rollout, pad_id: int) -> float | None:
        """Mean over `rollout`'s samples of Σ_t (log π − log π_ref) on response tokens, π the
        policy that sampled them (their sampler log-probs, at the rollout's temperature): the
        KL of the sampling policy from the reference on its own samples (unbiased). None
        without a reference model."""
        if self.ref_params is None:
            return None
        arrays = self.arrays(rollout, pad_id)
        ids, attention = shard_global(
            {"i": arrays.input_ids, "m": arrays.attention_mask}, self.mesh
        ).values()
        ref = to_host(self.ref_logprobs(self.ref_params, ids, attention))
        per_sample = ((arrays.sampler_logprobs - ref) * arrays.loss_mask).sum(axis=-1)
        return float(per_sample.mean())

    def learn(self, rollout: Rollout, task: Task) -> dict[str, Any]:
        """One optimizer update on `rollout`; returns its metrics (module docstring)."""
        arrays = self.arrays(rollout, task.pad_id)
        raw = self.score(
            task,
            [rollout.prompts[s.prompt_index] for s in rollout.samples],
            [s.token_ids for s in rollout.samples],
            arrays,
        )
        scores = apply_eos_penalty(raw, arrays.finished, self.eos_penalty)
        started = time.perf_counter()
        inputs, extra = self.loss_inputs(arrays, scores)
        batch = self.objective.prepare(inputs)
        prepared = time.perf_counter()
        # train.updates_per_batch optimizer updates on the same prepared batch: π_old (and the
        # corrections, advantages and pairs) stay those of before the first.
        passes = [self.train_step(batch) for _ in range(self.updates_per_batch)]
        metrics = passes[-1]
        train_s = time.perf_counter() - prepared
        record = {
            "loss": metrics["loss"],  # of the last update on the batch
            "reward_mean": float(raw.mean()),
            "score_mean": float(scores.mean()),
            **behaviour_metrics(inputs, extra["learner_logprobs"]),
            **self._correction_metrics(inputs),
            "eos_rate": float(arrays.finished.mean()),
            "response_length_mean": float(arrays.response_lengths.mean()),
            "train_tokens_per_s": float(arrays.loss_mask.sum() * len(passes)) / max(train_s, 1e-9),
            "prepare_s": prepared - started,
            "train_s": train_s,
        }
        record.update({f"loss/{k}": v for k, v in metrics.items() if k != "loss"})
        if len(passes) > 1:
            record["loss_first_update"] = passes[0]["loss"]
        return record

    def _correction_metrics(self, inputs: LossInputs) -> dict[str, float]:
        """is_kept_fraction, is_ratio_mean, is_ratio_max of the off-policy correction
        (`jaxrlhf.losses.importance.Correction`), when the run has one."""
        if not self.spec.importance_ratio:
            return {}
        correction = inputs.correction(self.loss_params, self.spec.ratio_per)
        return {} if correction is None else correction.metrics

    def train_step(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        shapes = tuple(sorted((k, v.shape) for k, v in batch.items()))
        if shapes not in self._steps:
            items = next(iter(batch.values())).shape[0]
            loss_fn, frozen = self.objective.loss_fn, None
            if self.frozen is not None:
                loss_fn, frozen = with_frozen(loss_fn), self.frozen_shardings
            self._steps[shapes] = build_train_step(
                loss_fn, self._optimizer, self.mesh, self.shardings, dict(shapes),
                micro_batches=micro_batch_count(
                    items, self.micro_batch_size, self.spec.sequences_per_item
                ),
                weight_fn=self.spec.batch_weight, keep_params=self.keep_params,
                frozen_shardings=frozen,
            )  # fmt: skip
        held = () if self.frozen is None else (self.frozen,)
        self.state, metrics = self._steps[shapes](self.state, shard_global(batch, self.mesh),
                                                  *held)  # fmt: skip
        return {k: float(to_host(v)) for k, v in metrics.items()}


def behaviour_metrics(inputs: LossInputs, learner_logprobs: np.ndarray | None) -> dict[str, float]:
    """kl: mean over samples of Σ_t (log π − log π_ref) on response tokens, with π the learner's
    policy before the update when its log-probs were computed, else the sampler's (the behaviour
    policy, one version behind in async mode); only when the run has a reference, and over the
    samples the loss reads it of (Online DPO: each prompt's chosen and rejected).
    logprob_gap: mean |sampler − learner| log-prob on the same tokens, when both exist."""
    out = {}
    policy = learner_logprobs if learner_logprobs is not None else inputs.sampler_logprobs
    if inputs.ref_logprobs is not None:
        per_sample = inputs.sequence_sums(policy - inputs.ref_logprobs)
        out["kl"] = float(per_sample[np.isfinite(per_sample)].mean())
    if learner_logprobs is not None:
        real = inputs.loss_mask > 0
        out["logprob_gap"] = float(np.abs(inputs.sampler_logprobs - learner_logprobs)[real].mean())
    return out


def lora_policy(base, lora_cfg, seed: int, mesh):
    """(the LoRA policy on `base`, its new adapter placed on `mesh`) from `config.model.lora`
    (alpha 0 = 2 x rank); the adapter starts as PEFT's (`lora.init_adapter`), from `seed`."""
    alpha = lora_cfg.alpha or 2.0 * lora_cfg.rank
    policy = lora_lib.with_lora(base, lora_cfg.rank, alpha, tuple(lora_cfg.targets))
    shardings = lora_lib.split(params_shardings(policy, mesh))[0]
    adapter = jax.device_put(lora_lib.init_adapter(policy, seed), shardings)
    return policy, adapter


def with_frozen(loss_fn):
    """`loss_fn(params, batch)` of a LoRA run as the train step takes it, `(params, batch,
    frozen)`: the state's "policy" (the adapters) merged with the frozen base before the loss."""

    def loss(params, batch, frozen):
        whole = {**params, "policy": lora_lib.merge(params["policy"], frozen["policy"])}
        return loss_fn(whole, batch)

    return loss

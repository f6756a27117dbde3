"""The programs of a stage, lowered from abstract shapes on a mesh (nothing loaded or
downloaded): the train step with the config's micro-batches, chunked log-probs and mixed
precision, and for RLHF the forwards of the reference, the reward model and the value model,
each with what else stays resident while it runs. `jaxrlhf.plan` compiles them and reads
XLA's memory analysis; `bench/plan_check.py` runs them on a GPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

GIB = 1 << 30


@dataclasses.dataclass
class Program:
    """One compiled program's per-device memory (XLA's memory analysis) and what else stays
    resident while it runs."""

    name: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    resident_bytes: int  # not among its arguments, but on the device meanwhile

    @property
    def peak_bytes(self) -> int:
        own = self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes
        return own + self.resident_bytes


def shard_bytes(tree: Any) -> int:
    """Bytes of one device's shards of a tree of ShapeDtypeStructs with shardings."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `tree`'s leaves placed with `shardings`."""
    import jax

    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        tree, shardings,
    )  # fmt: skip


def abstract_model_params(model, mesh, dtype: str | None = None) -> tuple[Any, Any]:
    """(abstract params with shardings, the shardings) of `model`, optionally cast."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from jaxrlhf.models import abstract_params
    from jaxrlhf.train_state import params_shardings

    shapes = nn.meta.unbox(abstract_params(model))
    if dtype is not None:
        shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), shapes)
    shardings = params_shardings(model, mesh)
    return abstract(shapes, shardings), shardings


@dataclasses.dataclass
class StageProgram:
    """One of a stage's jitted programs with abstract arguments (sharded ShapeDtypeStructs)."""

    name: str
    jitted: Any
    args: tuple
    resident_bytes: int  # per device, not among its arguments but on the device meanwhile

    def memory(self) -> Program:
        """Compiles the program for the mesh; XLA's memory analysis of it."""
        stats = self.jitted.lower(*self.args).compile().memory_analysis()
        return Program(
            self.name,
            int(stats.argument_size_in_bytes),
            int(stats.output_size_in_bytes),
            int(stats.temp_size_in_bytes),
            int(stats.alias_size_in_bytes),
            self.resident_bytes,
        )


def _optimizer(config):
    import optax

    return optax.chain(
        optax.clip_by_global_norm(config.train.max_grad_norm),
        optax.adamw(config.train.learning_rate, weight_decay=config.train.weight_decay),
    )


def _state(params, shardings, optimizer, mesh):
    """The abstract TrainState (step, params, optimizer state) with its shardings."""
    import jax
    import jax.numpy as jnp

    from jaxrlhf.train_state import TrainState, state_shardings

    state_sharding = state_shardings(shardings, optimizer, params, mesh)
    opt_shapes = jax.eval_shape(optimizer.init, params)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=state_sharding.step)
    state = TrainState(step, params, abstract(opt_shapes, state_sharding.opt_state))
    return state, state_sharding


def _batch_spec(batch: dict, mesh) -> dict:
    import jax

    from jaxrlhf.sharding import batch_sharding

    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding(mesh, v.ndim, v.shape[0]))
        for k, v in batch.items()
    }


def _model(config, architecture: str, head: str = "lm", frozen: bool = False):
    from jaxrlhf.config import model_options
    from jaxrlhf.models import make_model
    from jaxrlhf.models.known import architecture_of

    options = model_options(config.model, frozen=frozen)
    return make_model(
        architecture_of(architecture, head), options["dtype"], options["remat"],
        options["contraction_block"], options["param_dtype"], options["logprob_chunk"],
    )  # fmt: skip


def stage_programs(config, mesh) -> tuple[list[StageProgram], dict[str, int], dict[str, Any]]:
    """The stage's programs (the train step first), the resident per-device sizes and the
    shapes behind the analytic estimate."""
    if config.stage == "rlhf":
        return _rlhf_programs(config, mesh)
    return _supervised_programs(config, mesh)


def _supervised_programs(config, mesh):
    import jax.numpy as jnp
    import numpy as np

    from jaxrlhf.stages.reward import bradley_terry_loss
    from jaxrlhf.stages.sft import nll_loss
    from jaxrlhf.train_state import build_train_step, micro_batch_count

    reward = config.stage == "reward"
    model = _model(config, _architecture(config), "score" if reward else "lm")
    params, shardings = abstract_model_params(model, mesh)
    optimizer = _optimizer(config)
    state, state_sharding = _state(params, shardings, optimizer, mesh)
    bs, length = config.train.batch_size, config.train.max_length
    lead = (bs, 2) if reward else (bs,)
    batch = {
        "input_ids": np.zeros((*lead, length), np.int32),
        "attention_mask": np.zeros((*lead, length), np.int32),
    }
    if not reward:
        batch["loss_mask"] = np.zeros((bs, length - 1), np.float32)
    per_item = 2 if reward else 1
    micro = micro_batch_count(bs, config.train.micro_batch_size, per_item)
    loss_fn = bradley_terry_loss(model) if reward else nll_loss(model)
    weight_fn = None if reward else (lambda part: jnp.sum(part["loss_mask"]))
    step = build_train_step(loss_fn, optimizer, mesh, state_sharding,
                            {k: v.shape for k, v in batch.items()}, micro_batches=micro,
                            weight_fn=weight_fn)  # fmt: skip
    program = StageProgram("train_step", step, (state, _batch_spec(batch, mesh)), 0)
    sizes = {
        "parameters": shard_bytes(state.params),
        "optimizer_state": shard_bytes(state.opt_state),
        "frozen_models": 0,
    }
    shapes = {"trained": [model], "frozen": [], "rows": bs * per_item // micro,
              "length": length, "micro_batches": micro}  # fmt: skip
    return [program], sizes, shapes


def _architecture(config) -> str:
    return config.model.architecture or config.model.path


def _rlhf_programs(config, mesh):
    """The RLHF stage's programs (its train step, and the forwards of the reference, the
    reward model and the value model where the loss has them), the sizes of its state and
    frozen models, and the shapes `analytic_bytes` reads."""
    from jaxrlhf import losses

    spec = losses.get_loss_spec(config.loss)
    trained, state, state_sharding, optimizer = _rlhf_state(config, mesh, spec)
    inputs = _rollout_inputs(config, spec)
    frozen = _frozen_models(config, mesh, spec, trained[0])
    frozen_bytes = {name: shard_bytes(p) for name, (_, p) in frozen.items()}
    step, batch, micro = _train_step(config, mesh, spec, trained, state_sharding, optimizer,
                                     inputs, frozen.get("base"))  # fmt: skip
    # A LoRA run's step reads its base as an argument: not resident besides.
    base = () if "base" not in frozen else ({"policy": frozen["base"][1]},)
    programs = [StageProgram("train_step", step, (state, _batch_spec(batch, mesh), *base),
                             sum(frozen_bytes.values()) - shard_bytes(base))]  # fmt: skip
    programs += _forward_programs(config, mesh, spec, inputs, state, frozen, frozen_bytes,
                                  trained[1] if len(trained) > 1 else None)  # fmt: skip
    sizes = {
        "parameters": shard_bytes(state.params),
        "optimizer_state": shard_bytes(state.opt_state),
        "frozen_models": sum(frozen_bytes.values()),
    }
    items = next(iter(batch.values())).shape[0]
    length = config.rollout.max_prompt_tokens + config.rollout.max_response_tokens
    shapes = {"trained": trained, "frozen": [m for m, _ in frozen.values()],
              "rows": items * spec.sequences_per_item // micro, "length": length,
              "micro_batches": micro}  # fmt: skip
    return programs, sizes, shapes


def _rlhf_state(config, mesh, spec):
    """The trained models (policy, and value when the loss needs one), their abstract train
    state with its sharding, and the optimizer. A LoRA run's policy (`model.lora`) trains its
    adapters alone: they are the state's "policy"."""
    policy = _lora(config, _model(config, _architecture(config)))
    trained = [policy]
    params, shardings = {}, {}
    params["policy"], shardings["policy"] = abstract_model_params(policy, mesh)
    if policy.config.lora_rank:
        from jaxrlhf.models import lora

        params["policy"] = lora.split(params["policy"])[0]
        shardings["policy"] = lora.split(shardings["policy"])[0]
    if spec.needs_value_model:
        value = _model(config, config.loss_params.value_model_path or _architecture(config),
                       "score")  # fmt: skip
        params["value"], shardings["value"] = abstract_model_params(value, mesh)
        trained.append(value)
    optimizer = _optimizer(config)
    state, state_sharding = _state(params, shardings, optimizer, mesh)
    return trained, state, state_sharding, optimizer


def _rollout_inputs(config, spec):
    """A batch of the config's shape (prompts x samples rows of prompt + response tokens)."""
    import numpy as np

    from jaxrlhf.losses import LossInputs

    rollout = config.rollout
    k = rollout.samples_per_prompt
    rows, length = (
        rollout.prompts_per_batch * k,
        rollout.max_prompt_tokens + rollout.max_response_tokens,
    )
    zeros = np.zeros((rows, length - 1), np.float32)
    return LossInputs(
        input_ids=np.zeros((rows, length), np.int32),
        attention_mask=np.ones((rows, length), np.int32),
        loss_mask=zeros, scores=np.arange(rows, dtype=np.float32), samples_per_prompt=k,
        sampler_logprobs=zeros, old_logprobs=zeros,
        ref_logprobs=zeros if spec.needs_reference(config.loss_params) else None,
        old_values=zeros if spec.needs_value_model else None,
    )  # fmt: skip


def _lora(config, model):
    """`model` with `config.model.lora`'s adapters (as the learner makes them), or as it is."""
    rank = config.model.lora.rank
    if not rank:
        return model
    from jaxrlhf.models import lora

    alpha = config.model.lora.alpha or 2.0 * rank
    return lora.with_lora(model, rank, alpha, tuple(config.model.lora.targets))


def _frozen_models(config, mesh, spec, policy) -> dict:
    """{name: (model, abstract params)} of the frozen models: the reference (the policy in the
    compute dtype) and the reward model, where the run has them. A LoRA run's frozen base (in
    the compute dtype) is "base", and its reference too (adapters off): no second copy."""
    frozen = {}
    if policy.config.lora_rank:
        from jaxrlhf.models import lora

        base_params = lora.split(abstract_model_params(policy, mesh, config.model.dtype)[0])[1]
        frozen["base"] = (lora.base_model(policy), base_params)
    elif spec.needs_reference(config.loss_params):
        ref_params, _ = abstract_model_params(policy, mesh, config.model.dtype)
        frozen["reference"] = (policy, ref_params)
    if config.task.reward_model:
        architecture = config.task.reward_model_architecture or config.task.reward_model
        reward = _model(config, architecture, "score", frozen=True)
        frozen["reward_model"] = (reward, abstract_model_params(reward, mesh)[0])
    return frozen


def _train_step(config, mesh, spec, trained, state_sharding, optimizer, inputs, base=None):
    """(the jitted train step, its prepared batch, its micro-batch count); a LoRA run's
    (`base`: its frozen base model and params) takes the base as its third argument."""
    from jaxrlhf.rl.learner import with_frozen
    from jaxrlhf.rl.objectives import build_objective
    from jaxrlhf.train_state import build_train_step, micro_batch_count

    value = trained[1] if len(trained) > 1 else None
    objective = build_objective(config.loss, trained[0], value, config.loss_params,
                                config.rollout.temperature)  # fmt: skip
    batch = objective.prepare(inputs)
    items = next(iter(batch.values())).shape[0]
    micro = micro_batch_count(items, config.train.micro_batch_size, spec.sequences_per_item)
    loss_fn, frozen_shardings = objective.loss_fn, None
    if base is not None:
        import jax

        loss_fn = with_frozen(loss_fn)
        frozen_shardings = {"policy": jax.tree.map(lambda leaf: leaf.sharding, base[1])}
    step = build_train_step(loss_fn, optimizer, mesh, state_sharding,
                            {k: v.shape for k, v in batch.items()}, micro_batches=micro,
                            weight_fn=spec.batch_weight,
                            frozen_shardings=frozen_shardings)  # fmt: skip
    return step, batch, micro


def _forward_programs(config, mesh, spec, inputs, state, frozen, frozen_bytes, value):
    """The reference's log-probs, the reward model's scores and the value model's estimates,
    each with the bytes of what else is resident while it runs."""
    import jax
    import numpy as np

    from jaxrlhf.models import next_token_logprobs
    from jaxrlhf.rl.objectives import value_estimates
    from jaxrlhf.sharding import activate
    from jaxrlhf.train_state import forward_in_micro_batches

    mbs, temperature = config.train.micro_batch_size, config.rollout.temperature
    state_bytes = shard_bytes(state.params) + shard_bytes(state.opt_state)
    k, rows = inputs.samples_per_prompt, inputs.input_ids.shape[0]
    length = inputs.input_ids.shape[1]
    ids_rows = len(spec.reference_rows(inputs.scores, k)) if spec.reference_rows else rows
    ids_spec = _batch_spec({"i": np.zeros((ids_rows, length), np.int32),
                            "m": np.zeros((ids_rows, length), np.int32)}, mesh)  # fmt: skip
    all_rows = _batch_spec({"i": inputs.input_ids, "m": inputs.attention_mask}, mesh)
    programs = []
    reference_of = "reference" if "reference" in frozen else "base"
    if reference_of == "base" and not spec.needs_reference(config.loss_params):
        reference_of = None
    if reference_of is not None:
        policy = frozen[reference_of][0]

        def reference(p, i, m):
            with activate(mesh):
                return next_token_logprobs(policy, p, i, m, temperature)

        forward = jax.jit(forward_in_micro_batches(reference, mbs))
        others = state_bytes + sum(frozen_bytes.values()) - frozen_bytes[reference_of]
        programs.append(StageProgram("reference_logprobs", forward, (
            frozen[reference_of][1], ids_spec["i"], ids_spec["m"]), others))  # fmt: skip
    if "reward_model" in frozen:
        from jaxrlhf.stages.reward import last_token_scores

        reward_model = frozen["reward_model"][0]

        def score(p, i, m):
            with activate(mesh):
                return last_token_scores(reward_model.apply({"params": p}, i, m), m)

        forward = jax.jit(forward_in_micro_batches(score, mbs))
        others = state_bytes + sum(frozen_bytes.values()) - frozen_bytes["reward_model"]
        programs.append(StageProgram("reward_scores", forward, (
            frozen["reward_model"][1], all_rows["i"], all_rows["m"]), others))  # fmt: skip
    if value is not None:
        values = jax.jit(forward_in_micro_batches(value_estimates(value), mbs))
        others = state_bytes - shard_bytes(state.params["value"]) + sum(frozen_bytes.values())
        programs.append(StageProgram("value_estimates", values,
                                     (state.params["value"], all_rows["i"], all_rows["m"]),
                                     others))  # fmt: skip
    return programs

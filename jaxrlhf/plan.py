"""A memory plan for a config, without a GPU and without a download.

    python -m jaxrlhf.plan --config=configs/nobots.py [--devices 8] [--device-memory-gib 80]
    python -m jaxrlhf.plan --config=configs/tldr.py:sft

The config's stage is built from abstract shapes on a mesh of `--devices` fake CPU devices
(default: the hardware the config names, `config.hardware`): no weight is loaded and nothing is
downloaded (the architectures of the paper's models are known offline,
`jaxrlhf.models.known`). The real jitted programs of the stage are lowered and compiled for that
mesh — the train step (micro-batches, chunked log-probs, mixed precision and all) and, for RLHF,
the reference log-prob forward and the reward model's scoring — and XLA's memory analysis of
each gives its per-device arguments, outputs and temporaries. Printed per device:

- parameters, optimizer state and frozen models (reference, reward model): the sizes of their
  shards on the mesh; gradients and activations live in XLA's temporaries of the train step;
- beside them, an analytic estimate (FSDP over all devices: parameters, two Adam moments and
  float32 gradients of the trained models; a micro-batch's remat checkpoints, one layer's
  working set and one chunk of logits);
- the peak: the largest program's arguments + outputs + temporaries (minus what it updates in
  place), plus whatever else stays resident meanwhile (the frozen models, or the train state
  while the reference runs); it fits when the peak is at most the device memory.

The last line is one JSON object: devices, device_memory_bytes, per_device_bytes (with total),
analytic_bytes, programs, fits. XLA:CPU's compiler lays memory out as GPU compilers do in
spirit, not byte for byte: treat the figures as a plan, to be checked on the hardware.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from absl import app, flags
from ml_collections import config_flags

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
    import jax
    import numpy as np

    from jaxrlhf import losses
    from jaxrlhf.losses import LossInputs
    from jaxrlhf.models import next_token_logprobs
    from jaxrlhf.rl.objectives import build_objective, value_estimates
    from jaxrlhf.sharding import activate
    from jaxrlhf.train_state import build_train_step, forward_in_micro_batches, micro_batch_count

    spec = losses.get_loss_spec(config.loss)
    rollout = config.rollout
    prompts, k = rollout.prompts_per_batch, rollout.samples_per_prompt
    length = rollout.max_prompt_tokens + rollout.max_response_tokens
    policy = _model(config, _architecture(config))
    trained = [policy]
    params, shardings = {}, {}
    params["policy"], shardings["policy"] = abstract_model_params(policy, mesh)
    value = None
    if spec.needs_value_model:
        value = _model(config, config.loss_params.value_model_path or _architecture(config),
                       "score")  # fmt: skip
        params["value"], shardings["value"] = abstract_model_params(value, mesh)
        trained.append(value)
    optimizer = _optimizer(config)
    state, state_sharding = _state(params, shardings, optimizer, mesh)
    rows = prompts * k
    zeros = np.zeros((rows, length - 1), np.float32)
    inputs = LossInputs(
        input_ids=np.zeros((rows, length), np.int32),
        attention_mask=np.ones((rows, length), np.int32),
        loss_mask=zeros, scores=np.arange(rows, dtype=np.float32), samples_per_prompt=k,
        sampler_logprobs=zeros, old_logprobs=zeros,
        ref_logprobs=zeros if spec.needs_reference(config.loss_params) else None,
        old_values=zeros if spec.needs_value_model else None,
    )  # fmt: skip
    objective = build_objective(config.loss, policy, value, config.loss_params,
                                rollout.temperature)  # fmt: skip
    batch = objective.prepare(inputs)
    items = next(iter(batch.values())).shape[0]
    mbs = config.train.micro_batch_size
    micro = micro_batch_count(items, mbs, spec.sequences_per_item)
    step = build_train_step(objective.loss_fn, optimizer, mesh, state_sharding,
                            {k: v.shape for k, v in batch.items()}, micro_batches=micro,
                            weight_fn=spec.batch_weight)  # fmt: skip
    frozen, frozen_bytes = {}, {}
    if spec.needs_reference(config.loss_params):
        ref_params, _ = abstract_model_params(policy, mesh, config.model.dtype)
        frozen["reference"] = (policy, ref_params)
    if config.task.reward_model:
        architecture = config.task.reward_model_architecture or config.task.reward_model
        reward = _model(config, architecture, "score", frozen=True)
        frozen["reward_model"] = (reward, abstract_model_params(reward, mesh)[0])
    frozen_bytes = {name: shard_bytes(p) for name, (_, p) in frozen.items()}
    state_bytes = shard_bytes(state.params) + shard_bytes(state.opt_state)
    programs = [
        StageProgram("train_step", step, (state, _batch_spec(batch, mesh)),
                         sum(frozen_bytes.values())),
    ]  # fmt: skip
    ids_rows = len(spec.reference_rows(inputs.scores, k)) if spec.reference_rows else rows
    forward_ids = {"i": np.zeros((ids_rows, length), np.int32),
                   "m": np.zeros((ids_rows, length), np.int32)}  # fmt: skip
    ids_spec = _batch_spec(forward_ids, mesh)
    if "reference" in frozen:

        def reference(p, i, m):
            with activate(mesh):
                return next_token_logprobs(policy, p, i, m, rollout.temperature)

        forward = jax.jit(forward_in_micro_batches(reference, mbs))
        others = state_bytes + frozen_bytes.get("reward_model", 0)
        programs.append(StageProgram("reference_logprobs", forward, (
            frozen["reference"][1], ids_spec["i"], ids_spec["m"]), others))  # fmt: skip
    if "reward_model" in frozen:
        from jaxrlhf.stages.reward import last_token_scores

        reward_model = frozen["reward_model"][0]

        def score(p, i, m):
            with activate(mesh):
                return last_token_scores(reward_model.apply({"params": p}, i, m), m)

        forward = jax.jit(forward_in_micro_batches(score, mbs))
        others = state_bytes + frozen_bytes.get("reference", 0)
        all_rows = _batch_spec({"i": inputs.input_ids, "m": inputs.attention_mask}, mesh)
        programs.append(StageProgram("reward_scores", forward, (
            frozen["reward_model"][1], all_rows["i"], all_rows["m"]), others))  # fmt: skip
    if value is not None:
        values = jax.jit(forward_in_micro_batches(value_estimates(value), mbs))
        all_rows = _batch_spec({"i": inputs.input_ids, "m": inputs.attention_mask}, mesh)
        programs.append(
            StageProgram(
                "value_estimates",
                values,
                (state.params["value"], all_rows["i"], all_rows["m"]),
                state_bytes - shard_bytes(state.params["value"]) + sum(frozen_bytes.values()),
            )
        )
    sizes = {
        "parameters": shard_bytes(state.params),
        "optimizer_state": shard_bytes(state.opt_state),
        "frozen_models": sum(frozen_bytes.values()),
    }
    per_item = spec.sequences_per_item
    shapes = {"trained": trained, "frozen": [m for m, _ in frozen.values()],
              "rows": items * per_item // micro, "length": length,
              "micro_batches": micro}  # fmt: skip
    return programs, sizes, shapes


def analytic_bytes(config, shapes: dict[str, Any], devices: int) -> dict[str, int]:
    """The estimate of the module docstring, per device, FSDP over all devices."""
    import numpy as np

    from jaxrlhf.models.known import architecture_of  # noqa: F401 (shapes hold the models)

    def count(model) -> int:
        import flax.linen as nn
        import jax

        from jaxrlhf.models import abstract_params

        return sum(
            math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(abstract_params(model)))
        )

    param_bytes = np.dtype(config.model.param_dtype).itemsize
    compute_bytes = np.dtype(config.model.dtype).itemsize
    trained = sum(count(m) for m in shapes["trained"])
    frozen = sum(count(m) for m in shapes["frozen"])
    policy = shapes["trained"][0].config
    rows = max(1, shapes["rows"] // devices)  # one micro-batch's rows on one device
    tokens = rows * shapes["length"]
    chunk = config.model.logprob_chunk or shapes["length"]
    layers = policy.num_layers
    checkpoints = tokens * policy.hidden_size * compute_bytes * (layers if config.model.remat else
                                                                 layers * 16)  # fmt: skip
    layer_work = tokens * (4 * policy.hidden_size + 3 * policy.intermediate_size) * 4
    attention = rows * policy.num_heads * shapes["length"] ** 2 * 4 * 2
    logits = rows * min(chunk, shapes["length"]) * policy.vocab_size * 4 * 3
    return {
        "parameters": trained * param_bytes // devices,
        "optimizer_state": 2 * trained * 4 // devices,
        "gradients": trained * 4 // devices,
        "frozen_models": frozen * compute_bytes // devices,
        "activations": checkpoints + layer_work + attention + logits,
    }


def plan(config, devices: int, device_memory_bytes: int) -> dict[str, Any]:
    """The plan of the module docstring, as the JSON-able dict the CLI prints last."""
    import jax

    from jaxrlhf.sharding import make_mesh

    mesh = make_mesh(tuple(config.mesh.shape), jax.devices()[:devices])
    stage, sizes, shapes = stage_programs(config, mesh)
    programs = [program.memory() for program in stage]
    train = programs[0]
    peak = max(programs, key=lambda p: p.peak_bytes)
    per_device = {
        **sizes,
        # Gradients, activations and every other temporary of the train step, as XLA lays
        # them out.
        "train_step_temporaries": train.temp_bytes,
        "total": peak.peak_bytes,
    }
    estimate = analytic_bytes(config, shapes, devices)
    estimate["total"] = sum(estimate.values())
    return {
        "config_stage": config.stage,
        "devices": devices,
        "mesh": dict(mesh.shape),
        "device_memory_bytes": device_memory_bytes,
        "micro_batches": shapes["micro_batches"],
        "per_device_bytes": per_device,
        "analytic_bytes": estimate,
        "peak_program": peak.name,
        "programs": {
            p.name: dataclasses.asdict(p) | {"peak_bytes": p.peak_bytes} for p in programs
        },  # fmt: skip
        "fits": per_device["total"] <= device_memory_bytes,
    }


def report_lines(result: dict[str, Any]) -> list[str]:
    def gib(value: int) -> str:
        return f"{value / GIB:8.2f} GiB"

    xla, estimate = result["per_device_bytes"], result["analytic_bytes"]
    lines = [f"stage {result['config_stage']} on {result['devices']} devices {result['mesh']}, "
             f"{result['micro_batches']} micro-batch(es) per update; per device:",
             f"  {'':28}{'XLA':>12}{'analytic':>14}"]  # fmt: skip
    for key, label in (("parameters", "parameters"), ("optimizer_state", "optimizer state"),
                       ("frozen_models", "frozen models")):  # fmt: skip
        lines.append(f"  {label:28}{gib(xla[key])}  {gib(estimate[key])}")
    lines.append(f"  {'gradients + activations':28}{gib(xla['train_step_temporaries'])}  "
                 f"{gib(estimate['gradients'] + estimate['activations'])}"
                 f"   (XLA: the train step's temporaries)")  # fmt: skip
    for name, program in result["programs"].items():
        lines.append(f"  program {name:20}{gib(program['peak_bytes'])}   (arguments "
                     f"{program['argument_bytes'] / GIB:.2f}, temporaries "
                     f"{program['temp_bytes'] / GIB:.2f}, resident besides "
                     f"{program['resident_bytes'] / GIB:.2f} GiB)")  # fmt: skip
    memory = result["device_memory_bytes"]
    verdict = "fits" if result["fits"] else "does NOT fit"
    lines.append(f"  {'peak (' + result['peak_program'] + ')':28}{gib(xla['total'])}  "
                 f"{gib(estimate['total'])}   of {memory / GIB:.0f} GiB: {verdict}")  # fmt: skip
    return lines


def main() -> None:
    """The command line (flags defined here, not at import: `jaxrlhf.evaluate` and
    `jaxrlhf.main` define `--config` too, and a process may import them all)."""
    config_flag = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")
    devices_flag = flags.DEFINE_integer("devices", 0, "Fake devices (0: config.hardware.devices).")
    memory_flag = flags.DEFINE_float(
        "device_memory_gib", 0.0, "GiB per device (0: config.hardware.device_memory_gib)."
    )

    def run(argv) -> None:
        del argv
        config = config_flag.value
        if config is None:
            raise app.UsageError("--config=configs/NAME.py is required")
        checked(config)
        found = plan_problems(config)
        if found:
            refuse(found)
        devices = devices_flag.value or config.hardware.devices
        memory_gib = memory_flag.value or config.hardware.device_memory_gib
        import jax

        # Before the first use of a backend: fake CPU devices stand in for the accelerators.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices)
        result = plan(config, devices, int(memory_gib * GIB))
        print("\n".join(report_lines(result)))
        print(json.dumps(result), flush=True)

    from jaxrlhf.config import checked, parse_flags
    from jaxrlhf.prerequisites import plan_problems, refuse

    app.run(run, flags_parser=parse_flags)


if __name__ == "__main__":
    main()

"""The checks of a config's values, before any work starts: `validate` raises ConfigError
naming the first bad key; `checked` turns that into one line and exit 2 for command lines.
`resolve` applies the shorthands (num_mini_batches)."""

from __future__ import annotations

import math
import sys

import ml_collections

from jaxrlhf.config.keys import DTYPES, STAGES
from jaxrlhf.data import task_registry
from jaxrlhf.data.lengths import parse_length_law
from jaxrlhf.losses import LOSSES, get_loss_spec
from jaxrlhf.models.lora import TARGETS as LORA_TARGETS
from jaxrlhf.train_state import micro_batch_count
from jaxrlhf_wire import IN_FLIGHT_KV, LORA_RANKS, SWAP_MODES
from jaxrlhf_wire.chunks import MAX_CHUNK_BYTES


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def checked(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config resolved and validated, or exit 2 with `config error: ...` (command lines)."""
    try:
        validate(resolve(config))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    return config


def resolve(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Applies the shorthands (num_mini_batches) in place; returns the config."""
    if config.get("num_mini_batches", 0) > 0:
        config.sync_every = config.num_mini_batches
        config.max_staleness = config.num_mini_batches - 1
    return config


def _check_length_law(rollout) -> None:
    try:
        parse_length_law(rollout.length_law, rollout.max_response_tokens)
    except ValueError as error:
        raise ConfigError(f"config.rollout.length_law: {error}") from None


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the first bad key."""
    _require(config.stage in STAGES, f"config.stage={config.stage!r}: must be one of {STAGES}")
    _check_model(config)
    _require(config.total_steps >= 1, f"config.total_steps={config.total_steps}: >= 1")
    _check_length_law(config.rollout)
    _check_generator(config)
    _check_train(config)
    _require(bool(config.output_dir), "config.output_dir: must name a folder")
    _check_task(config)
    if config.stage == "rlhf":
        _validate_rlhf(config)


def _check_task(config: ml_collections.ConfigDict) -> None:
    """config.task.name is a registered task (`jaxrlhf.data.task_registry`), one with preference
    pairs for the reward stage."""
    tasks, name = task_registry.TASKS, config.task.name
    _require(name in tasks, f"config.task.name={name!r}: one of {tuple(tasks)}")
    if config.stage == "reward":
        having = " or ".join(repr(n) for n, spec in tasks.items() if spec.preferences is not None)
        _require(
            tasks[name].preferences is not None,
            f"config.task.name={name!r}: the reward stage needs preference pairs ({having})",
        )


def _check_model(config: ml_collections.ConfigDict) -> None:
    """config.model's dtypes and chunk sizes, and the mesh's shape."""
    _require(
        config.model.dtype in DTYPES, f"config.model.dtype={config.model.dtype!r}: one of {DTYPES}"
    )
    _require(
        config.model.param_dtype in DTYPES,
        f"config.model.param_dtype={config.model.param_dtype!r}: one of {DTYPES}",
    )
    _require(
        config.model.logprob_chunk >= 0,
        f"config.model.logprob_chunk={config.model.logprob_chunk}: must be >= 0",
    )
    _require(
        config.model.contraction_block >= 0,
        f"config.model.contraction_block={config.model.contraction_block}: must be >= 0",
    )
    _check_lora(config)
    shape = tuple(config.mesh.shape)
    _require(
        len(shape) == 3 and all(s == -1 or s >= 1 for s in shape) and shape.count(-1) <= 1,
        f"config.mesh.shape={shape}: three sizes (data, fsdp, tensor), each >= 1 or one -1",
    )


def _check_lora(config: ml_collections.ConfigDict) -> None:
    """config.model.lora: its rank, alpha and targets, and the stage and loss it is for."""
    lora = config.model.lora
    rank = lora.rank
    _require(isinstance(rank, int) and rank >= 0,
             f"config.model.lora.rank={rank!r}: must be an integer >= 0 (0 = off)")  # fmt: skip
    if not lora.rank:
        return
    _require(lora.alpha >= 0, f"config.model.lora.alpha={lora.alpha}: must be >= 0 (0 = 2 x rank)")
    unknown = [t for t in lora.targets if t not in LORA_TARGETS]
    _require(bool(lora.targets) and not unknown,
             f"config.model.lora.targets={tuple(lora.targets)}: name one or more of "
             f"{', '.join(LORA_TARGETS)}")  # fmt: skip
    _require(
        config.stage == "rlhf",
        f"config.model.lora.rank={lora.rank}: LoRA is for the rlhf stage, not {config.stage}",
    )
    _require(not get_loss_spec(config.loss).needs_value_model,
             f"config.model.lora.rank={lora.rank} with loss {config.loss!r}: a loss with a value "
             "model trains it whole; LoRA runs take online_dpo, rloo, grpo and the others "
             "without one")  # fmt: skip


def _check_generator(config: ml_collections.ConfigDict) -> None:
    """config.generator's sizes, modes and transport, and rollout.max_running with them."""
    for key in ("capacity", "max_num_seqs"):
        value = config.generator[key]
        _require(value >= 0, f"config.generator.{key}={value}: must be >= 0 (0 = the engine's)")
    running = config.rollout.max_running
    _require(running >= 0, f"config.rollout.max_running={running}: must be >= 0 (0 = no limit)")
    _require(
        not running or config.generator.swap_mode in ("drain", "lora"),
        f'config.rollout.max_running={running} needs config.generator.swap_mode="drain" or '
        f'"lora" (got {config.generator.swap_mode!r}): under in-flight swaps a sample '
        "submitted late in its call would run on newer weights than its call was admitted under",
    )
    _check_lora_serving(config)
    reserved = config.generator.cpu_reserved_cores
    _require(
        reserved >= -1,
        f"config.generator.cpu_reserved_cores={reserved}: must be >= 0 (-1 = vLLM's default)",
    )
    executor = config.generator.engine_executor
    _require(
        executor in ("", "uni", "mp"),
        f"config.generator.engine_executor={executor!r}: must be 'uni', 'mp' or '' (the "
        "service's default)",
    )
    transports = ("auto", "stream", "shared")
    _require(
        config.generator.weight_transport in transports,
        f"config.generator.weight_transport={config.generator.weight_transport!r}: "
        f"must be one of {transports}",
    )
    _require(
        0 < config.generator.weight_chunk_bytes <= MAX_CHUNK_BYTES,
        f"config.generator.weight_chunk_bytes={config.generator.weight_chunk_bytes}: must be in "
        f"(0, {MAX_CHUNK_BYTES}] (the gRPC message limit less room for the chunk's header)",
    )
    for key, allowed in (("swap_mode", SWAP_MODES), ("in_flight_kv", IN_FLIGHT_KV)):
        _require(
            config.generator[key] in allowed,
            f"config.generator.{key}={config.generator[key]!r}: must be one of {allowed}",
        )


def _check_lora_serving(config: ml_collections.ConfigDict) -> None:
    """generator.swap_mode "lora" (adapters published alone): a LoRA run, of a rank a server
    can be started with (over any weight transport: streamed or in the shared file)."""
    if config.generator.swap_mode != "lora":
        return
    rank = config.model.lora.rank
    _require(
        isinstance(rank, int) and 0 < rank <= max(LORA_RANKS),
        f'config.generator.swap_mode="lora" serves LoRA adapters: it needs '
        f"config.model.lora.rank in 1..{max(LORA_RANKS)} (got {rank!r})",
    )


def _check_train(config: ml_collections.ConfigDict) -> None:
    """config.train's sizes and rate, and the batch against the mesh."""
    train, shape = config.train, tuple(config.mesh.shape)
    for key in ("batch_size", "max_length"):
        _require(train[key] >= 1, f"config.train.{key}={train[key]}: must be >= 1")
    _require(train.learning_rate > 0, f"config.train.learning_rate={train.learning_rate}: > 0")
    _require(
        train.micro_batch_size >= 0,
        f"config.train.micro_batch_size={train.micro_batch_size}: must be >= 0",
    )
    _require(
        train.updates_per_batch >= 1,
        f"config.train.updates_per_batch={train.updates_per_batch}: must be >= 1",
    )
    known = math.prod(s for s in shape if s != -1)
    _require(
        train.batch_size % known == 0 or -1 in shape,
        f"config.train.batch_size={train.batch_size} is not divisible by the mesh {shape}",
    )


def _check_correction(loss, spec, name: str) -> None:
    """loss_params.is_correction and its settings (jaxrlhf/losses/importance.py)."""
    from jaxrlhf.losses import CORRECTIONS, LOSSES
    from jaxrlhf.losses.importance import correction_kind, correction_range

    kind = loss.is_correction
    _require(
        kind in CORRECTIONS,
        f"config.loss_params.is_correction={kind!r}: one of {', '.join(CORRECTIONS)}",
    )
    _require(
        loss.truncated_is_cap >= 0,
        f"config.loss_params.truncated_is_cap={loss.truncated_is_cap}: must be >= 0",
    )
    kind = correction_kind(loss)
    _require(
        kind != "truncate" or loss.truncated_is_cap > 0,
        "config.loss_params.is_correction='truncate' needs truncated_is_cap > 0 (e.g. 2.0)",
    )
    _require(
        not (loss.truncated_is_cap and kind not in ("truncate", "none")),
        f"config.loss_params.truncated_is_cap={loss.truncated_is_cap} with "
        f"is_correction={kind!r}: the cap belongs to 'truncate'; set it to 0",
    )
    if kind in ("mask", "sequence_mask"):
        low, high = correction_range(kind, loss.is_low, loss.is_high)
        _require(
            0 <= low <= 1 <= high,
            f"config.loss_params.is_low={loss.is_low}, is_high={loss.is_high}: the kept range "
            f"[{low}, {high}] of is_correction={kind!r} must hold a ratio of 1 (None = the "
            "default; 0 and inf: no bound)",
        )
    if kind == "none":
        return
    setting = f"config.loss_params.is_correction={kind!r}"
    if loss.truncated_is_cap and loss.is_correction == "none":
        setting = f"config.loss_params.truncated_is_cap={loss.truncated_is_cap}"
    _require(
        spec.importance_ratio,
        f"{setting}: loss {name!r} has no importance ratio to correct (the corrections apply "
        f"to {', '.join(n for n, s in LOSSES.items() if s.importance_ratio)}); leave "
        f"is_correction='none' and truncated_is_cap=0",
    )
    _require(
        loss.old_logprobs == "learner",
        f"{setting} with old_logprobs='sampler' corrects twice for the same sampler: the "
        f"ratio π_θ/π_sampler already does. The corrections act on π_learner/π_sampler, the "
        f"ratio left when π_old is the learner's recompute: set old_logprobs='learner', or "
        f"is_correction='none' and truncated_is_cap=0",
    )


def _validate_rlhf(config: ml_collections.ConfigDict) -> None:
    loss = config.loss_params
    name = config.loss
    _require(
        config.task.reward_model or task_registry.task(config.task.name).verify is not None,
        f"config.task.reward_model is required: task {config.task.name!r} has no verifiable "
        f"reward (train one with --config.stage=reward)",
    )
    _require(name in LOSSES, f"config.loss={name!r}: one of {sorted(LOSSES)}")
    spec = LOSSES[name]
    k = config.rollout.samples_per_prompt
    _require(
        k >= spec.min_samples_per_prompt,
        f"config.rollout.samples_per_prompt={k}: loss {name!r} needs at least "
        f"{spec.min_samples_per_prompt}",
    )
    items = spec.batch_items(config.rollout.prompts_per_batch, k)
    try:
        micro_batch_count(items, config.train.micro_batch_size, spec.sequences_per_item)
    except ValueError as error:
        raise ConfigError(f"{error} (loss {name!r}: {items} items per update)") from None
    _require(config.max_staleness >= 0, f"config.max_staleness={config.max_staleness}: >= 0")
    _require(
        config.eval.kl_prompts >= 0,
        f"config.eval.kl_prompts={config.eval.kl_prompts}: must be >= 0 (0 = off)",
    )
    _require(config.sync_every >= 1, f"config.sync_every={config.sync_every}: >= 1")
    _require(
        config.max_staleness >= config.sync_every - 1,
        f"config.max_staleness={config.max_staleness} with config.sync_every="
        f"{config.sync_every}: batches would wait for weights that are never published; "
        f"use max_staleness >= sync_every - 1",
    )
    _require(
        loss.old_logprobs in ("sampler", "learner"),
        f"config.loss_params.old_logprobs={loss.old_logprobs!r}: 'sampler' or 'learner'",
    )
    _check_correction(loss, spec, name)
    _require(
        config.rollout.temperature > 0,
        f"config.rollout.temperature={config.rollout.temperature}: must be > 0 for RL",
    )
    _require(
        config.rollout.prompt_pad_multiple >= 0,
        f"config.rollout.prompt_pad_multiple={config.rollout.prompt_pad_multiple}: must be >= 0",
    )
    for key in ("prompts_per_batch", "max_prompt_tokens", "max_response_tokens",
                "prompts_per_call"):  # fmt: skip
        value = config.rollout[key]
        _require(value >= 1, f"config.rollout.{key}={value}: must be >= 1")
    rollout = config.rollout
    _require(
        0 <= rollout.min_response_tokens <= rollout.max_response_tokens,
        f"config.rollout.min_response_tokens={rollout.min_response_tokens}: must be in "
        f"[0, max_response_tokens={rollout.max_response_tokens}]",
    )
    if rollout.length_law and rollout.min_response_tokens:
        least = int(rollout.length_law.rsplit(":", 1)[1])  # pareto:A:M, checked in validate
        _require(
            rollout.min_response_tokens <= least,
            f"config.rollout.min_response_tokens={rollout.min_response_tokens} exceeds the "
            f"least budget of length_law={rollout.length_law!r} ({least})",
        )
    needed = config.rollout.max_prompt_tokens + config.rollout.max_response_tokens
    _require(
        needed <= config.generator.max_model_len,
        f"config.generator.max_model_len={config.generator.max_model_len} < max_prompt_tokens + "
        f"max_response_tokens = {needed}",
    )

"""Configs: `base_config()` holds every key with its default; `configs/*.py` start from it.

Configs are `ml_collections.ConfigDict`s returned by `configs/*.py:get_config()`. Command-line
overrides (`--config.a.b=value`) of unknown keys or of the wrong type are rejected by
ml_collections itself (the config is locked; `parse_flags` turns an unknown key into one line
naming it); `validate` checks values. Both happen before any work starts.
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from collections.abc import Iterator, Sequence

import ml_collections
from absl import app, flags

from jaxrlhf.data.lengths import parse_length_law
from jaxrlhf.data.recipes import TASKS, VERIFIABLE
from jaxrlhf.losses import LOSSES
from jaxrlhf.train_state import micro_batch_count
from jaxrlhf_wire import IN_FLIGHT_KV, SWAP_MODES

STAGES = ("sft", "reward", "rlhf")
DTYPES = ("float32", "bfloat16", "float16")


def base_config() -> ml_collections.ConfigDict:
    """Every key a run reads, with defaults (the Asynchronous RLHF paper's where it has one)."""
    c = ml_collections.ConfigDict()
    c.stage = "rlhf"
    c.seed = 0
    c.output_dir = "runs/default"
    c.resume = False
    # "smollm2" = the packaged SmolLM2-135M-Instruct; "tiny" = a tiny random Llama built
    # locally; otherwise a local Hugging Face folder or a hub name.
    # contraction_block > 0: float32 matmuls summed in blocks (torch's accuracy on CPU, ~1.7x
    # slower there; see jaxrlhf.models.layers.contract). 0 = one dot per matmul.
    # dtype: the compute dtype; param_dtype: the trained models' parameters and optimizer state
    # (float32 master weights: an Adam step at lr 8e-7 rounds away in bfloat16); frozen models
    # (reference, reward) are held in the compute dtype. logprob_chunk > 0: token log-probs
    # computed that many positions at a time (no [rows, T, vocab] float32 logits at once).
    # architecture: a hub name or folder whose config.json gives the shapes when `path` is not
    # there yet (a recipe stage's output dir before that stage ran; `jaxrlhf.plan`).
    c.model = dict(
        path="smollm2",
        architecture="",
        dtype="float32",
        param_dtype="float32",
        remat=False,
        contraction_block=0,
        logprob_chunk=0,
    )
    c.mesh = dict(shape=(1, -1, 1))
    # The learner hardware this config is sized for (`python -m jaxrlhf.plan` checks it fits).
    c.hardware = dict(devices=1, device_memory_gib=24.0)
    c.distributed = dict(enabled=False, coordinator_address="", num_processes=1, process_id=0)
    c.task = dict(
        name="arithmetic",  # arithmetic | tldr | nobots | gsm8k (jaxrlhf.data.recipes)
        source="",  # dataset hub name or local path; "" = the task's default
        preference_source="",  # reward-model stage: preference pairs; "" = the task's default
        # Three splits (jaxrlhf.data.splits): train; validation, for evaluations during a run
        # and for choosing hyper-parameters; test, for the reported figure only. "" = the
        # dataset's own split of that role; a dataset without a validation split gets one
        # carved out of its train split by a hash of each example's id (validation_fraction).
        train_split="",
        eval_split="",  # the validation split
        test_split="",
        validation_fraction=0.05,
        num_train=256,  # prompts / examples used; 0 = all
        num_eval=128,  # validation prompts
        num_test=0,  # test prompts (0 = the whole test split)
        # RLHF reward: "" = the task's verifiable reward (arithmetic, gsm8k); else a reward
        # model (a folder with a score head, e.g. the reward stage's output dir).
        reward_model="",
        reward_model_architecture="",  # its shapes before it exists (as model.architecture)
    )
    c.rollout = dict(
        prompts_per_batch=8,
        samples_per_prompt=2,
        temperature=0.7,
        max_prompt_tokens=64,
        # The learner pads each batch's prompts to its longest one rounded up to a multiple of
        # this (at most max_prompt_tokens), not always to max_prompt_tokens: fewer padded
        # columns to compute. Each new width compiles the learner's functions once; 0 = always
        # max_prompt_tokens (one shape).
        prompt_pad_multiple=16,
        max_response_tokens=16,
        # Each response's least length: EOS is not sampled before this many tokens (vLLM's
        # min_tokens). 0 = none. Benchmarks use it to fix the generation work per batch
        # (bench/pipeline_modes.py --workload balanced). The sampler's log-probs are then those
        # of the distribution with EOS masked out (renormalised), not the policy's: the `kl`
        # metric, read from them unless loss_params.old_logprobs="learner", runs high (about
        # 1.5 nats at step 1 of that workload, where it is 0 without it).
        min_response_tokens=0,
        # At most this many of a rollout call's samples in a generator's engine at once (0 = no
        # limit; GenerateRequest.max_running): a slower sampler than the engine, for rollouts
        # only, while evaluations still get the whole engine (the compute experiment's
        # generation-bound workload). Needs "drain" swaps.
        max_running=0,
        weight_sync_dtype="",  # published weights: "" = the compute dtype (model.dtype)
        # Seeded generation calls: batch i's samples depend only on (seed, i, weights), so a
        # resumed run regenerates exactly; each call then runs alone on its replica.
        seeded=True,
        # Generation that continues across batches (jaxrlhf.rl.continuous): each prompt is its
        # own call, started as soon as its batch's staleness bound allows and a replica has
        # room (generator.capacity), so several batches may be generating at once. Exact resume
        # is not promised in this mode; seeded calls seed each request instead of running alone.
        continuous=False,
        # Each prompt's own response budget (benchmarks of long tails): "" = max_response_tokens
        # for all; "pareto:A:M" = drawn from a Pareto law of shape A and minimum M tokens,
        # capped at max_response_tokens, a function of (seed, the prompt's position).
        length_law="",
    )
    c.loss = "online_dpo"  # a name from jaxrlhf.losses.LOSSES
    c.loss_params = dict(
        beta=0.1,
        kl_coef=0.05,
        clip=0.2,
        clip_value=0.2,
        vf_coef=0.1,
        gamma=1.0,
        lam=0.95,
        whiten_advantages=True,
        # A response without EOS (cut at max_response_tokens) scores penalty_reward_value.
        missing_eos_penalty=True,
        penalty_reward_value=-1.0,
        # π_old of the importance ratio (ppo, rloo, grpo): "sampler" (the generator's own
        # log-probs: the ratio then corrects for the behaviour policy) or "learner" (a
        # recompute by the learner before the update; also logs logprob_gap).
        old_logprobs="sampler",
        # The off-policy correction of r_t = π_learner(y_t) / π_sampler(y_t) (needs
        # old_logprobs="learner"; ppo, grpo, rloo; formulas in jaxrlhf/losses/importance.py):
        # "none"; "truncate": each term weighted by min(r_t, truncated_is_cap) (RLOO: its
        # sequence's Π_t r_t); "mask": a token's term kept when is_low <= r_t <= is_high,
        # dropped otherwise; "sequence_mask": a sequence kept whole when exp(mean_t log r_t) is
        # in [is_low, is_high], dropped whole otherwise. A dropped token or sequence gets zero
        # gradient and leaves the normaliser. truncated_is_cap > 0 alone selects "truncate".
        is_correction="none",
        truncated_is_cap=0.0,
        is_low=0.0,  # 0 = the correction's default: 0.5 for "mask", 0.99 for "sequence_mask"
        is_high=0.0,  # 0 = the correction's default: 2.0 for "mask", 1.01 for "sequence_mask"
        value_model_path="",  # PPO: "" = initialise the value model from the policy
    )
    # 0 = synchronous on-policy; 1 = one-step-off asynchronous; N = N versions behind at most.
    c.max_staleness = 1
    c.sync_every = 1  # publish weights every this many updates
    # The paper's test bed: N mini-batches generated with one policy, then N updates. N > 0 sets
    # sync_every = N and max_staleness = N - 1 (see `resolve`).
    c.num_mini_batches = 0
    c.total_steps = 20  # optimizer updates (RLHF) or steps (SFT)
    c.train = dict(
        learning_rate=1e-6,
        max_grad_norm=1.0,
        weight_decay=0.0,
        batch_size=8,  # sft
        max_length=64,  # sft
        # Sequences per forward/backward (0 = the whole batch at once): the train step
        # accumulates gradients over micro-batches of this many sequences (a pair counts as
        # two) and takes one optimizer step, equal to the whole batch's; the learner's other
        # forwards (reference, recompute, values, reward model) run this many rows at a time.
        micro_batch_size=0,
        # RLHF: optimizer updates on each batch, one after the other, each on the whole batch
        # (the paper's num_ppo_epochs, for generation-bound runs). π_old of the importance
        # ratio is fixed before the first (PPO's epochs), so later passes are clipped against
        # it. A step (total_steps, policy versions, staleness, checkpoints) is still one batch.
        updates_per_batch=1,
        log_every=1,
    )
    c.checkpoint = dict(every=10)
    c.eval = dict(
        # Greedy evaluations of the RLHF stage on the validation split: before training, after
        # it, and every `every` steps (0 = never). `test`: also on the test split, before and
        # after training (summary.json: test_*), the figure to report, and every `test_every`
        # steps (0 = never; metrics.jsonl: test_accuracy / test_reward).
        at_start=True,
        at_end=True,
        every=0,
        test=True,
        test_every=0,
        # `python -m jaxrlhf.evaluate`: win rate against the references under this gold reward
        # model ("" = no win rate), and the KL proxy: this model's perplexity on the policy's
        # responses ("" = config.model.path, the model the run started from).
        gold_reward_model="",
        sft_model="",
        max_tokens=0,  # 0 = rollout.max_response_tokens
    )
    c.generator = dict(
        addresses="",  # "host:port[,host:port...]"; "" = start one locally
        auth_token_env="JAXRLHF_GENERATOR_AUTH_TOKEN",
        dtype="float32",
        max_model_len=256,
        seed=0,
        cpus="",  # e.g. "1": pin a locally started generator to these cores
        # A locally started generator on CPU: cores vLLM keeps free of its compute threads
        # (-1 = vLLM's default, one). 0: greedy evaluation, which runs while the learner waits,
        # uses every core (twice as fast on 2 cores; README, "The generator service").
        cpu_reserved_cores=0,
        # How weights reach the generators: "auto" = through a shared-memory file when every
        # generator runs on this host, else streamed over gRPC; "stream"; "shared".
        weight_transport="auto",
        # Bytes of weight data per gRPC message when streamed. The sender holds about ten
        # chunks at a time (its queue, the one being encoded, gRPC's copies): a learner process
        # publishing its slices holds its own shards plus that (bench/publish_memory.py).
        weight_chunk_bytes=4 << 20,
        # Publish version v from a copy of v's parameters (one more copy of the policy on the
        # learner's devices, in the published dtype) in a thread, beside the learner's next
        # step, instead of in it (jaxrlhf.rl.publisher). One-process learners only.
        publish_in_background=True,
        # How a generator this run starts swaps weights (`python -m generator_service
        # --swap-mode`): "drain" (a swap waits for running calls; a sample never spans one) or
        # "in-flight" (running requests continue on the new weights: a sample's tokens may
        # come from two versions, each with its own version and log-prob). in_flight_kv: "keep"
        # the KV cache computed with older weights, or "recompute" it at each swap. Generators
        # at `addresses` must run in this mode (checked at start).
        swap_mode="drain",
        in_flight_kv="keep",
        # Staged swaps of a generator this run starts (`--stage`/`--no-stage`): each update is
        # converted into the engine's layout while generation goes on and the swap pauses only
        # to copy it in, at the cost of one more copy of the weights in the generator's memory.
        stage=True,
        # Deadlines (seconds) of the calls to a replica; one that misses one is treated as
        # dead (its prompts fail over to the others). generate_timeout_s 0 = per call:
        # 30 s + rows x max_tokens / 50 (jaxrlhf.rl.pool.Timeouts).
        generate_timeout_s=0.0,
        update_timeout_s=600.0,
        status_timeout_s=5.0,
        # Failed replicas are probed this often; one that answers again gets the current weights
        # and rejoins. A replica started by this run is restarted instead, at most max_restarts
        # times. With no live replica for no_replica_timeout_s, the run stops with an error.
        probe_interval_s=2.0,
        max_restarts=3,
        no_replica_timeout_s=600.0,
        # Continuous generation: a replica's capacity in sequences (0 = its engine's
        # max_num_seqs, from GetStatus); a prompt's call starts while one is free.
        # max_num_seqs: of a generator this run starts (0 = vLLM's default).
        capacity=0,
        max_num_seqs=0,
    )
    c.learner_cpus = ""  # e.g. "0": pin the learner process to these cores
    c.export = True
    return c


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def model_options(model: ml_collections.ConfigDict, frozen: bool = False) -> dict:
    """`load_pretrained` keyword arguments from a config's `model` section; `frozen`: a model
    that is never trained (reference, reward) keeps its parameters in the compute dtype."""
    return dict(
        dtype=model.dtype,
        param_dtype=model.dtype if frozen else model.param_dtype,
        remat=model.remat,
        contraction_block=model.contraction_block,
        logprob_chunk=model.logprob_chunk,
    )


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
    shape = tuple(config.mesh.shape)
    _require(
        len(shape) == 3 and all(s == -1 or s >= 1 for s in shape) and shape.count(-1) <= 1,
        f"config.mesh.shape={shape}: three sizes (data, fsdp, tensor), each >= 1 or one -1",
    )
    train = config.train
    _require(config.total_steps >= 1, f"config.total_steps={config.total_steps}: >= 1")
    _check_length_law(config.rollout)
    for key in ("capacity", "max_num_seqs"):
        value = config.generator[key]
        _require(value >= 0, f"config.generator.{key}={value}: must be >= 0 (0 = the engine's)")
    running = config.rollout.max_running
    _require(running >= 0, f"config.rollout.max_running={running}: must be >= 0 (0 = no limit)")
    _require(
        not running or config.generator.swap_mode == "drain",
        f'config.rollout.max_running={running} needs config.generator.swap_mode="drain" '
        f"(got {config.generator.swap_mode!r}): under in-flight swaps a sample submitted "
        "late in its call would run on newer weights than its call was admitted under",
    )
    reserved = config.generator.cpu_reserved_cores
    _require(
        reserved >= -1,
        f"config.generator.cpu_reserved_cores={reserved}: must be >= 0 (-1 = vLLM's default)",
    )
    transports = ("auto", "stream", "shared")
    _require(
        config.generator.weight_transport in transports,
        f"config.generator.weight_transport={config.generator.weight_transport!r}: "
        f"must be one of {transports}",
    )
    from jaxrlhf_wire.chunks import MAX_CHUNK_BYTES

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
    _require(bool(config.output_dir), "config.output_dir: must name a folder")
    _require(config.task.name in TASKS, f"config.task.name={config.task.name!r}: one of {TASKS}")
    if config.stage == "reward":
        _require(
            config.task.name in ("tldr", "nobots"),
            f"config.task.name={config.task.name!r}: the reward stage needs preference pairs "
            f"('tldr' or 'nobots')",
        )
    if config.stage == "rlhf":
        _validate_rlhf(config)


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
            f"[{low}, {high}] of is_correction={kind!r} must hold a ratio of 1 (0 = default)",
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
        config.task.reward_model or config.task.name in VERIFIABLE,
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
    for key in ("prompts_per_batch", "max_prompt_tokens", "max_response_tokens"):
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


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing, for `app.run(main, flags_parser=parse_flags)` in every entry point
    with a `--config`: an override of a key the config does not have exits 2 with one line
    (`config error: unknown key config.train.learning_rte; closest known keys: ...`) instead
    of ml_collections' traceback. Other flag errors keep absl's own message."""
    try:
        return app.parse_flags_with_usage(list(argv))
    except (AttributeError, KeyError):
        message = unknown_override_message(argv)
        if message is None:
            raise
        print(f"config error: {message}", file=sys.stderr)
        sys.exit(2)


def unknown_override_message(argv: Sequence[str]) -> str | None:
    """What is wrong with the first `--config.KEY` override of argv whose key the config file
    (`--config=PATH[:ARG]`) lacks, with the closest known keys; None when every key exists."""
    path = _config_argument(argv)
    if path is None:
        return None
    config = flags.FLAGS["config"].parser.parse(path)  # the entry point's config file parser
    known = list(config_keys(config))
    for key in _override_keys(argv):
        if key not in known and not any(k.startswith(key + ".") for k in known):
            close = closest_keys(key, known)
            hint = (
                "closest known keys: " + ", ".join(f"config.{k}" for k in close)
                if close
                else "jaxrlhf/config.py:base_config() lists every key"
            )
            return f"unknown key config.{key}; {hint}"
    return None


def config_keys(config: ml_collections.ConfigDict, prefix: str = "") -> Iterator[str]:
    """The dotted paths of every leaf of `config` ("train.learning_rate", ...)."""
    for name, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from config_keys(value, f"{prefix}{name}.")
        else:
            yield prefix + name


def closest_keys(key: str, known: Sequence[str], count: int = 3) -> list[str]:
    """Up to `count` known keys most like `key`: by the whole path (a typo) or by its last
    part (a key put in the wrong section), best first."""

    def similarity(candidate: str) -> float:
        whole = difflib.SequenceMatcher(None, key, candidate).ratio()
        last = difflib.SequenceMatcher(None, key.split(".")[-1], candidate.split(".")[-1]).ratio()
        return max(whole, last if last >= 0.8 else 0.0)

    scored = sorted(((similarity(k), k) for k in known), key=lambda item: -item[0])
    return [k for score, k in scored[:count] if score >= 0.7]


def _config_argument(argv: Sequence[str]) -> str | None:
    """The value of `--config=PATH` (or `--config PATH`) in argv, None without one."""
    for i, arg in enumerate(argv):
        match = re.fullmatch(r"--?config(=(.*))?", arg)
        if match and match.group(1):
            return match.group(2)
        if match:
            return argv[i + 1] if i + 1 < len(argv) else None
    return None


def _override_keys(argv: Sequence[str]) -> list[str]:
    """The keys of the `--config.KEY[=VALUE]` (or `--noconfig.KEY`) overrides, in order."""
    keys = []
    for arg in argv:
        match = re.match(r"--?(?:no)?config\.([^=]+)", arg)
        if match:
            keys.append(match.group(1))
    return keys

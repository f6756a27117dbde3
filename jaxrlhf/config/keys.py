"""Every key a run reads, with its default: `base_config()`, built section by section.

This is the one place a user reads to learn what a run can be told: each section's builder
lists its keys with their defaults (the Asynchronous RLHF paper's where it has one) and says
what each means. `configs/*.py` start from `base_config()`; `jaxrlhf.config.checks` checks the
values a run is given.
"""

from __future__ import annotations

import ml_collections
from ml_collections.config_dict import placeholder

STAGES = ("sft", "reward", "rlhf")
DTYPES = ("float32", "bfloat16", "float16")


def base_config() -> ml_collections.ConfigDict:
    """Every key a run reads, with defaults (the sections' builders below)."""
    c = ml_collections.ConfigDict()
    c.stage = "rlhf"
    c.seed = 0
    c.output_dir = "runs/default"
    c.resume = False
    c.model = model_keys()
    c.mesh = dict(shape=(1, -1, 1))
    # The learner hardware this config is sized for (`python -m jaxrlhf.plan` checks it fits).
    c.hardware = dict(devices=1, device_memory_gib=24.0)
    c.distributed = dict(enabled=False, coordinator_address="", num_processes=1, process_id=0)
    c.task = task_keys()
    c.rollout = rollout_keys()
    c.loss = "online_dpo"  # a name from jaxrlhf.losses.LOSSES
    c.loss_params = loss_params_keys()
    # 0 = synchronous on-policy; 1 = one-step-off asynchronous; N = N versions behind at most.
    c.max_staleness = 1
    c.sync_every = 1  # publish weights every this many updates
    # The paper's test bed: N mini-batches generated with one policy, then N updates. N > 0 sets
    # sync_every = N and max_staleness = N - 1 (see `resolve`).
    c.num_mini_batches = 0
    c.total_steps = 20  # optimizer updates (RLHF) or steps (SFT)
    c.train = train_keys()
    c.checkpoint = dict(every=10)
    c.eval = eval_keys()
    c.generator = generator_keys()
    c.learner_cpus = ""  # e.g. "0": pin the learner process to these cores
    c.export = True
    return c


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


def model_keys() -> dict:
    """`config.model`: the policy to start from and how it is held and computed."""
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
    # lora: the RLHF stage trains LoRA adapters of `rank` on the `targets` linear layers of a
    # Llama-family policy, the base frozen (`jaxrlhf.models.lora`; docs/lora.md). rank 0 = full
    # fine-tuning; alpha 0 = 2 x rank (the adapter's scale is alpha / rank).
    return dict(
        path="smollm2",
        architecture="",
        dtype="float32",
        param_dtype="float32",
        remat=False,
        contraction_block=0,
        logprob_chunk=0,
        lora=dict(
            rank=0,
            alpha=0.0,
            targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        ),
    )


def task_keys() -> dict:
    """`config.task`: the data, its three splits, and the reward."""
    return dict(
        name="arithmetic",  # arithmetic | tldr | nobots | gsm8k (jaxrlhf.data.task_registry)
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


def rollout_keys() -> dict:
    """`config.rollout`: how batches are sampled."""
    return dict(
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
        # Continuous generation: consecutive prompts of a batch per Generate call (their n
        # samples each). 1 = a call per prompt; more where answers are so short that a call's
        # fixed cost (its stream, its admission, its thread) outweighs the tail it saves.
        prompts_per_call=1,
        # Each prompt's own response budget (benchmarks of long tails): "" = max_response_tokens
        # for all; "pareto:A:M" = drawn from a Pareto law of shape A and minimum M tokens,
        # capped at max_response_tokens, a function of (seed, the prompt's position).
        length_law="",
    )


def loss_params_keys() -> dict:
    """`config.loss_params`: the losses' settings (`jaxrlhf.losses`)."""
    return dict(
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
        # The kept range of "mask" and "sequence_mask": None = the correction's default (0.5 and
        # 2.0 for "mask", 0.99 and 1.01 for "sequence_mask"); is_low=0 keeps every ratio below 1
        # (no lower bound: a ratio is > 0), is_high=inf every ratio above it (no upper bound).
        is_low=placeholder(float),
        is_high=placeholder(float),
        value_model_path="",  # PPO: "" = initialise the value model from the policy
    )


def train_keys() -> dict:
    """`config.train`: the optimizer and how a batch is computed."""
    return dict(
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
        # metrics.jsonl records each step's `samples_returned` ([prompt id, sample index] of every
        # sample, as it came back: the soak's exactly-once check); most of a record's bytes, so
        # experiments whose records are committed turn it off.
        log_samples_returned=True,
    )


def eval_keys() -> dict:
    """`config.eval`: held-out evaluations."""
    return dict(
        # Greedy evaluations of the RLHF stage on the validation split: before training, after
        # it, and every `every` steps (0 = never). `test`: also on the test split, before and
        # after training (summary.json: test_*), the figure to report, and every `test_every`
        # steps (0 = never; metrics.jsonl: test_accuracy / test_reward).
        at_start=True,
        at_end=True,
        every=0,
        test=True,
        test_every=0,
        # How far the policy moved: at each validation evaluation (and at the end), the KL of
        # the served policy from the reference on its own samples of the first `kl_prompts`
        # validation prompts (one sample each at rollout.temperature: mean over samples of
        # Σ_t log π − log π_ref; metrics.jsonl: policy_kl, summary.json: policy_kl_end).
        # 0 = off; only in a run with a reference model. Unlike each step's `kl` (the sampler's,
        # on the training batch) it sees the learner's drift at any staleness.
        kl_prompts=0,
        # `python -m jaxrlhf.evaluate`: win rate against the references under this gold reward
        # model ("" = no win rate), and the KL proxy: this model's perplexity on the policy's
        # responses ("" = config.model.path, the model the run started from).
        gold_reward_model="",
        sft_model="",
        max_tokens=0,  # 0 = rollout.max_response_tokens
    )


def generator_keys() -> dict:
    """`config.generator`: the generator services a run starts or uses."""
    return dict(
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
        # Where vLLM runs the model of a locally started generator (`--engine-executor`): "mp", a
        # worker process of its own (vLLM's choice on CPU, which binds its threads to the cores);
        # "uni", in its engine-core process, on the cores cpu_reserved_cores leaves: ready ~6 s
        # sooner, but on 2 cores `make run`'s steps took 18.7 s against 15.8 beside the learner
        # (BENCHMARKS.md, "Time of make run"); "" = the service's default ($JAXRLHF_ENGINE_EXECUTOR,
        # else vLLM's).
        engine_executor="",
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
        # Preloaded swaps of a generator this run starts (`--preload`/`--no-preload`): each
        # update is converted into the engine's layout while generation goes on and the swap
        # pauses only to copy it in, at the cost of one more copy of the weights in the
        # generator's memory.
        preload=True,
        # Deadlines (seconds) of the calls to a replica; one that misses one is treated as
        # dead (its prompts fail over to the others). generate_timeout_s 0 = per call:
        # 30 s + rows x max_tokens / 50 (jaxrlhf.fleet.pool.Timeouts).
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

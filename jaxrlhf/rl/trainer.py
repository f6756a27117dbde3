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

import concurrent.futures
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrlhf.checkpointing import Checkpointer
from jaxrlhf.distributed import broadcast, driven_streams, is_driver
from jaxrlhf.models import hf_tensor_specs, iter_hf_tensors, save_pretrained
from jaxrlhf.rl.continuous import ContinuousProducer
from jaxrlhf.rl.eval_cache import EvaluationCache, folder_digest
from jaxrlhf.rl.learner import Learner
from jaxrlhf.rl.metrics import MetricsWriter
from jaxrlhf.rl.pool import GeneratorPool
from jaxrlhf.rl.rollout import PromptItem, Rollout, RolloutProducer, parse_length_law
from jaxrlhf.rl.tasks import Task
from jaxrlhf.sharding import make_mesh

_SPLIT_NAMES = {"eval": "validation", "test": "test"}


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


def prompts_for_batch_fn(
    task: Task, prompts_per_batch: int, seed: int, length_law: str = "", max_tokens: int = 0
):
    """batch index -> its prompts; a pure function of (seed, index), so a resumed run gets the
    same prompts. Each epoch over the training prompts is a fresh permutation. `length_law`
    (`rollout.length_law`) gives each prompt its own response budget, at most `max_tokens`."""
    items = task.train_prompts
    count = len(items)
    budget = parse_length_law(length_law, max_tokens)

    def prompts_for_batch(index: int) -> list[PromptItem]:
        out = []
        for position in range(index * prompts_per_batch, (index + 1) * prompts_per_batch):
            epoch, offset = divmod(position, count)
            order = np.random.default_rng([seed, epoch]).permutation(count)
            item = items[order[offset]]
            if budget is not None:
                item = dataclasses.replace(item, max_tokens=budget(seed, position))
            out.append(item)
        return out

    return prompts_for_batch


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
    responses to `prompts` with the weights the generator serves now (the driver generates, or
    reads them from `cache`, which must describe those weights; every process scores: a reward
    model runs on the whole mesh). `wait(generate)`: how every process waits for the driver's
    `generate()` (None elsewhere) and gets its result; by default a plain call (the loop's,
    `in_background`, rejoins replicas meanwhile)."""

    def generate():
        ids, sampling = [p.token_ids for p in prompts], greedy_sampling(max_tokens)
        responses = cache.load(ids, sampling) if cache is not None else None
        if responses is None:
            responses = greedy_responses(pool, prompts, max_tokens)
            if cache is not None:
                cache.store(ids, sampling, responses, note=f"{task.name}: {len(ids)} prompts")
        return responses

    responses = (wait or call_on_driver)(generate if is_driver() else None)
    return learner.score(task, prompts, responses)


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


def publish(
    learner: Learner,
    pool: GeneratorPool | None,
    version: int,
    dtype: str | None,
    rollback=False,
    rejoining_only: bool = False,
):
    """Publishes the policy as `version` (to the replicas that rejoin only, with
    `rejoining_only`); every process gathers its tensors (one at a time), the driver sends them
    (`distributed.driven_streams`). Returns the driver's PublishStats."""
    policy_params = learner.state.params["policy"]
    specs = hf_tensor_specs(learner.policy, policy_params, dtype)
    return driven_streams(
        lambda: iter_hf_tensors(learner.policy, policy_params, dtype),
        lambda tensors: pool.publish_weights(tensors, len(specs), version,
                                             allow_rollback=rollback, specs=specs,
                                             rejoining_only=rejoining_only),
    )  # fmt: skip


REJOIN_POLL_SECONDS = 1.0


def receive_batch(learner, producer, pool, version: int, sync_dtype) -> Rollout:
    """The next batch (the driver's, on every process), rejoining replicas while it is not
    there (`wait_rejoining`)."""
    poll = None if producer is None else lambda timeout: producer.next(timeout=timeout)
    return wait_rejoining(poll, learner, pool, version, sync_dtype)


def pending_rollouts(learner, producer, pool, version: int, sync_dtype) -> list[Rollout]:
    """The batches a checkpoint at learner `version` holds (`RolloutProducer.snapshot`; the
    driver's, on every process), rejoining replicas while they are being generated: a batch
    that waits for a live replica completes only once one has the weights again."""
    poll = None if producer is None else lambda timeout: producer.snapshot(version, timeout)
    return wait_rejoining(poll, learner, pool, version, sync_dtype)


def in_background(fn, learner, pool, version: int, sync_dtype):
    """fn() run by the driver (None elsewhere) in a thread, its result on every process,
    rejoining replicas meanwhile (`wait_rejoining`): an evaluation waits for generation too."""
    if fn is None:
        return wait_rejoining(None, learner, pool, version, sync_dtype)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evaluation") as thread:
        future = thread.submit(fn)
        return wait_rejoining(future.result, learner, pool, version, sync_dtype)


def wait_rejoining(poll, learner, pool, version: int, sync_dtype):
    """`poll(timeout)`'s result (the driver's poll; None on the other processes), broadcast to
    every process; `poll` raises TimeoutError while there is none. Until then, replicas that
    answer again get the learner's current weights as their own `version` (every process takes
    part in that publish), also between two publishes (sync_every > 1), when that version is
    ahead of the one the others serve: no host copy of the published weights is kept for them,
    and what they then sample is newer than the others' (within the staleness bound), each
    token tagged with its true version. Only the learner publishes, so whatever it waits for
    that needs generation (a batch, a checkpoint's batches, an evaluation) must rejoin too."""
    while True:
        event = None
        if poll is not None:  # the driver
            try:
                event = ("done", poll(REJOIN_POLL_SECONDS))
            except TimeoutError:
                event = ("rejoin", None) if pool.needs_weights() else ("wait", None)
        kind, result = broadcast(event)
        if kind == "done":
            return result
        if kind == "rejoin":
            publish(learner, pool, version, sync_dtype, rejoining_only=True)


def run_rlhf(config, model_path: Path, task: Task, pool: GeneratorPool | None, log) -> RunResult:
    """Runs (or resumes) the RLHF loop against already-serving generator replicas.

    Over several processes (`jaxrlhf.distributed`) every process runs this; only the driver has
    a `pool` (None elsewhere), runs the rollout producer and writes files.
    """
    cfg = config
    driver = is_driver()
    out = Path(cfg.output_dir)
    mesh = make_mesh(tuple(cfg.mesh.shape))
    learner = Learner(cfg, model_path, mesh)
    log(f"learner mesh {dict(mesh.shape)} over {jax.process_count()} process(es)")
    k = cfg.rollout.samples_per_prompt
    learner.spec.check(k, has_value_model=learner.value is not None)
    checkpointer = Checkpointer(out / "checkpoints", cfg.checkpoint.every)
    sync_dtype = cfg.rollout.weight_sync_dtype or cfg.model.dtype
    # Versions are the generator's: a run starts at the version serving when it begins, and
    # step i's update publishes base_version + i + 1.
    serving = same_start = None
    if driver:
        statuses = pool.wait_until_serving()
        serving = max(status.policy_version for status in statuses)
        same_start = serving == 0 and all(
            Path(status.model).expanduser().resolve() == Path(model_path).resolve()
            for status in statuses
        )
    serving, same_start = broadcast((serving, same_start))
    start_step, base_version, version = 0, serving, serving
    # The version the generators serve for this run (last published): below `version` between
    # two publishes when sync_every > 1.
    published = version
    rollback = False  # whether the next publish may go to replicas serving a newer version
    pending: list[Rollout] = []
    resumed_start: dict[str, float] = {}  # evaluations before training, kept in checkpoints
    if cfg.resume and checkpointer.latest_step() is not None:
        learner.state, meta = checkpointer.restore(None, learner.state)
        start_step, base_version = meta["step"], meta["base_version"]
        version = meta["policy_version"]
        published = meta.get("published_version", version)
        pending = [Rollout.from_json(r) for r in meta["pending_rollouts"]]
        resumed_start = dict(meta.get("evaluated_at_start", {}))
        log(f"resumed from step {start_step} (policy version {version})")
        # The generator may have kept serving weights published after the checkpoint: roll it
        # back to the checkpoint's weights under the checkpoint's version. Between two
        # publishes (sync_every > 1) the checkpoint lacks the served weights: every batch that
        # runs on them is in `pending`, and the next due publish rolls the generator back.
        rollback = published != version
        if not rollback:
            publish(learner, pool, version, sync_dtype, rollback=True)
    else:
        if cfg.resume:
            log("resume requested but no checkpoint found: starting fresh")
        if not same_start:
            # The generator serves other weights (an earlier run's, or another model folder):
            # publish this run's initial ones.
            base_version = version = published = serving + 1
            publish(learner, pool, version, sync_dtype)
    writer = (
        MetricsWriter(out, cfg.total_steps, start_step, resume=start_step > 0) if driver else None
    )
    eval_tokens = cfg.rollout.max_response_tokens
    name = "accuracy" if task.verifiable else "reward"
    metric = f"eval_{name}"  # the validation split's; test_{name}: the test split's
    splits = {"eval": task.eval_prompts}
    if cfg.eval.test and task.test_prompts:
        splits["test"] = task.test_prompts

    def evaluate(split: str, cache: EvaluationCache | None = None) -> np.ndarray:
        def wait(generate):  # with the learner's weights of now, should a replica rejoin
            return in_background(generate, learner, pool, version, sync_dtype)

        # Not a step: left out of the progress bar's rate and ETA.
        with writer.paused() if writer is not None else contextlib.nullcontext():
            return evaluate_greedy(pool, task, splits[split], eval_tokens, learner, cache, wait)

    at_start = resumed_start
    if cfg.eval.at_start and start_step == 0:
        # The generators serve the model folder's own weights: its responses may be cached.
        cache = start_evaluation_cache(pool, model_path) if driver and same_start else None
        for split in splits:
            at_start[split] = float(np.mean(evaluate(split, cache)))
            log(f"{_SPLIT_NAMES[split]} greedy {name} before training: {at_start[split]:.3f}")
        if cache is not None and cache.hits:
            log(f"(responses of the unchanged model to the unchanged prompts read from "
                f"{cache.root}: delete it to generate them again)")  # fmt: skip
    producer = None
    if driver:
        producer = (ContinuousProducer if cfg.rollout.continuous else RolloutProducer)(
        pool,
        prompts_for_batch_fn(task, cfg.rollout.prompts_per_batch, cfg.seed,
                             cfg.rollout.length_law, cfg.rollout.max_response_tokens),
        _sampling(cfg),
        max_staleness=cfg.max_staleness,
        start_batch=start_step,
        published_version=published,
        end_batch=cfg.total_steps,
        base_version=base_version,
        generation_seed=cfg.seed if cfg.rollout.seeded else None,
        pending=pending,
    )  # fmt: skip
    started = time.perf_counter()
    records = []
    fleet = FleetWatch(pool) if pool is not None else None
    try:
        for step in range(start_step, cfg.total_steps):
            record = train_one_step(learner, producer, pool, task, cfg, version, base_version,
                                    sync_dtype, fleet, rollback=rollback)  # fmt: skip
            version = record["policy_version"]
            if publish_due(version - base_version, cfg):
                published, rollback = version, False
            last = step + 1 == cfg.total_steps
            for split, every in (("eval", cfg.eval.every), ("test", cfg.eval.test_every)):
                # (the end of the run is evaluated below)
                due = every and (step + 1) % every == 0 and not (last and cfg.eval.at_end)
                if due and split in splits:
                    key = metric if split == "eval" else f"test_{name}"
                    record[key] = float(np.mean(evaluate(split)))
            if writer is not None:
                writer.write(step + 1, record)
            records.append({"step": step + 1, **record})
            if last or checkpointer.due(step + 1):
                # Batches generated on older weights and not trained on yet (async mode).
                held = [] if last else pending_rollouts(learner, producer, pool, version,
                                                        sync_dtype)  # fmt: skip
                meta = {
                    "step": step + 1,
                    "policy_version": version,
                    "published_version": published,
                    "base_version": base_version,
                    "seed": cfg.seed,
                    "evaluated_at_start": at_start,
                    "pending_rollouts": [r.to_json() for r in held],
                }  # fmt: skip
                checkpointer.save(step + 1, learner.state, meta, force=True)
    finally:
        if driver:
            producer.close()
            writer.close()
        checkpointer.close()
    summary = {
        "steps": cfg.total_steps,
        "policy_version": version,
        "wall_seconds": time.perf_counter() - started,
        f"{metric}_start": at_start.get("eval"),
    }
    if "test" in splits:
        summary[f"test_{name}_start"] = at_start.get("test")
    if cfg.eval.at_end:
        for split in splits:
            scores = evaluate(split)
            prefix = metric if split == "eval" else f"test_{name}"
            summary[f"{prefix}_end"] = float(np.mean(scores))
            summary[f"{prefix}_end_stderr"] = standard_error(scores)
            summary[f"{split}_prompts"] = len(scores)
    if records:
        tail = records[-min(len(records), 5) :]
        for key in ("reward_mean", "kl", "staleness_mean"):
            if all(key in r for r in tail):
                summary[f"{key}_last5"] = float(np.mean([r[key] for r in tail]))
    if records and driver:
        from jaxrlhf.report import plot_training

        points = []
        if metric == "eval_accuracy":  # the plot's eval panel: before, during (records), after
            end, eval_start = summary.get(f"{metric}_end"), at_start.get("eval")
            points = [(0, eval_start)] if eval_start is not None else []
            points += [(records[-1]["step"], end)] if end is not None else []
        summary["plot"] = str(plot_training(out / "metrics.jsonl", out / "training.png",
                                            eval_points=points, x="time"))  # fmt: skip
    if cfg.export:
        folder = save_pretrained(learner.policy, learner.state.params["policy"],
                                 out / "hf_export", tokenizer_from=model_path,
                                 write=driver)  # fmt: skip
        summary["export_dir"] = str(folder)
    if driver:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return RunResult(summary, records)


class FleetWatch:
    """The generators' health and occupancy for each step's record, as changes since the end of
    the previous step (or the start of the loop): whatever happens between two steps (an
    evaluation, a checkpoint) counts in the next, and nothing is lost."""

    COUNTERS = ("failures", "failovers", "restarts", "rejoins")

    def __init__(self, pool: GeneratorPool):
        self.pool = pool
        self._counts, self._busy = pool.metrics(), pool.occupancy()
        self._at = time.perf_counter()

    def step(self) -> dict[str, Any]:
        counts, busy, now = self.pool.metrics(), self.pool.occupancy(), time.perf_counter()
        record: dict[str, Any] = {"generators_live": counts["generators_live"]}
        record |= {f"generator_{k}": counts[k] - self._counts[k] for k in self.COUNTERS}
        record |= occupancy_metrics(self._busy, busy, now - self._at)
        self._counts, self._busy, self._at = counts, busy, now
        return record


def occupancy_metrics(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Over `seconds`, averaged over the replicas that answered both times (`before`, `after`:
    `GeneratorPool.occupancy`): generator_idle_s, the seconds a replica generated nothing (no
    request, or paused for a swap); generator_requests_mean, how many requests it was
    generating on average; generator_occupancy, that mean ÷ its capacity (max_num_seqs), in
    [0, 1] (a replica reporting no capacity, older than the field, is left out of it)."""
    both = [target for target in after if target in before]
    if not both or seconds <= 0:
        return {}
    idle = [after[t][0] - before[t][0] for t in both]
    requests = {t: (after[t][1] - before[t][1]) / seconds for t in both}
    out = {
        "generator_idle_s": float(np.mean(idle)),
        "generator_requests_mean": float(np.mean(list(requests.values()))),
    }
    shares = [requests[t] / after[t][2] for t in both if after[t][2]]
    if shares:
        out["generator_occupancy"] = float(np.mean(shares))
    return out


def staleness_metrics(rollout: Rollout, learner_version: int) -> dict[str, float]:
    """How many versions behind `learner_version` (the parameters the update starts from) the
    batch was sampled: staleness_mean/max per sample (its oldest token, the first), and
    token_staleness_mean/max over every response token. mixed_version_fraction: the share of
    samples whose tokens come from more than one version (in-flight swaps)."""
    samples = rollout.samples
    oldest = learner_version - np.array([s.oldest_version for s in samples])
    tokens = learner_version - np.concatenate([np.asarray(s.token_versions) for s in samples])
    return {
        "staleness_mean": float(oldest.mean()),
        "staleness_max": int(oldest.max()),
        "token_staleness_mean": float(tokens.mean()) if tokens.size else 0.0,
        "token_staleness_max": int(tokens.max()) if tokens.size else 0,
        "mixed_version_fraction": float(np.mean([len(set(s.token_versions)) > 1 for s in samples])),
    }


def publish_due(updates: int, cfg) -> bool:
    """Whether the run publishes after its `updates`-th update: every `sync_every`, and last."""
    return updates % cfg.sync_every == 0 or updates == cfg.total_steps


def samples_returned(rollout: Rollout) -> list[list]:
    """[prompt id, sample index] of each sample, in the order the generators returned them:
    what came back, to check against the schedule (`prompt_ids`) for a lost or doubled sample."""
    return [[rollout.prompts[s.prompt_index].id, s.sample_index] for s in rollout.samples]


def train_one_step(
    learner: Learner,
    producer,
    pool,
    task,
    cfg,
    version,
    base_version,
    sync_dtype,
    fleet: FleetWatch | None = None,
    rollback: bool = False,
) -> dict[str, Any]:
    """One update of the loop: wait for the next batch, learn from it, publish when due (with
    `rollback`, to replicas that may serve a newer version: the first publish after resuming
    between two publishes)."""
    t0 = time.perf_counter()
    rollout = receive_batch(learner, producer, pool, version, sync_dtype)
    wait_s = time.perf_counter() - t0
    learned = learner.learn(rollout, task)
    version += 1
    sync_s = 0.0
    if publish_due(version - base_version, cfg):
        if producer is not None:
            producer.wait_admitted()
        published = time.perf_counter()
        stats = publish(learner, pool, version, sync_dtype, rollback=rollback)
        if producer is not None:
            producer.publish(version)
        sync_s = stats.seconds if stats is not None else time.perf_counter() - published
    staleness = staleness_metrics(rollout, version - 1)
    step_s = time.perf_counter() - t0
    return {
        "policy_version": version,
        **learned,
        "prompts": len(rollout.prompts),
        "samples": len(rollout.samples),
        "prompt_ids": [p.id for p in rollout.prompts],  # the batch's, in the schedule's order
        "samples_returned": samples_returned(rollout),
        **(fleet.step() if fleet is not None else {}),
        **staleness,
        "generation_tokens_per_s": rollout.num_tokens / max(rollout.generate_seconds, 1e-9),
        "wait_for_generation_s": wait_s,
        "generate_s": rollout.generate_seconds,  # from the batch's first call to its last end
        "weight_sync_s": sync_s,
        "step_s": step_s,
        # The share of the step the learner waited for its batch (nothing else to do).
        "learner_idle_fraction": wait_s / step_s if step_s > 0 else 0.0,
    }

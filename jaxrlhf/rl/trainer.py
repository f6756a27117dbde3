"""The asynchronous RLHF loop (the learner process), `run_rlhf`:

    begin: resume from a checkpoint, or start (Publisher: the versions)
    evaluate before training (Evaluator)
    for each step:
        rollout  <- producer (generated ≤ max_staleness versions ago, tagged with its version)
        scores   <- task reward (+ missing-EOS penalty)
        ref/old  <- reference log-probs, behaviour log-probs (sampler's or recomputed), values
        update   <- one optimizer step on the configured loss (jitted, on the mesh)
        publish  <- every `sync_every` updates, stream the weights to the generator(s)
        log, checkpoint

    evaluate after training, summarize, export

Generation happens in the generator service(s) while this process trains; the producer thread
(`rl/rollout.py`, or `rl/continuous.py`) only waits on gRPC; the publisher (`rl/publisher.py`)
sends the weights. Checkpoints hold everything needed to continue (see `begin`).
docs/ARCHITECTURE.md shows the pieces and the flow of a version, a batch and the weights.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxrlhf.checkpointing import Checkpointer
from jaxrlhf.data.lengths import parse_length_law
from jaxrlhf.distributed import broadcast, is_driver, to_host
from jaxrlhf.fleet.pool import GeneratorPool
from jaxrlhf.models import lora as lora_lib
from jaxrlhf.models import save_pretrained
from jaxrlhf.rl.continuous import ContinuousProducer
from jaxrlhf.rl.evaluator import Evaluator
from jaxrlhf.rl.learner import Learner
from jaxrlhf.rl.metrics import MetricsWriter
from jaxrlhf.rl.publisher import Publisher
from jaxrlhf.rl.rollout import PromptItem, Rollout, RolloutProducer
from jaxrlhf.rl.step_metrics import FleetWatch, samples_returned, staleness_metrics
from jaxrlhf.rl.tasks import Task
from jaxrlhf.sharding import make_mesh

# The summary's means over the last steps of a run (`{key}_last5`).
LAST_STEPS = 5
SUMMARY_KEYS = ("reward_mean", "kl", "staleness_mean")


@dataclasses.dataclass
class RunResult:
    """What a run leaves: its summary, and its per-step records in `metrics_path` (the
    driver's metrics.jsonl; a resumed run's hold the steps before its checkpoint too). The loop
    streams the records there and keeps none: a run of any length holds the same memory."""

    summary: dict[str, Any]
    metrics_path: Path | None = None

    @property
    def metrics(self) -> list[dict[str, Any]]:
        """Every step's record, read back from `metrics_path` ([] on other processes)."""
        if self.metrics_path is None or not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line]


def _sampling(config) -> dict[str, Any]:
    rollout = config.rollout
    sampling = dict(
        n=rollout.samples_per_prompt,
        temperature=rollout.temperature,
        top_p=1.0,
        top_k=-1,
        max_tokens=rollout.max_response_tokens,
        min_tokens=rollout.min_response_tokens,
    )
    if rollout.max_running:
        sampling["max_running"] = rollout.max_running
    return sampling


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


@dataclasses.dataclass
class RunStart:
    """Where a run begins: its publisher (the versions), the first step, the batches a
    checkpoint held, the evaluations before training it recorded, and whether the generators
    serve the model folder's own weights (`same_start`: its evaluation may be cached)."""

    publisher: Publisher
    step: int = 0
    pending: list[Rollout] = dataclasses.field(default_factory=list)
    at_start: dict[str, float] = dataclasses.field(default_factory=dict)
    same_start: bool = False


def begin(cfg, learner: Learner, pool, model_path: Path, checkpointer, log) -> RunStart:
    """Resumes from the newest checkpoint (`config.resume`) or starts afresh. Versions are the
    generators': a fresh run starts at the version serving (or publishes its own initial
    weights as the next one, when the generators serve anything else)."""
    dtype = cfg.rollout.weight_sync_dtype or cfg.model.dtype
    serving = same_start = None
    if is_driver():
        statuses = pool.wait_until_serving()
        serving = max(status.policy_version for status in statuses)
        same_start = serving == 0 and all(
            Path(status.model).expanduser().resolve() == Path(model_path).resolve()
            for status in statuses
        )
    serving, same_start = broadcast((serving, same_start))
    if cfg.resume and checkpointer.latest_step() is not None:
        check_lora_base(checkpointer.meta(), learner)
        learner.state, meta = checkpointer.restore(None, learner.state)
        version = meta["policy_version"]
        served = meta.get("served_version", meta.get("published_version", version))
        # The generators may serve weights the killed run published after its checkpoint:
        # outside the history of this run. Roll them back to the checkpoint's own weights,
        # under its version, before anything samples from them. Between two publishes
        # (sync_every > 1) those are newer than the ones the schedule released (`served`),
        # which stays the producer's gate: the batches that ran on the released weights are in
        # `pending` or, generated again, run on the checkpoint's (within the staleness bound).
        # A replica that misses this rollback (down meanwhile) keeps the killed run's weights;
        # when it answers again its version is not trusted: it rejoins with the learner's
        # weights, rollback allowed, before it serves (`jaxrlhf.fleet.delivery`).
        publisher = Publisher(learner, pool, dtype, meta["base_version"], version, served)
        publisher.send(rollback=True)
        log(f"resumed from step {meta['step']} (policy version {version})")
        pending = [Rollout.from_json(r) for r in meta["pending_rollouts"]]
        return RunStart(publisher, meta["step"], pending, dict(meta.get("evaluated_at_start", {})))
    if cfg.resume:
        log("resume requested but no checkpoint found: starting fresh")
    if same_start:
        return RunStart(Publisher(learner, pool, dtype, serving, serving, serving), same_start=True)
    # The generator serves other weights (an earlier run's, or another model folder): publish
    # this run's initial ones.
    publisher = Publisher(learner, pool, dtype, serving + 1, serving + 1, serving + 1)
    publisher.send()
    return RunStart(publisher)


def make_producer(cfg, task: Task, pool: GeneratorPool, start: RunStart, log=None):
    """The driver's rollout producer: batch at a time, or continuous (`rollout.continuous`,
    which logs each prompt it starts again after its replica failed)."""
    extra = ({"log": log, "prompts_per_call": cfg.rollout.prompts_per_call}
             if cfg.rollout.continuous else {})  # fmt: skip
    kind = ContinuousProducer if cfg.rollout.continuous else RolloutProducer
    return kind(
        pool,
        prompts_for_batch_fn(task, cfg.rollout.prompts_per_batch, cfg.seed,
                             cfg.rollout.length_law, cfg.rollout.max_response_tokens),
        _sampling(cfg),
        max_staleness=cfg.max_staleness,
        start_batch=start.step,
        served_version=start.publisher.served,
        end_batch=cfg.total_steps,
        base_version=start.publisher.base_version,
        # (continuous: unseeded for now: per-request seeds kill vLLM 0.32's CPU engine,
        # jaxrlhf.rl.continuous)
        generation_seed=cfg.seed if cfg.rollout.seeded and not cfg.rollout.continuous else None,
        pending=start.pending,
        **extra,
    )  # fmt: skip


def check_within_history(rollout: Rollout, learner_version: int) -> None:
    """Raises RuntimeError if a token of `rollout` has a version newer than `learner_version`
    (the weights the update starts from): no publish of this run made those weights, so they
    are another run's (a generator left serving what a killed run published after its last
    checkpoint) and the batch must not be trained on."""
    newest = max((max(s.token_versions, default=s.policy_version) for s in rollout.samples),
                 default=learner_version)  # fmt: skip
    if newest > learner_version:
        raise RuntimeError(
            f"batch {rollout.batch_index} has tokens of policy version {newest}, newer than the "
            f"learner's {learner_version}: they were sampled from weights this run never "
            "published (a generator serving another run's weights?); the batch is not trained on"
        )


def next_batch(publisher: Publisher, producer) -> Rollout:
    """The producer's next batch (the driver's, on every process), replicas that answer again
    brought back meanwhile (`Publisher.wait`). Every batch the learner trains on comes through
    here and is checked against the learner's version (`check_within_history`)."""
    poll = None if producer is None else lambda timeout: producer.next(timeout=timeout)
    rollout = publisher.wait(poll)
    check_within_history(rollout, publisher.version)
    return rollout


def checkpoint_batches(publisher: Publisher, producer) -> list[Rollout]:
    """The batches a checkpoint at the learner's version holds (the producer's `snapshot`; the
    driver's, on every process), replicas brought back while they are generated: a batch that
    waits for a live replica completes only once one has the weights again."""
    publisher.finish()
    poll = None if producer is None else lambda t: producer.snapshot(publisher.version, t)
    return publisher.wait(poll)


def check_lora_base(meta: dict, learner: Learner) -> None:
    """Refuses, before restoring, a checkpoint whose state this run's learner cannot take:
    a LoRA run's adapters resumed on another base (its files' digest differs), or adapters
    resumed as the whole policy and the converse."""
    saved, now = meta.get("lora_base"), learner.lora_base
    if (saved is None) != (now is None):
        trained = "LoRA adapters" if saved is not None else "the whole policy"
        raise ValueError(
            f"the checkpoint trained {trained} and this run trains "
            f"{'LoRA adapters' if now is not None else 'the whole policy'}: resume with the "
            f"checkpoint's model.lora.rank, or start afresh in a new output_dir"
        )
    if saved is not None and saved["digest"] != now["digest"]:
        raise ValueError(
            f"the checkpoint's LoRA adapters were trained on the base {saved['path']} (digest "
            f"{saved['digest'][:12]}), and this run's base {now['path']} differs (digest "
            f"{now['digest'][:12]}): resume with that base, or start afresh"
        )


def save_checkpoint(checkpointer, step: int, cfg, publisher: Publisher, producer, at_start):
    """The learner's state, with what a resumed run needs besides: the versions, the
    evaluations before training, and the batches generated on weights the checkpoint does not
    hold and not trained on yet (none at the end)."""
    publisher.finish()  # the versions below are settled
    held = [] if step == cfg.total_steps else checkpoint_batches(publisher, producer)
    meta = {
        "step": step,
        "policy_version": publisher.version,
        "served_version": publisher.served,
        "base_version": publisher.base_version,
        "seed": cfg.seed,
        "evaluated_at_start": at_start,
        "pending_rollouts": [r.to_json() for r in held],
    }
    if publisher.learner.lora_base is not None:
        meta["lora_base"] = publisher.learner.lora_base
    checkpointer.save(step, publisher.learner.state, meta, force=True)


def build_learner(config, model_path: Path, reward_model=None) -> Learner:
    """The learner of `run_rlhf` on the configured mesh (a caller may build it while its
    generators start: `jaxrlhf.stages.rlhf`)."""
    return Learner(config, model_path, make_mesh(tuple(config.mesh.shape)), reward_model)


def run_rlhf(config, model_path: Path, task: Task, pool: GeneratorPool | None, log,
             reward_model=None, learner: Learner | None = None) -> RunResult:  # fmt: skip
    """Runs (or resumes) the RLHF loop against already-serving generator replicas.

    Over several processes (`jaxrlhf.distributed`) every process runs this; only the driver has
    a `pool` (None elsewhere), runs the rollout producer and writes files. `reward_model(mesh)`:
    the task's reward-model scorer (`Learner`), None for a verifiable task. `learner`: one
    built already by `build_learner` with the same arguments (else built here).
    """
    cfg, driver, out = config, is_driver(), Path(config.output_dir)
    learner = learner or build_learner(cfg, model_path, reward_model)
    log(f"learner mesh {dict(learner.mesh.shape)} over {jax.process_count()} process(es)")
    learner.spec.check(cfg.rollout.samples_per_prompt, has_value_model=learner.value is not None)
    checkpointer = Checkpointer(out / "checkpoints", cfg.checkpoint.every)
    start = begin(cfg, learner, pool, model_path, checkpointer, log)
    publisher = start.publisher
    publisher.background = cfg.generator.publish_in_background and jax.process_count() == 1
    learner.keep_params = publisher.background  # what a publish sends, the next step keeps
    writer = (
        MetricsWriter(out, cfg.total_steps, start.step, resume=start.step > 0) if driver else None
    )
    evaluator = Evaluator(cfg, task, publisher, writer)
    at_start = start.at_start
    if cfg.eval.at_start and start.step == 0:
        at_start = evaluator.before_training(model_path if driver and start.same_start else None,
                                             log)  # fmt: skip
    producer = make_producer(cfg, task, pool, start, log) if driver else None
    fleet = FleetWatch(pool) if pool is not None else None
    # The records go to metrics.jsonl as they are made; the summary needs the last few only.
    started, last = time.perf_counter(), collections.deque(maxlen=LAST_STEPS)
    try:
        for step in range(start.step + 1, cfg.total_steps + 1):
            record = train_one_step(learner, producer, publisher, task, cfg, fleet)
            record |= evaluator.during(step)
            if writer is not None:
                writer.write(step, record)
            last.append({"step": step, **{k: record[k] for k in SUMMARY_KEYS if k in record}})
            if step == cfg.total_steps or checkpointer.due(step):
                save_checkpoint(checkpointer, step, cfg, publisher, producer, at_start)
        publisher.finish()
    finally:
        with contextlib.suppress(Exception):  # finished above unless the loop failed
            publisher.close()
        if driver:
            producer.close()
            writer.close()
        checkpointer.close()
    summary = {"steps": cfg.total_steps, "policy_version": publisher.version,
               "wall_seconds": time.perf_counter() - started}  # fmt: skip
    summary |= {f"{evaluator.key(split)}_start": at_start.get(split) for split in evaluator.splits}
    if cfg.eval.at_end:
        summary |= evaluator.after_training()
    summary |= finish(cfg, learner, model_path, list(last), summary, at_start, driver)
    if driver:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return RunResult(summary, out / "metrics.jsonl" if driver else None)


def finish(cfg, learner, model_path, tail, summary, at_start, driver) -> dict[str, Any]:
    """The summary's last parts: means over the last `LAST_STEPS` steps (`tail`, their
    records), the training plot (the driver's), the Hugging Face export (`config.export`)."""
    out, extra = Path(cfg.output_dir), {}
    for key in SUMMARY_KEYS:
        if tail and all(key in r for r in tail):
            extra[f"{key}_last5"] = float(np.mean([r[key] for r in tail]))
    if tail and driver:
        from jaxrlhf.report import plot_training

        points = []
        if "eval_accuracy_start" in summary:  # the plot's eval panel: before, during, after
            start, end = at_start.get("eval"), summary.get("eval_accuracy_end")
            points = [(0, start)] if start is not None else []
            points += [(tail[-1]["step"], end)] if end is not None else []
        extra["plot"] = str(plot_training(out / "metrics.jsonl", out / "training.png",
                                          eval_points=points, x="time"))  # fmt: skip
    if cfg.export:
        folder = save_pretrained(learner.base_policy, learner.published(),
                                 out / "hf_export", tokenizer_from=model_path,
                                 write=driver)  # fmt: skip
        extra["export_dir"] = str(folder)
        if learner.frozen is not None:  # a LoRA run: its adapter too, in PEFT's layout
            adapter = jax.tree.map(to_host, learner.state.params["policy"])  # every process
            if driver:
                lora_lib.save_adapter(learner.policy, adapter, out / "hf_export" / "adapter",
                                      base_name=str(model_path))  # fmt: skip
            extra["adapter_dir"] = str(out / "hf_export" / "adapter")
    return extra


def train_one_step(
    learner: Learner, producer, publisher: Publisher, task, cfg, fleet: FleetWatch | None = None
) -> dict[str, Any]:
    """One update of the loop: wait for the next batch, learn from it, publish when due."""
    t0 = time.perf_counter()
    rollout = next_batch(publisher, producer)
    wait_s = time.perf_counter() - t0
    trained_from = publisher.version  # the parameters this update starts from
    learned = learner.learn(rollout, task)
    publisher.after_update(cfg, producer)
    staleness = staleness_metrics(rollout, trained_from)
    step_s = time.perf_counter() - t0
    return {
        "policy_version": publisher.version,
        **learned,
        "prompts": len(rollout.prompts),
        "samples": len(rollout.samples),
        "prompt_ids": [p.id for p in rollout.prompts],  # the batch's, in the schedule's order
        **(
            {"samples_returned": samples_returned(rollout)}
            if cfg.train.log_samples_returned
            else {}
        ),
        **(fleet.step() if fleet is not None else {}),
        **staleness,
        "generation_tokens_per_s": rollout.num_tokens / max(rollout.generate_seconds, 1e-9),
        "wait_for_generation_s": wait_s,
        "generate_s": rollout.generate_seconds,  # from the batch's first call to its last end
        # The publishes that finished (in the background: the one the previous update
        # started) and how long the learner waited on publishing (jaxrlhf.rl.publisher).
        **publisher.take_times(),
        "step_s": step_s,
        # The share of the step the learner waited for its batch (nothing else to do).
        "learner_idle_fraction": wait_s / step_s if step_s > 0 else 0.0,
    }

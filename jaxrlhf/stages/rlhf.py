"""The RLHF stage: connect to generator service(s) — or start one — and run the learner loop."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxrlhf.config import model_options
from jaxrlhf.distributed import is_driver
from jaxrlhf.fleet.pool import GeneratorPool, Timeouts
from jaxrlhf.fleet.service import engine_args, start_server
from jaxrlhf.models.paths import resolve_model
from jaxrlhf.rl.tasks import build_task
from jaxrlhf.rl.trainer import build_learner, run_rlhf
from jaxrlhf.stages.provenance import write_summary
from jaxrlhf.stages.reward import RewardScorer


class StartCancel:
    """Set by the learner's thread when building the learner failed: the generator start in
    the background stops at once (a server still starting is terminated, a pool waiting for
    its replicas is closed) instead of running to its end first (up to 600 s)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._closers: list = []

    def on_cancel(self, close) -> None:
        with self._lock:
            if not self.event.is_set():
                self._closers.append(close)
                return
        close()

    def set(self) -> None:
        with self._lock:
            self.event.set()
            closers, self._closers = self._closers, []
        for close in closers:
            close()


@contextlib.contextmanager
def generator_pool(config, model_path: Path, log, cancel: StartCancel | None = None):
    """A pool over the configured addresses, or over one server started here for the run (and
    restarted here when it dies: `generator.max_restarts`). Whatever fails after a server
    started, the server is stopped."""
    gen = config.generator
    token = os.environ.get(gen.auth_token_env) if gen.auth_token_env else None
    servers: list = []
    pool = None
    try:
        restart = None
        if gen.addresses:
            targets = [a.strip() for a in gen.addresses.split(",") if a.strip()]
        else:
            restart = _starter(config, model_path, log, servers, cancel)
            targets = [restart()]
        pool = GeneratorPool(
            targets, auth_token=token, transport=gen.weight_transport,
            chunk_bytes=gen.weight_chunk_bytes,
            timeouts=Timeouts(gen.generate_timeout_s, gen.update_timeout_s, gen.status_timeout_s),
            probe_interval=gen.probe_interval_s, restart=restart, max_restarts=gen.max_restarts,
            no_replica_timeout=gen.no_replica_timeout_s, log=log, capacity=gen.capacity,
        )  # fmt: skip
        if cancel is not None:
            cancel.on_cancel(pool.close)  # its wait below then fails at once
        statuses = pool.wait_until_serving()
        check_swap_mode(gen, targets, statuses, config.model.lora.rank)
        mode = gen.swap_mode + (f", KV {gen.in_flight_kv}" if gen.swap_mode == "in-flight" else "")
        log(f"generator(s) serving: {', '.join(targets)} (version {statuses[0].policy_version}; "
            f"swaps: {mode})")  # fmt: skip
        yield pool
    finally:
        if pool is not None:
            pool.close()
        for server in servers:
            server.terminate()


def _starter(config, model_path: Path, log, servers: list, cancel: StartCancel | None):
    """start(target="") -> the address of a generator service started for the run (the one
    before it killed first: a restart), appended to `servers`."""
    gen = config.generator
    args = engine_args(gen, config.model.lora.rank)
    cpus = [int(c) for c in gen.cpus.split(",")] if gen.cpus else None

    def start(target: str = "") -> str:
        if servers and servers[-1].process.poll() is None:
            servers[-1].process.kill()  # hung (it failed): its reaper takes its engine along
            servers[-1].process.wait()
        name = "generator.log" if not servers else f"generator-restart{len(servers)}.log"
        log_path = Path(config.output_dir) / name
        log(f"starting a generator service for {model_path} (log: {log_path})")
        servers.append(start_server(model_path, log_path, args, cpus=cpus,
                                    cancel=cancel.event if cancel else None))  # fmt: skip
        return servers[-1].address

    return start


def check_swap_mode(gen, targets, statuses, lora_rank: int = 0) -> None:
    """Raises ValueError naming each generator whose swap mode is not `generator.swap_mode`
    (a generator older than swap modes reports none: it drains), or, in "lora" mode, that takes
    no adapter of `lora_rank` (its `max_lora_rank` is smaller)."""
    wrong = [
        f"{target} swaps {status.swap_mode or 'drain'}"
        + (f" (KV {status.in_flight_kv})" if status.in_flight_kv else "")
        for target, status in zip(targets, statuses, strict=True)
        if (status.swap_mode or "drain") != gen.swap_mode
        or (gen.swap_mode == "in-flight" and status.in_flight_kv != gen.in_flight_kv)
    ]
    if gen.swap_mode == "lora":
        wrong += [f"{target} takes adapters of rank {status.max_lora_rank} at most"
                  for target, status in zip(targets, statuses, strict=True)
                  if status.swap_mode == "lora" and status.max_lora_rank < lora_rank]  # fmt: skip
    if not wrong:
        return
    setting = f"config.generator.swap_mode={gen.swap_mode!r}"
    flags, rank = f"--swap-mode {gen.swap_mode}", ""
    if gen.swap_mode == "in-flight":
        setting += f" (in_flight_kv={gen.in_flight_kv!r})"
        flags += f" --in-flight-kv {gen.in_flight_kv}"
    elif gen.swap_mode == "lora":
        setting += f" (model.lora.rank={lora_rank})"
        flags, rank = "--max-lora-rank R", f" (R >= {lora_rank})"
    raise ValueError(
        f"{setting} but {'; '.join(wrong)}: start them with `python -m generator_service "
        f"{flags}`{rank} or set the config to match"
    )


@contextlib.contextmanager
def learner_while_generators_start(config, model_path: Path, log, reward):
    """(pool, learner): the learner is built (the model read onto the mesh, the reference and
    the optimizer state made) while `generator_pool` starts its generator, whose start is
    mostly one process importing on one core (`make run`: 27 s, with the other core free).
    When building the learner fails, the start is cancelled and the error raised at once."""
    cancel = StartCancel()
    # Leaving the executor waits for the start (at once when cancelled), then the stack stops
    # what started.
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(1) as background:
        starting = background.submit(
            stack.enter_context, generator_pool(config, model_path, log, cancel)
        )
        try:
            learner = build_learner(config, model_path, reward)
        except BaseException:
            cancel.set()
            raise
        yield starting.result(), learner


def reward_model(config):
    """mesh -> the scorer of `config.task.reward_model` on it (None: the task's verifier)."""
    if not config.task.reward_model:
        return None
    path = resolve_model(config.task.reward_model)
    options = model_options(config.model, frozen=True)
    return lambda mesh: RewardScorer(path, mesh, options, config.train.micro_batch_size)


def run(config, model_path: Path, log) -> dict:
    from jaxrlhf.models.tokenizer import load_tokenizer

    started = time.perf_counter()
    tokenizer = load_tokenizer(model_path)
    task = build_task(config, tokenizer, test=config.eval.test)
    reward = reward_model(config)
    if is_driver():  # the only process that talks to the generators (jaxrlhf.distributed)
        with learner_while_generators_start(config, model_path, log, reward) as (pool, learner):
            result = run_rlhf(config, model_path, task, pool, log, reward, learner)
    else:
        result = run_rlhf(config, model_path, task, None, log, reward)
    summary = {**result.summary, "total_seconds": time.perf_counter() - started}
    out = Path(config.output_dir)
    if is_driver():
        write_summary(config, summary)
        for line in summary_lines(summary, out):
            log(line)
    return summary


def summary_lines(summary: dict, out: Path) -> list[str]:
    """The human-readable end of a run: before/after, time, staleness, where things are."""
    lines = []
    for split, prefix in (("validation", "eval"), ("test", "test")):
        for name in ("accuracy", "reward"):
            key = f"{prefix}_{name}"
            start, end = summary.get(f"{key}_start"), summary.get(f"{key}_end")
            if end is None:
                continue
            count = summary.get(f"{prefix}_prompts", "?")
            interval = 1.96 * summary.get(f"{key}_end_stderr", float("nan"))
            if name == "accuracy":
                change = "" if start is None else f"{start:.1%} -> "
                gain = "" if start is None else f" ({100 * (end - start):+.1f} points)"
                lines.append(f"{split} greedy accuracy on {count} prompts: {change}{end:.1%} "
                             f"± {100 * interval:.1f}{gain} (95% interval)")  # fmt: skip
            else:
                change = "" if start is None else f"{start:.3f} -> "
                lines.append(f"{split} greedy reward on {count} prompts: {change}{end:.3f} "
                             f"± {interval:.3f} (95% interval)")  # fmt: skip
    lines.append(f"time: {summary['total_seconds'] / 60:.1f} min in all "
                 f"({summary['wall_seconds'] / 60:.1f} min training loop)")  # fmt: skip
    if "staleness_mean_last5" in summary:
        lines.append(f"staleness (versions behind, last 5 steps): "
                     f"{summary['staleness_mean_last5']:.2f}")  # fmt: skip
    lines.append(f"outputs: {out.resolve()} (summary.json, metrics.jsonl, checkpoints/)")
    if summary.get("plot"):
        lines.append(f"plot of reward and accuracy: {summary['plot']}")
    return lines

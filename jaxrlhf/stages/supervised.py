"""The training loop shared by the supervised stages (SFT and reward model).

Batches come from fixed arrays in a seeded order (epoch e is permutation([seed, e])), so step i's
batch depends only on (seed, i) and a resumed run continues exactly. Orbax checkpoints every
`config.checkpoint.every` steps and at the end; `config.resume` continues from the latest one.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax

from jaxrlhf.checkpointing import Checkpointer
from jaxrlhf.distributed import is_driver, shard_global, to_host
from jaxrlhf.tokenization import concat_prompt_response, left_pad, right_pad
from jaxrlhf.train_state import (
    build_train_step,
    create_train_state,
    micro_batch_count,
    params_shardings,
    state_shardings,
)

Arrays = dict[str, np.ndarray]


def prompt_response_arrays(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int, max_length: int
) -> Arrays:
    """[left-padded prompt | right-padded response] rows of `max_length` tokens, with
    attention_mask and loss_mask (1 on response tokens). Responses longer than the room left
    after the longest prompt are cut."""
    prompt_len = max(len(p) for p in prompts)
    if prompt_len >= max_length:
        raise ValueError(
            f"a prompt has {prompt_len} tokens: config.train.max_length={max_length} leaves no "
            f"room for the response"
        )
    p_ids, p_mask = left_pad(prompts, pad_id, prompt_len)
    r_ids, r_mask = right_pad(responses, pad_id, max_length - prompt_len)
    input_ids, attention_mask, loss_mask = concat_prompt_response(p_ids, p_mask, r_ids, r_mask)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def batch_rows(num_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Row indices of step `step`'s batch: consecutive slices of per-epoch permutations."""
    rows = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_rows)
        rows.append(np.random.default_rng([seed, epoch]).permutation(num_rows)[offset])
    return np.asarray(rows)


def evaluate(eval_fn, params, arrays: Arrays, batch_size: int, mesh) -> dict[str, float]:
    """Metrics of `eval_fn` over all rows in chunks, averaged with each chunk's "weight"."""
    totals: dict[str, float] = {}
    weight_sum = 0.0
    rows = len(next(iter(arrays.values())))
    for start in range(0, rows, batch_size):
        chunk = {k: v[start : start + batch_size] for k, v in arrays.items()}
        loss, metrics = eval_fn(params, shard_global(chunk, mesh))
        loss, metrics = to_host(loss), {k: to_host(v) for k, v in metrics.items()}
        weight = float(metrics.pop("weight"))
        for key, value in {"loss": loss, **metrics}.items():
            totals[key] = totals.get(key, 0.0) + float(value) * weight
        weight_sum += weight
    return {k: v / max(weight_sum, 1e-9) for k, v in totals.items()}


def train_supervised(
    config,
    model,
    params,
    loss_fn: Callable,
    train: Arrays,
    held_out: Arrays,
    mesh,
    log,
    rows_per_example: int = 1,
    weight_fn: Callable | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Runs `config.total_steps` steps of `loss_fn` (metrics must include "weight": the count
    of what the loss is a mean over, which weights micro-batches and evaluation chunks).

    Arrays hold one example per leading index; an example may be several sequences
    (`rows_per_example`: the reward model's chosen/rejected pairs are [examples, 2, T]), which
    `config.train.micro_batch_size` (sequences per forward/backward) counts. `weight_fn(part)`
    gives that count for a micro-batch (default: its examples).
    Returns (final state, summary with held-out metrics before and after).
    """
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    optimizer = optax.chain(
        optax.clip_by_global_norm(config.train.max_grad_norm),
        optax.adamw(config.train.learning_rate, weight_decay=config.train.weight_decay),
    )
    shardings = state_shardings(params_shardings(model, mesh), optimizer, params, mesh)
    state = create_train_state(params, optimizer, shardings)
    bs = config.train.batch_size

    shapes = {k: (bs, *v.shape[1:]) for k, v in train.items()}
    micro_batches = micro_batch_count(bs, config.train.micro_batch_size, rows_per_example)
    step_fn = build_train_step(
        loss_fn, optimizer, mesh, shardings, shapes, micro_batches=micro_batches,
        weight_fn=weight_fn,
    )  # fmt: skip
    eval_fn = jax.jit(loss_fn)
    eval_rows = bs // micro_batches
    checkpointer = Checkpointer(out / "checkpoints", config.checkpoint.every)
    start_step, eval_start = 0, None
    if config.resume and checkpointer.latest_step() is not None:
        state, meta = checkpointer.restore(None, state)
        start_step, eval_start = meta["step"], meta["eval_start"]
        log(f"resumed from step {start_step}")
    if eval_start is None:
        eval_start = evaluate(eval_fn, state.params, held_out, eval_rows, mesh)
        log(f"mesh {dict(mesh.shape)}; held-out before training: {_fmt(eval_start)}")
    try:
        state = _train_steps(config, state, step_fn, train, mesh, checkpointer, start_step,
                             eval_start, log)  # fmt: skip
    finally:
        checkpointer.close()
    eval_end = evaluate(eval_fn, state.params, held_out, eval_rows, mesh)
    log(f"held-out after training: {_fmt(eval_end)}")
    summary = {
        "steps": config.total_steps,
        "wall_seconds": time.time() - started,
        **{f"eval_{k}_start": v for k, v in eval_start.items()},
        **{f"eval_{k}_end": v for k, v in eval_end.items()},
    }
    return state, summary


def _train_steps(config, state, step_fn, train: Arrays, mesh, checkpointer, start_step: int,
                 eval_start: dict, log):  # fmt: skip
    """Steps `start_step` .. total_steps of `step_fn` on `train`'s seeded batches, each step's
    figures a line of metrics.jsonl (the driver's), checkpoints when due and at the end."""
    out = Path(config.output_dir)
    bs, num_rows = config.train.batch_size, len(next(iter(train.values())))
    # One process writes the metrics (the others discard theirs: the same figures).
    metrics_path = out / "metrics.jsonl" if is_driver() else Path(os.devnull)
    if start_step and is_driver():
        keep_logged_steps(metrics_path, start_step)
    with open(metrics_path, "a" if start_step else "w") as metrics_file:
        for step in range(start_step, config.total_steps):
            rows = batch_rows(num_rows, bs, step, config.seed)
            batch = shard_global({k: v[rows] for k, v in train.items()}, mesh)
            t0 = time.time()
            state, metrics = step_fn(state, batch)
            metrics = {k: float(to_host(v)) for k, v in metrics.items()}
            record = {"step": step + 1, **metrics, "step_seconds": time.time() - t0}
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            if (step + 1) % config.train.log_every == 0:
                log(f"step {step + 1}/{config.total_steps} {_fmt(metrics)}")
            last = step + 1 == config.total_steps
            if last or checkpointer.due(step + 1):
                meta = {"step": step + 1, "eval_start": eval_start, "seed": config.seed}
                checkpointer.save(step + 1, state, meta, force=True)
    return state


def keep_logged_steps(metrics_path: Path, last_step: int) -> None:
    """Drops the lines of steps after `last_step` from metrics.jsonl: a run stopped between two
    checkpoints logged steps that the resumed run trains again, and would log twice (a line
    cut short by a kill is one of those: a step's line is complete before its checkpoint)."""
    if not metrics_path.exists():
        return
    kept = []
    for line in metrics_path.read_text().splitlines(keepends=True):
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError):
            continue
        if step <= last_step and line.endswith("\n"):
            kept.append(line)
    metrics_path.write_text("".join(kept))


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "weight")

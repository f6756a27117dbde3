"""Supervised fine-tuning: NLL of the response tokens given the prompt, on the device mesh.

loss = −Σ_t m_t log π(y_t | x, y_<t) / Σ_t m_t, with m the response (loss) mask.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
import optax

from jaxrlhf.data.arithmetic import make_problems
from jaxrlhf.models import load_pretrained, logprobs_from_logits, save_pretrained
from jaxrlhf.sharding import make_mesh, shard_batch
from jaxrlhf.tokenization import chat_prompt_ids, concat_prompt_response, left_pad, right_pad
from jaxrlhf.train_state import (
    build_train_step,
    create_train_state,
    params_shardings,
    state_shardings,
)


def nll_loss(model):
    """loss_fn(params, batch) for `build_train_step`: mean NLL over loss-masked tokens."""

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["input_ids"], batch["attention_mask"])
        logp = logprobs_from_logits(logits[:, :-1], batch["input_ids"][:, 1:])
        mask = batch["loss_mask"]
        loss = -(logp * mask).sum() / mask.sum()
        return loss, {"tokens": mask.sum()}

    return loss_fn


def build_examples(tokenizer, problems, max_length: int) -> dict[str, np.ndarray]:
    """[left-padded chat prompt | answer + EOS, right-padded] for each problem."""
    prompts = [
        chat_prompt_ids(tokenizer, [{"role": "user", "content": p.question}]) for p in problems
    ]
    answers = [
        tokenizer.encode(str(p.answer), add_special_tokens=False) + [tokenizer.eos_token_id]
        for p in problems
    ]
    prompt_len = max(len(p) for p in prompts)
    response_len = max_length - prompt_len
    if response_len < max(len(a) for a in answers):
        raise ValueError(f"config.train.max_length={max_length} leaves no room for the answers")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    p_ids, p_mask = left_pad(prompts, pad, prompt_len)
    r_ids, r_mask = right_pad(answers, pad, response_len)
    input_ids, attention_mask, loss_mask = concat_prompt_response(p_ids, p_mask, r_ids, r_mask)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def run(config, model_path: Path, log) -> dict:
    """Trains `config.total_steps` steps; returns a summary dict (also summary.json)."""
    import transformers

    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    mesh = make_mesh(tuple(config.mesh.shape))
    model, params = load_pretrained(
        model_path,
        dtype=config.model.dtype,
        mesh=mesh,
        remat=config.model.remat,
        contraction_block=config.model.contraction_block,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    train = build_examples(
        tokenizer,
        make_problems(config.task.num_train, "train", config.seed),
        config.train.max_length,
    )
    held_out = build_examples(
        tokenizer, make_problems(config.task.num_eval, "eval", config.seed), config.train.max_length
    )
    optimizer = optax.adamw(config.train.learning_rate)
    shardings = state_shardings(params_shardings(model, mesh), optimizer, params, mesh)
    state = create_train_state(params, optimizer, shardings)
    bs = config.train.batch_size
    shapes = {k: (bs,) + v.shape[1:] for k, v in train.items()}
    step_fn = build_train_step(nll_loss(model), optimizer, mesh, shardings, shapes)
    loss_fn = jax.jit(nll_loss(model))

    def held_out_loss(params) -> float:
        return float(loss_fn(params, shard_batch(held_out, mesh))[0])

    eval_start = held_out_loss(state.params)
    log(f"mesh {dict(mesh.shape)}; held-out NLL before training: {eval_start:.4f}")
    order = np.random.default_rng(config.seed).permutation(len(train["input_ids"]))
    with open(out / "metrics.jsonl", "w") as metrics_file:
        for step in range(config.total_steps):
            rows = order[(np.arange(bs) + step * bs) % len(order)]
            batch = shard_batch({k: v[rows] for k, v in train.items()}, mesh)
            t0 = time.time()
            state, metrics = step_fn(state, batch)
            loss = float(metrics["loss"])
            record = {"step": step + 1, "loss": loss, "step_seconds": time.time() - t0}
            metrics_file.write(json.dumps(record) + "\n")
            if (step + 1) % config.train.log_every == 0:
                log(f"step {step + 1}/{config.total_steps} loss {loss:.4f}")
    eval_end = held_out_loss(state.params)
    summary = {
        "stage": "sft",
        "eval_nll_start": eval_start,
        "eval_nll_end": eval_end,
        "wall_seconds": time.time() - started,
        "steps": config.total_steps,
    }
    if config.export:
        summary["export_dir"] = str(
            save_pretrained(model, state.params, out / "hf_export", tokenizer_from=model_path)
        )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary

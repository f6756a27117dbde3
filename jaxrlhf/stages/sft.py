"""Supervised fine-tuning: NLL of the response tokens given the prompt, on the device mesh.

loss = −Σ_t m_t log π(y_t | x, y_<t) / Σ_t m_t, with m the response (loss) mask. Data: the
configured task's SFT examples (`jaxrlhf.data.task_registry`). Outputs in `config.output_dir`:
Orbax checkpoints, metrics.jsonl, summary.json and (with `config.export`) a Hugging Face folder
`hf_export/` that the next stage can start from (`--config.model.path=<this output_dir>`).
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from jaxrlhf.config import model_options
from jaxrlhf.data import task_registry
from jaxrlhf.data.types import prompt_ids, response_ids
from jaxrlhf.distributed import is_driver
from jaxrlhf.models import load_pretrained, next_token_logprobs, save_pretrained
from jaxrlhf.sharding import make_mesh
from jaxrlhf.stages.provenance import write_summary
from jaxrlhf.stages.supervised import prompt_response_arrays, train_supervised


def nll_loss(model):
    """loss_fn(params, batch) for `build_train_step`: mean NLL over loss-masked tokens."""

    def loss_fn(params, batch):
        logp = next_token_logprobs(model, params, batch["input_ids"], batch["attention_mask"])
        mask = batch["loss_mask"]
        loss = -(logp * mask).sum() / jnp.maximum(mask.sum(), 1)
        return loss, {"weight": mask.sum()}

    return loss_fn


def build_examples(tokenizer, examples, max_length: int):
    """[left-padded prompt | response + EOS, right-padded] for each SFTExample."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return prompt_response_arrays(
        [prompt_ids(tokenizer, e.prompt) for e in examples],
        [response_ids(tokenizer, e.response) for e in examples],
        pad,
        max_length,
    )


def run(config, model_path: Path, log) -> dict:
    """Trains `config.total_steps` steps; returns a summary dict (also summary.json)."""
    from jaxrlhf.models.tokenizer import load_tokenizer

    out = Path(config.output_dir)
    mesh = make_mesh(tuple(config.mesh.shape))
    model, params = load_pretrained(model_path, mesh=mesh, **model_options(config.model))
    tokenizer = load_tokenizer(model_path)
    length = config.train.max_length
    train = build_examples(
        tokenizer, task_registry.sft_examples(config.task, "train", config.seed), length
    )
    held_out = build_examples(
        tokenizer, task_registry.sft_examples(config.task, "validation", config.seed), length
    )
    log(f"SFT on {len(train['input_ids'])} examples ({config.task.name}), "
        f"{len(held_out['input_ids'])} held out")  # fmt: skip
    state, summary = train_supervised(
        config, model, params, nll_loss(model), train, held_out, mesh, log,
        weight_fn=lambda part: part["loss_mask"].sum(),  # the loss is a mean over tokens
    )  # fmt: skip
    summary = {"stage": "sft", **summary}
    summary["eval_nll_start"], summary["eval_nll_end"] = (
        summary.pop("eval_loss_start"), summary.pop("eval_loss_end"))  # fmt: skip
    if config.export:
        folder = save_pretrained(model, state.params, out / "hf_export",
                                 tokenizer_from=model_path, write=is_driver())  # fmt: skip
        summary["export_dir"] = str(folder)
        log(f"exported a Hugging Face folder: {folder}")
    if is_driver():
        write_summary(config, summary)
    return summary

"""Reward model: a scalar head on the (SFT) policy trained with the Bradley–Terry loss.

    r(x, y)  = score head at the last real token of [x | y + EOS]
    loss     = −mean log σ(r(x, y_chosen) − r(x, y_rejected))
    accuracy = mean[r(x, y_chosen) > r(x, y_rejected)]   (reported on held-out pairs)

`RewardScorer` runs a trained reward model on the learner's mesh: the RLHF reward for tasks
without a verifiable one, and the gold reward of `jaxrlhf.evaluate`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.config import model_options
from jaxrlhf.data import task_registry
from jaxrlhf.data.types import prompt_ids, response_ids
from jaxrlhf.distributed import is_driver, shard_global, to_host
from jaxrlhf.models import load_pretrained, save_pretrained
from jaxrlhf.sharding import activate, make_mesh
from jaxrlhf.stages.provenance import write_summary
from jaxrlhf.stages.supervised import prompt_response_arrays, train_supervised
from jaxrlhf.train_state import forward_in_micro_batches


def last_token_scores(scores: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """[B, T] per-position scores -> [B]: the score at each row's last real token."""
    positions = jnp.arange(attention_mask.shape[1])
    last = jnp.max(jnp.where(attention_mask > 0, positions, -1), axis=1)
    return jnp.take_along_axis(scores, jnp.maximum(last, 0)[:, None], axis=1)[:, 0]


def bradley_terry_loss(model):
    """loss_fn(params, batch) over pairs: arrays [pairs, 2, T], each pair's chosen then rejected."""

    def loss_fn(params, batch):
        ids, mask = (
            batch[k].reshape(-1, batch[k].shape[-1]) for k in ("input_ids", "attention_mask")
        )
        scores = model.apply({"params": params}, ids, mask)
        rewards = last_token_scores(scores, mask).reshape(-1, 2)
        margin = rewards[:, 0] - rewards[:, 1]
        loss = -jnp.mean(jax.nn.log_sigmoid(margin))
        metrics = {
            "accuracy": jnp.mean((margin > 0).astype(jnp.float32)),
            "margin": jnp.mean(margin),
            "weight": jnp.float32(margin.shape[0]),
        }
        return loss, metrics

    return loss_fn


def build_pairs(tokenizer, pairs, max_length: int) -> dict[str, np.ndarray]:
    """Arrays [N, 2, T]: each pair's chosen and rejected [prompt | response + EOS] rows."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts, responses = [], []
    for pair in pairs:
        prompt = prompt_ids(tokenizer, pair.prompt)
        prompts += [prompt, prompt]
        responses += [response_ids(tokenizer, pair.chosen),
                      response_ids(tokenizer, pair.rejected)]  # fmt: skip
    arrays = prompt_response_arrays(prompts, responses, pad, max_length)
    return {k: v.reshape(len(pairs), 2, -1) for k, v in arrays.items()}


class RewardScorer:
    """A reward model on a mesh: scores [prompt | response] rows at their last real token."""

    def __init__(
        self, path: str | Path, mesh, options: dict | None = None, micro_batch_size: int = 0
    ):
        """`options`: `load_pretrained` keywords (`config.model_options(..., frozen=True)`);
        `micro_batch_size` rows scored at a time (0 = all)."""
        self.mesh = mesh
        self.model, self.params = load_pretrained(path, head="score", mesh=mesh, **(options or {}))
        model = self.model

        def score(params, input_ids, attention_mask):
            with activate(mesh):
                scores = model.apply({"params": params}, input_ids, attention_mask)
                return last_token_scores(scores, attention_mask)

        self._score = jax.jit(forward_in_micro_batches(score, micro_batch_size))

    def __call__(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        batch = shard_global({"i": input_ids, "m": attention_mask}, self.mesh)
        return to_host(self._score(self.params, batch["i"], batch["m"])).astype(np.float32)


def run(config, model_path: Path, log) -> dict:
    """Trains the reward model on the task's preference pairs; returns the summary."""
    from jaxrlhf.models.tokenizer import load_tokenizer

    out = Path(config.output_dir)
    mesh = make_mesh(tuple(config.mesh.shape))
    model, params = load_pretrained(
        model_path, head="score", mesh=mesh, seed=config.seed, **model_options(config.model)
    )
    tokenizer = load_tokenizer(model_path)
    length = config.train.max_length
    train = build_pairs(tokenizer, task_registry.preference_pairs(config.task, "train"), length)
    held_out = build_pairs(
        tokenizer, task_registry.preference_pairs(config.task, "validation"), length
    )
    log(f"reward model on {len(train['input_ids'])} preference pairs ({config.task.name}), "
        f"{len(held_out['input_ids'])} held out")  # fmt: skip
    state, summary = train_supervised(
        config, model, params, bradley_terry_loss(model), train, held_out, mesh, log,
        rows_per_example=2,
    )  # fmt: skip
    summary = {"stage": "reward", **summary}
    if config.export:
        folder = save_pretrained(model, state.params, out / "hf_export",
                                 tokenizer_from=model_path, write=is_driver())  # fmt: skip
        summary["export_dir"] = str(folder)
        log(f"exported a Hugging Face folder (score head): {folder}")
    if is_driver():
        write_summary(config, summary)
    return summary

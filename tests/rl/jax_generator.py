"""An in-process generator for learning and replay tests: the Flax policy samples itself.

`JaxGenerator` has the interface the RLHF loop uses of `GeneratorPool` (`wait_until_serving`,
`generate`, `publish_weights`) and samples with the weights last published to it: the learner's
HF-layout tensors go back through `params_from_hf`, so what it samples from is exactly what the
learner published. Log-probs are those of the distribution sampled from (logits / temperature),
as vLLM's processed log-probs; temperature 0 is greedy. A seed makes a call reproducible.
No vLLM and no server, so a loss can be trained for tens of steps in seconds.
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.fleet.sample import Sample
from jaxrlhf.fleet.transport import PublishStats
from jaxrlhf.models import load_pretrained, params_from_hf


@functools.partial(jax.jit, static_argnums=(0, 5))
def _sample(model, params, ids, mask, key, steps: int, temperature, eos_id: int):
    """Appends `steps` tokens after the prompt columns of ids/mask [B, P + steps] (left-padded
    prompts, zeros after). Returns (ids, per-token log-probs [B, steps], finished-at [B])."""
    prompt_width = ids.shape[1] - steps

    def step(t, carry):
        ids, mask, logprobs, done, key = carry
        logits = model.apply({"params": params}, ids, mask)[:, prompt_width + t - 1]
        logits = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
        key, sub = jax.random.split(key)
        token = jnp.where(
            temperature > 0, jax.random.categorical(sub, logits), jnp.argmax(logits, -1)
        )
        logp = jax.nn.log_softmax(logits)[jnp.arange(len(token)), token]
        live = ~done
        ids = ids.at[:, prompt_width + t].set(jnp.where(live, token, 0))
        mask = mask.at[:, prompt_width + t].set(live.astype(mask.dtype))
        logprobs = logprobs.at[:, t].set(jnp.where(live, logp, 0.0))
        return ids, mask, logprobs, done | (live & (token == eos_id)), key

    logprobs = jnp.zeros((ids.shape[0], steps), jnp.float32)
    done = jnp.zeros(ids.shape[0], bool)
    ids, mask, logprobs, done, _ = jax.lax.fori_loop(
        0, steps, step, (ids, mask, logprobs, done, key)
    )
    return ids, mask, logprobs


class JaxGenerator:
    """In-process stand-in for `GeneratorPool` (module docstring); records what it served."""

    def __init__(self, model_dir: Path, eos_id: int, pad_id: int):
        self.model_dir = Path(model_dir)
        self.model, self.params = load_pretrained(model_dir)
        self.eos_id, self.pad_id = eos_id, pad_id
        self.version = 0
        self.published: dict[int, dict[str, np.ndarray]] = {}  # version -> HF tensors
        self.calls = 0

    def needs_weights(self) -> bool:
        return False  # one in-process replica: it never fails

    def metrics(self) -> dict[str, int]:
        return {"generators_live": 1, "failures": 0, "failovers": 0, "restarts": 0,
                "rejoins": 0, "publish_retries": 0}  # fmt: skip

    def occupancy(self) -> dict[str, tuple[float, float, int]]:
        return {}  # generates in the learner's thread: no idle time of its own to report

    def wait_until_serving(self, timeout: float = 0.0) -> list[Any]:
        return [types.SimpleNamespace(policy_version=self.version, model=str(self.model_dir))]

    def publish_weights(
        self,
        tensor_stream: Callable,
        num_tensors: int,
        policy_version: int,
        allow_rollback: bool = False,
        specs: Sequence | None = None,
        rejoining_only: bool = False,
        transport=None,  # (one in-process replica: nothing travels)
    ) -> PublishStats:
        started = time.perf_counter()
        if policy_version <= self.version and not allow_rollback:
            raise ValueError(f"version {policy_version} is not newer than {self.version}")
        tensors = {name: np.array(array) for name, array in tensor_stream()}
        if len(tensors) != num_tensors:
            raise ValueError(f"{len(tensors)} tensors published, {num_tensors} announced")
        self.params = params_from_hf(self.model, tensors)
        self.version = policy_version
        self.published[policy_version] = tensors
        size = sum(t.nbytes for t in tensors.values())
        return PublishStats(policy_version, num_tensors, size, time.perf_counter() - started, 1)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: dict[str, Any],
        on_admitted: Callable[[], None] | None = None,
        min_version: int | None = None,
    ) -> list[Sample]:
        version, params = self.version, self.params
        if on_admitted is not None:
            on_admitted()
        n, steps = sampling.get("n", 1), sampling["max_tokens"]
        seed = sampling.get("seed")
        key = jax.random.PRNGKey(self.calls if seed is None else seed)
        self.calls += 1
        width = max(len(p) for p in prompts)
        rows = [p for p in prompts for _ in range(n)]
        ids = np.full((len(rows), width + steps), self.pad_id, np.int32)
        mask = np.zeros_like(ids)
        for row, prompt in enumerate(rows):
            ids[row, width - len(prompt) : width] = prompt
            mask[row, width - len(prompt) : width] = 1
        temperature = float(sampling.get("temperature", 1.0))
        sampled = _sample(self.model, params, ids, mask, key, steps, temperature, self.eos_id)
        ids, mask, logprobs = jax.device_get(sampled)
        samples = []
        for row in range(len(rows)):
            length = int(mask[row, width:].sum())
            tokens = tuple(int(t) for t in ids[row, width : width + length])
            finish = "stop" if tokens and tokens[-1] == self.eos_id else "length"
            samples.append(Sample(row // n, row % n, tokens,
                                  tuple(float(x) for x in logprobs[row, :length]), finish,
                                  version))  # fmt: skip
        return samples

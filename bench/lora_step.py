"""The learner's update with LoRA against full fine-tuning, side by side in one run: time per
update and memory.

    python bench/lora_step.py                        # SmolLM2-135M, fp32, rank 16, 8x128 tokens
    python bench/lora_step.py --model tiny --batch 2 --seq 16 --steps 1   # smoke run, seconds

Both arms take the same train step (`jaxrlhf.train_state.build_train_step`, AdamW, a
next-token loss) on the same batch and the same base weights: `full` trains every parameter;
`lora` trains rank `--rank` adapters on the seven linear layers of each block
(`jaxrlhf.models.lora`, alpha 2 x rank) with the base an argument of the step, read and never
trained (as `jaxrlhf.rl.learner` does). Per arm: the median seconds of `--steps` steps after
the first (compiling) one, alternating the arms step by step; and from XLA's memory analysis of
the compiled step, its arguments (parameters, optimizer state, batch, base), temporaries
(gradients, activations) and the peak (arguments + outputs + temporaries - what it updates in
place). The ratios lora / full. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.learner_step import build_model  # noqa: E402
from jaxrlhf.models import logprobs_from_logits  # noqa: E402
from jaxrlhf.models import lora as lora_lib  # noqa: E402
from jaxrlhf.rl.learner import with_frozen  # noqa: E402
from jaxrlhf.sharding import make_mesh, shard_batch  # noqa: E402
from jaxrlhf.train_state import (  # noqa: E402
    build_train_step,
    create_train_state,
    params_shardings,
    state_shardings,
)


def next_token_loss(model):
    def loss_fn(params, batch):
        logits = model.apply({"params": params["policy"]}, batch["input_ids"],
                             batch["attention_mask"])  # fmt: skip
        logp = logprobs_from_logits(logits[:, :-1], batch["input_ids"][:, 1:])
        return -logp.mean(), {}

    return loss_fn


def arm(model, params, mesh, shapes, rank: int):
    """(the jitted step, its state, its extra arguments, its memory) of one arm."""
    optimizer = optax.adamw(1e-5)
    if not rank:
        shardings = {"policy": params_shardings(model, mesh)}
        # A copy: the step donates its state, and the LoRA arm reads `params` as its base.
        trained = {"policy": jax.tree.map(lambda x: x.copy(), params)}
        frozen, loss_fn, extra = None, next_token_loss(model), ()
    else:
        policy = lora_lib.with_lora(model, rank, 2.0 * rank, lora_lib.TARGETS)
        adapter_shardings = lora_lib.split(params_shardings(policy, mesh))[0]
        adapter = jax.device_put(lora_lib.init_adapter(policy, 0), adapter_shardings)
        shardings, trained = {"policy": adapter_shardings}, {"policy": adapter}
        frozen = {"policy": params_shardings(model, mesh)}
        loss_fn, extra = with_frozen(next_token_loss(policy)), ({"policy": params},)
    state_sharding = state_shardings(shardings, optimizer, trained, mesh)
    state = create_train_state(trained, optimizer, state_sharding)
    step = build_train_step(loss_fn, optimizer, mesh, state_sharding, shapes,
                            frozen_shardings=frozen)  # fmt: skip
    return step, state, extra


def memory(step, state, batch, extra) -> dict[str, int]:
    stats = step.lower(state, batch, *extra).compile().memory_analysis()
    own = (stats.argument_size_in_bytes + stats.output_size_in_bytes
           + stats.temp_size_in_bytes - stats.alias_size_in_bytes)  # fmt: skip
    return {"argument_bytes": int(stats.argument_size_in_bytes),
            "temp_bytes": int(stats.temp_size_in_bytes), "peak_bytes": int(own)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny | a HF folder")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    args.remat, args.cpu_contraction_block = False, 0
    mesh = make_mesh((1, -1, 1))
    model, params = build_model(args, mesh)
    rng = np.random.default_rng(0)
    host = {"input_ids": rng.integers(0, model.config.vocab_size, (args.batch, args.seq)),
            "attention_mask": np.ones((args.batch, args.seq))}  # fmt: skip
    host = {k: v.astype(np.int32) for k, v in host.items()}
    batch = shard_batch(host, mesh)
    shapes = {k: v.shape for k, v in host.items()}
    arms = {name: list(arm(model, params, mesh, shapes, rank))
            for name, rank in (("full", 0), ("lora", args.rank))}  # fmt: skip
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "rank": args.rank,
        "batch": args.batch,
        "seq": args.seq,
        "device": f"{jax.device_count()}x {jax.devices()[0].device_kind}",
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for repeat in range(args.steps + 1):  # the first: compiling, not counted
        for name, (step, state, extra) in arms.items():
            started = time.perf_counter()
            state, metrics = step(state, batch, *extra)
            jax.block_until_ready(metrics)
            arms[name][1] = state
            if repeat:
                times[name].append(time.perf_counter() - started)
    for name, (step, state, extra) in arms.items():
        result[name] = {"step_s_median": statistics.median(times[name]),
                        **memory(step, state, batch, extra)}  # fmt: skip
    result["step_ratio"] = result["lora"]["step_s_median"] / result["full"]["step_s_median"]
    result["peak_ratio"] = result["lora"]["peak_bytes"] / result["full"]["peak_bytes"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()

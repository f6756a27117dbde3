"""Learner train-step throughput as a fraction of the machine's matmul rate, measured side by side.

    python bench/learner_step.py                      # SmolLM2-135M, fp32, 8x128 tokens (CPU)
    python bench/learner_step.py --model llama1b --dtype bfloat16 --batch 16 --seq 1024  # GPU
    python bench/learner_step.py --model tiny --batch 2 --seq 16 --steps 1  # smoke run, seconds

Model FLOPs per step = 6·N·tokens + 12·L·H·D·T·tokens (N = parameters in matmuls, the LM head
included; the attention term counts the full T×T score matrix the kernel computes). The matmul
rate is a large jitted jnp.dot in the same dtype, in the same run. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrlhf.models import ModelConfig, load_pretrained, logprobs_from_logits, make_model
from jaxrlhf.models.transformer import init_params
from jaxrlhf.sharding import make_mesh, shard_batch
from jaxrlhf.train_state import (
    build_train_step,
    create_train_state,
    params_shardings,
    state_shardings,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
LLAMA_1B = ModelConfig(  # Llama 3.2 1B shapes
    family="llama",
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def matmul_flops_per_s(size: int, dtype, repeats: int) -> float:
    a = jnp.asarray(np.random.default_rng(0).standard_normal((size, size)), dtype)
    b = jnp.asarray(np.random.default_rng(1).standard_normal((size, size)), dtype)
    dot = jax.jit(lambda x, y: x @ y)
    jax.block_until_ready(dot(a, b))
    return 2 * size**3 / min(timed(lambda: dot(a, b), repeats))


def model_flops(config: ModelConfig, batch: int, seq: int) -> float:
    e, f, layers = config.hidden_size, config.intermediate_size, config.num_layers
    hd = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    per_layer = e * hd + 2 * e * kv + hd * e + (3 if config.family != "gpt_neox" else 2) * e * f
    n_matmul = layers * per_layer + e * config.vocab_size
    tokens = batch * seq
    return 6 * n_matmul * tokens + 12 * layers * hd * seq * tokens


def build_model(args, mesh):
    """(model, params) for --model, params already sharded on `mesh`."""
    if args.model == "llama1b":
        model = make_model(LLAMA_1B, args.dtype, args.remat, args.cpu_contraction_block)
        init = jax.jit(
            lambda: init_params(model, jax.random.PRNGKey(0)),
            out_shardings=params_shardings(model, mesh),
        )
        return model, init()
    path = args.model
    if path == "smollm2":
        from jaxrlhf.models.smollm2 import smollm2_path

        path = smollm2_path()
    elif path == "tiny":
        from jaxrlhf.models.tiny import make_tiny_model

        path = make_tiny_model(REPO_ROOT / ".cache" / "bench_tiny_llama", arch="llama")
    return load_pretrained(
        path,
        dtype=args.dtype,
        mesh=mesh,
        remat=args.remat,
        contraction_block=args.cpu_contraction_block,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 | llama1b | tiny (random, 2 layers) | a HF folder",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--matmul-size", type=int, default=0, help="0 = 2048 on CPU, 8192 else")
    parser.add_argument("--remat", action="store_true")
    parser.add_argument(
        "--cpu-contraction-block",
        type=int,
        default=0,
        help="the model's contraction_block: float32 matmuls summed in blocks of this many terms "
        "(torch's accuracy on CPU, slower); 0 = one dot per matmul",
    )
    args = parser.parse_args()
    mesh = make_mesh((1, -1, 1))
    model, params = build_model(args, mesh)
    config = model.config

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch["input_ids"], batch["attention_mask"])
        logp = logprobs_from_logits(logits[:, :-1], batch["input_ids"][:, 1:])
        return -logp.mean(), {}

    optimizer = optax.adamw(1e-5)
    shardings = state_shardings(params_shardings(model, mesh), optimizer, params, mesh)
    state = create_train_state(params, optimizer, shardings)
    rng = np.random.default_rng(0)
    host_batch = {
        "input_ids": rng.integers(0, config.vocab_size, (args.batch, args.seq)).astype(np.int32),
        "attention_mask": np.ones((args.batch, args.seq), np.int32),
    }
    shapes = {k: v.shape for k, v in host_batch.items()}
    step = build_train_step(loss_fn, optimizer, mesh, shardings, shapes)
    batch = shard_batch(host_batch, mesh)
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    holder = {"state": state}

    def one_step():
        holder["state"], m = step(holder["state"], batch)
        return m

    step_times = timed(one_step, args.steps)
    on_cpu = jax.devices()[0].platform == "cpu"
    size = args.matmul_size or (2048 if on_cpu else 8192)
    peak = matmul_flops_per_s(size, jnp.dtype(args.dtype), repeats=5)
    flops = model_flops(config, args.batch, args.seq)
    step_s = statistics.median(step_times)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "device": f"{jax.device_count()}x {jax.devices()[0].device_kind}",
        "batch": args.batch,
        "seq": args.seq,
        "compile_s": round(compile_s, 2),
        "step_s_median": round(step_s, 4),
        "model_tflop_per_s": round(flops / step_s / 1e12, 4),
        "matmul_tflop_per_s": round(peak / 1e12, 4),
        "matmul_size": size,
        "ratio": round(flops / step_s / peak, 3),
        "cpu_contraction_block": config.contraction_block,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""How far are our fp32 logits and transformers' fp32 logits from an fp64 truth? (Llama family)

    python bench/parity_fp64.py                     # SmolLM2-135M-Instruct (packaged)
    python bench/parity_fp64.py --model PATH --seeds 0 4

The reference is a plain numpy float64 forward pass written from the Llama equations (not
transformers' "float64" mode, whose RMSNorm and rope tables still run in float32). Prints, per
padded batch, max and mean |Δ logit| of jax fp32 (one dot per matmul, and with
`contraction_block=256`) and torch fp32 against it, and between them.
Also prints the relative error of one K=1536 matmul in XLA vs torch, the root cause measured here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def llama_forward_fp64(folder: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    from jaxrlhf.models import read_config
    from jaxrlhf.models.safetensors_io import SafetensorsFile

    cfg = read_config(folder)
    if cfg.family != "llama" or cfg.rope_scaling is not None or cfg.qkv_bias:
        raise ValueError("the fp64 reference covers plain Llama (no rope scaling, no bias)")
    file = SafetensorsFile(folder / "model.safetensors")

    def w(name: str) -> np.ndarray:
        return file.get(name).astype(np.float64)

    heads, kv, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    batch, length = ids.shape
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.float64)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2) / dim))
    ang = np.concatenate([pos[..., None] * inv] * 2, -1)[:, :, None, :]

    def rms(x, scale):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.norm_eps) * scale

    def rope(x):
        half = dim // 2
        return x * np.cos(ang) + np.concatenate([-x[..., half:], x[..., :half]], -1) * np.sin(ang)

    allowed = np.tril(np.ones((length, length), bool))[None] & mask[:, None, :].astype(bool)
    x = w("model.embed_tokens.weight")[ids]
    for layer in range(cfg.num_layers):
        pre = f"model.layers.{layer}."
        h = rms(x, w(pre + "input_layernorm.weight"))
        q = rope((h @ w(pre + "self_attn.q_proj.weight").T).reshape(batch, length, heads, dim))
        k = rope((h @ w(pre + "self_attn.k_proj.weight").T).reshape(batch, length, kv, dim))
        v = (h @ w(pre + "self_attn.v_proj.weight").T).reshape(batch, length, kv, dim)
        k, v = np.repeat(k, heads // kv, 2), np.repeat(v, heads // kv, 2)
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dim)
        s = np.where(allowed[:, None], s, -np.inf)
        # A padding query sees no key: its row is all NaN here, zeroed (and never compared).
        with np.errstate(invalid="ignore"):
            p = np.exp(s - s.max(-1, keepdims=True))
            p = np.nan_to_num(p / p.sum(-1, keepdims=True))
        o = np.einsum("bhqk,bkhd->bqhd", p, v).reshape(batch, length, heads * dim)
        x = x + o @ w(pre + "self_attn.o_proj.weight").T
        h = rms(x, w(pre + "post_attention_layernorm.weight"))
        g, u = h @ w(pre + "mlp.gate_proj.weight").T, h @ w(pre + "mlp.up_proj.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ w(pre + "mlp.down_proj.weight").T
    x = rms(x, w("model.norm.weight"))
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return x @ w(head).T


def matmul_error() -> tuple[float, float]:
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((96, 1536)), rng.standard_normal((1536, 576)) * 0.05
    ref = a @ b
    ours = np.asarray(jax.jit(jnp.matmul)(a.astype(np.float32), b.astype(np.float32)))
    theirs = (torch.tensor(a, dtype=torch.float32) @ torch.tensor(b, dtype=torch.float32)).numpy()
    scale = np.abs(ref).max()
    return np.abs(ours - ref).max() / scale, np.abs(theirs - ref).max() / scale


def main() -> None:
    import torch
    import transformers

    from jaxrlhf.models import load_pretrained

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 4])
    args = parser.parse_args()
    folder = Path(args.model)
    if args.model == "smollm2":
        from jaxrlhf.models.smollm2 import smollm2_path

        folder = smollm2_path()
    model, params = load_pretrained(folder)
    blocked, _ = load_pretrained(folder, contraction_block=256)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for seed in args.seeds:
        rng = np.random.default_rng(seed)
        ids = rng.integers(3, model.config.vocab_size, (4, 24))
        mask = np.ones((4, 24), np.int32)
        mask[1, :7] = 0
        mask[2, -5:] = 0
        ids = np.where(mask == 1, ids, 0)
        truth = llama_forward_fp64(folder, ids, mask)
        ours = np.asarray(model.apply({"params": params}, ids, mask), np.float64)
        ours_b = np.asarray(blocked.apply({"params": params}, ids, mask), np.float64)
        positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
        with torch.no_grad():
            theirs = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                        position_ids=torch.tensor(positions)).logits.double().numpy()  # fmt: skip
        real = mask.astype(bool)
        print(json.dumps({
            "seed": seed,
            "jax32_vs_fp64_max": float(np.abs(ours - truth)[real].max()),
            "jax32_vs_fp64_mean": float(np.abs(ours - truth)[real].mean()),
            "jax32_block256_vs_fp64_max": float(np.abs(ours_b - truth)[real].max()),
            "jax32_block256_vs_fp64_mean": float(np.abs(ours_b - truth)[real].mean()),
            "torch32_vs_fp64_max": float(np.abs(theirs - truth)[real].max()),
            "torch32_vs_fp64_mean": float(np.abs(theirs - truth)[real].mean()),
            "jax32_vs_torch32_max": float(np.abs(ours - theirs)[real].max()),
            "jax32_block256_vs_torch32_max": float(np.abs(ours_b - theirs)[real].max()),
        }))  # fmt: skip
    xla, torch_err = matmul_error()
    print(json.dumps({"matmul_k1536_rel_err_xla": xla, "matmul_k1536_rel_err_torch": torch_err}))


if __name__ == "__main__":
    main()

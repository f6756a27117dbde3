"""The architectures of the paper's models, known offline: config.json contents by hub name.

`jaxrlhf.plan` sizes a config's memory from these without downloading anything; a local
folder's own config.json always wins (`architecture_of`). Values are those of each model's
published config.json (the fields this project reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxrlhf.models.config import ModelConfig, config_from_hf


def _pythia(hidden: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "intermediate_size": 4 * hidden, "vocab_size": 50304, "rotary_pct": 0.25,
        "rotary_emb_base": 10000, "max_position_embeddings": 2048, "layer_norm_eps": 1e-5,
        "use_parallel_residual": True, "tie_word_embeddings": False, "hidden_act": "gelu",
        "bos_token_id": 0, "eos_token_id": 0,
    }  # fmt: skip


def _llama(**fields: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_act": "silu", "rms_norm_eps": 1e-5, **fields}  # fmt: skip


# TinyLlama-1.1B's shapes (Rho-1B is trained from it).
_RHO_1B = _llama(
    hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
    intermediate_size=5632, vocab_size=32000, rope_theta=10000.0,
    max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)  # fmt: skip

KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "EleutherAI/pythia-410m-deduped": _pythia(1024, 24, 16),
    "EleutherAI/pythia-1b-deduped": _pythia(2048, 16, 8),
    "EleutherAI/pythia-2.8b-deduped": _pythia(2560, 32, 32),
    "meta-llama/Llama-3.1-8B": _llama(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),  # fmt: skip
    "microsoft/rho-math-1b-v0.1": _RHO_1B,
    "realtreetune/rho-1b-sft-GSM8K": _RHO_1B,
}
KNOWN_ARCHITECTURES["meta-llama/Llama-3.1-8B-Instruct"] = {
    **KNOWN_ARCHITECTURES["meta-llama/Llama-3.1-8B"],
    "eos_token_id": [128001, 128008, 128009],
}


def architecture_of(path_or_name: str, head: str = "lm") -> ModelConfig:
    """The ModelConfig of a local folder (its config.json, or its stage's `hf_export/`), or of
    a known hub name; no weights are read and nothing is downloaded. `head`: "lm" or "score"."""
    path = Path(path_or_name).expanduser()
    for folder in (path / "hf_export", path):
        if (folder / "config.json").exists():
            from jaxrlhf.models.hf_io import read_config

            config = read_config(folder)
            return config if config.head == head else config.with_head(head)
    if path_or_name in ("smollm2", "tiny"):
        from jaxrlhf.models.hf_io import read_config
        from jaxrlhf.models.paths import resolve_model

        config = read_config(resolve_model(path_or_name))
        return config if config.head == head else config.with_head(head)
    if path_or_name not in KNOWN_ARCHITECTURES:
        raise ValueError(
            f"the architecture of {path_or_name!r} is unknown offline: give a local folder with "
            f"a config.json, or one of {sorted(KNOWN_ARCHITECTURES)}"
        )
    config = config_from_hf(KNOWN_ARCHITECTURES[path_or_name])
    return config if head == "lm" else config.with_head(head)

"""Model configuration: one dataclass for every supported architecture, read from and written to
a Hugging Face `config.json`.

Supported families: `llama` (Llama 2/3.x incl. "llama3" rope scaling, SmolLM2, Mistral-style
GQA; Qwen2 is the same block with q/k/v bias) and `gpt_neox` (Pythia).
"""

from __future__ import annotations

import dataclasses
from typing import Any

# Hugging Face `architectures` entry -> (family, head). "lm" = causal LM, "score" = scalar head.
HF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "lm"),
    "LlamaForSequenceClassification": ("llama", "score"),
    "MistralForCausalLM": ("llama", "lm"),
    "Qwen2ForCausalLM": ("qwen2", "lm"),
    "Qwen2ForSequenceClassification": ("qwen2", "score"),
    "GPTNeoXForCausalLM": ("gpt_neox", "lm"),
    "GPTNeoXForSequenceClassification": ("gpt_neox", "score"),
}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gpt_neox": "gpt_neox"}


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """The "llama3" rope scaling of Llama 3.1+: long wavelengths are stretched by `factor`."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the Flax modules need; derived from (and convertible back to) an HF config."""

    family: str  # "llama", "qwen2" or "gpt_neox"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rotary_dim: int | None = None  # GPT-NeoX partial rotary; None = full head_dim
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    parallel_residual: bool = True  # GPT-NeoX only
    hidden_act: str = "silu"
    head: str = "lm"  # "lm" (causal LM) or "score" (scalar reward/value head)
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Numerics, not architecture (never written to config.json): split float32 contractions
    # into blocks of this many terms for torch-level accuracy on CPU; see layers.contract.
    contraction_block: int = 0
    # Token log-probs (`Transformer(..., targets=...)`) computed this many positions at a
    # time, so that no [B, T, V] float32 logits exist at once (0 = all positions together).
    logprob_chunk: int = 0
    # LoRA adapters (never written to config.json): rank 0 = none; else each linear layer named in
    # `lora_targets` gains factors A [*in, r] and B [r, *out] beside its frozen kernel, and
    # adds (lora_alpha / r) · x A B (`layers.Projection`; PEFT's convention, B = 0 at start).
    lora_rank: int = 0
    lora_alpha: float = 0.0
    lora_targets: tuple[str, ...] = ()
    # The original HF config dict, kept so that export writes back every field we do not model.
    hf_config: dict[str, Any] = dataclasses.field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    @property
    def is_neox(self) -> bool:
        return self.family == "gpt_neox"

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def lora_rank_of(self, name: str) -> int:
        """The adapter rank of the linear layer called `name` (0: no adapter)."""
        return self.lora_rank if name in self.lora_targets else 0

    def without_lora(self) -> ModelConfig:
        """The base model: the same config with no adapters (the KL reference of a LoRA run)."""
        return dataclasses.replace(self, lora_rank=0, lora_alpha=0.0, lora_targets=())

    def with_head(self, head: str) -> ModelConfig:
        """The same backbone with a different head ("lm" or "score")."""
        if head not in ("lm", "score"):
            raise ValueError(f"head must be 'lm' or 'score', got {head!r}")
        return dataclasses.replace(self, head=head)


def _rope_settings(
    hf: dict[str, Any],
) -> tuple[float, Llama3RopeScaling | None, float | None]:
    """(theta, scaling, partial_rotary_factor) from either the transformers<5 or >=5 layout."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = params.get("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    partial = params.get(
        "partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct"))
    )
    if rope_type == "default":
        return float(theta), None, partial
    if rope_type != "llama3":
        raise NotImplementedError(
            f"rope scaling type {rope_type!r} is not supported (supported: default, llama3)"
        )
    llama3 = Llama3RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )
    return float(theta), llama3, partial


def _ids(value: Any) -> int | tuple[int, ...] | None:
    return tuple(value) if isinstance(value, list) else value


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from an HF `config.json` dict; unsupported models raise ValueError."""
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if archs and archs[0] in HF_ARCHITECTURES:
        family, head = HF_ARCHITECTURES[archs[0]]
    elif model_type in _MODEL_TYPES:
        family, head = _MODEL_TYPES[model_type], "lm"
    else:
        raise ValueError(
            f"unsupported model (architectures={archs}, model_type={model_type!r}); supported: "
            f"{sorted(HF_ARCHITECTURES)}"
        )
    theta, scaling, partial = _rope_settings(hf)
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    common = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        head_dim=head_dim,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family != "gpt_neox")),
        hidden_act=hf.get("hidden_act", "silu"),
        head=head,
        pad_token_id=hf.get("pad_token_id"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_ids(hf.get("eos_token_id")),
        hf_config=dict(hf),
    )
    if family == "gpt_neox":
        return ModelConfig(
            family=family,
            num_kv_heads=num_heads,
            norm_eps=hf.get("layer_norm_eps", 1e-5),
            rotary_dim=int(head_dim * (partial if partial is not None else 1.0)),
            qkv_bias=bool(hf.get("attention_bias", True)),
            o_bias=bool(hf.get("attention_bias", True)),
            mlp_bias=True,
            parallel_residual=bool(hf.get("use_parallel_residual", True)),
            **common,
        )
    if family == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
    if partial not in (None, 1.0):
        raise NotImplementedError(f"partial rotary ({partial}) is only supported for GPT-NeoX")
    return ModelConfig(
        family=family,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        **common,
    )


def hf_architecture(config: ModelConfig) -> str:
    """The HF `architectures` entry for this family and head."""
    for name, (family, head) in HF_ARCHITECTURES.items():
        if family == config.family and head == config.head:
            return name
    raise ValueError(f"no HF architecture for family={config.family} head={config.head}")


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The HF `config.json` dict for this config (the original dict, with our fields updated)."""
    hf = dict(config.hf_config)
    hf["architectures"] = [hf_architecture(config)]
    hf["vocab_size"] = config.vocab_size
    hf["tie_word_embeddings"] = config.tie_word_embeddings
    hf.pop("quantization_config", None)
    if config.head == "score":
        hf["num_labels"] = 1
        hf["id2label"] = {"0": "LABEL_0"}
        hf["label2id"] = {"LABEL_0": 0}
    return hf

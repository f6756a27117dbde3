"""Flax models with exact Hugging Face parity: Llama family (incl. Qwen2, SmolLM2) and GPT-NeoX.

Public API:
    load_pretrained(path, dtype="float32") -> (model, params)
    token_logprobs(model, params, input_ids, attention_mask) -> [B, T-1]
    save_pretrained(model, params, path)
    iter_hf_tensors(model, params) -> stream of (HF name, array), for weight sync
    iter_hf_slices(model, params) -> this process's slices of each tensor (publishing, no gather)
"""

from jaxrlhf.models.config import ModelConfig, config_from_hf, config_to_hf
from jaxrlhf.models.hf_io import (
    hf_tensor_specs,
    iter_hf_slices,
    iter_hf_tensors,
    load_pretrained,
    make_model,
    params_from_hf,
    read_config,
    save_pretrained,
    slice_plan,
)
from jaxrlhf.models.logprobs import logprobs_from_logits, next_token_logprobs, token_logprobs
from jaxrlhf.models.transformer import Transformer, abstract_params, init_params

__all__ = [
    "ModelConfig",
    "Transformer",
    "abstract_params",
    "config_from_hf",
    "config_to_hf",
    "hf_tensor_specs",
    "init_params",
    "iter_hf_slices",
    "iter_hf_tensors",
    "load_pretrained",
    "logprobs_from_logits",
    "make_model",
    "next_token_logprobs",
    "params_from_hf",
    "read_config",
    "save_pretrained",
    "slice_plan",
    "token_logprobs",
]

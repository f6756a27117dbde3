"""Tiny random Hugging Face models and a tiny tokenizer, built locally (nothing is downloaded).

Used by the tests, the tiny config and the benchmarks: `make_tiny_model(path, arch=...)` writes a
complete Hugging Face folder (config, safetensors weights, tokenizer with a ChatML template) that
transformers, vLLM and `jaxrlhf.models.load_pretrained` all load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from jaxrlhf.models.built import built_once

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# A small corpus so the byte-level BPE learns digits, arithmetic and a few English words.
_CORPUS = [
    "What is 12 + 34? Answer with just the number. The answer is 46.",
    "user assistant system The quick brown fox jumps over the lazy dog.",
    "#### 42 Question: how many apples? Let us think step by step.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ?",
    "Summarize the post. TL;DR: a short summary of the text follows here.",
]

# Each entry: transformers config class name and the keyword arguments of a tiny instance.
TINY_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA, tied embeddings: the shared model of the test suite (vLLM CPU needs head_dim >= 32).
    "llama": (
        "LlamaConfig",
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
        ),
    ),
    # Multi-head attention, untied embeddings, Llama 3 rope scaling, bias on q/k/v/o.
    "llama3": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            attention_bias=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # Qwen2: bias on q/k/v only, GQA, untied.
    "qwen2": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
        ),
    ),
    # Pythia-style GPT-NeoX: parallel residual, partial rotary, LayerNorm, untied.
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            rotary_pct=0.25,
            use_parallel_residual=True,
            tie_word_embeddings=False,
            layer_norm_eps=1e-5,
        ),
    ),
    # GPT-NeoX with sequential residual (covers the other branch).
    "gpt_neox_seq": (
        "GPTNeoXConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            rotary_pct=0.5,
            use_parallel_residual=False,
            tie_word_embeddings=False,
        ),
    ),
}


def make_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = 384):
    """Trains a byte-level BPE tokenizer on a tiny corpus and saves it (with a ChatML template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return save_chat_tokenizer(tokenizer, path)


def save_chat_tokenizer(tokenizer, path: str | os.PathLike):
    """`tokenizer` (a `tokenizers.Tokenizer`) as a transformers tokenizer with the special
    tokens and ChatML template above, saved to `path` and returned."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def make_tiny_model(
    path: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    sequence_classification: bool = False,
    **overrides: Any,
) -> Path:
    """Writes a random tiny model of `arch` (a key of TINY_ARCHS) and its tokenizer to `path`.

    Deterministic in `seed`. With `sequence_classification=True` the folder holds the
    `*ForSequenceClassification` layout (one label), the layout of reward and value models.
    Returns the folder. An existing complete folder is reused.
    """

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {sorted(TINY_ARCHS)}")
    return built_once(
        path,
        lambda folder: _write_tiny_model(folder, arch, seed, sequence_classification, overrides),
    )


def _write_tiny_model(path: Path, arch, seed, sequence_classification, overrides) -> None:
    import torch
    import transformers

    config_cls_name, kwargs = TINY_ARCHS[arch]
    tokenizer = make_tiny_tokenizer(path)
    kwargs = {"max_position_embeddings": 256, **kwargs, **overrides}
    config = getattr(transformers, config_cls_name)(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **kwargs,
    )
    torch.manual_seed(seed)
    if sequence_classification:
        config.num_labels = 1
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    # Random init uses std 0.02; larger weights make the parity tests meaningful (logits that
    # actually depend on every parameter) while staying well-conditioned.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.08)
            elif "bias" in name:
                param.normal_(0.0, 0.05)
            else:  # norm scales
                param.uniform_(0.7, 1.3)
    model.eval()
    model.save_pretrained(str(path), safe_serialization=True)
    generation_config = {
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    (path / "generation_config.json").write_text(json.dumps(generation_config))

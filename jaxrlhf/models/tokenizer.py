"""The tokenizer of a model folder, as `transformers.AutoTokenizer` loads it, without importing the
auto classes where it need not.

`AutoTokenizer` maps a folder's `tokenizer_config.json` "tokenizer_class" to a class. Importing it
imports transformers' auto machinery (every model's configuration, the generation utilities):
4-7 s on 2 CPU cores, in every run's process, where the tokenizer itself loads in milliseconds.
A folder with a `tokenizer.json` whose class is the generic fast tokenizer ("TokenizersBackend",
the class `save_pretrained` writes in transformers 5, or its older name "PreTrainedTokenizerFast")
and whose model type is one for which `AutoTokenizer` keeps that class (Llama, GPT-NeoX: not in
its `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`, which Qwen2 is) is loaded by that class directly:
the class and the encodings `AutoTokenizer` gives (tests/models/test_tokenizer.py checks both, and
that list). Any other folder or a hub name goes through `AutoTokenizer` as before.
"""

from __future__ import annotations

import json
from pathlib import Path

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# Model types whose folders `AutoTokenizer` loads with the generic class when it is named.
GENERIC_MODEL_TYPES = frozenset({"llama", "gpt_neox"})


def load_tokenizer(path: str | Path, **kwargs):
    """The tokenizer of the model at `path` (a folder or a hub name), as `AutoTokenizer` gives."""
    folder = Path(path)
    if generic(folder):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder, **kwargs)
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path, **kwargs)


def generic(folder: Path) -> bool:
    """Whether `folder` holds a `tokenizer.json`, names the generic fast tokenizer and is of a
    model type that `AutoTokenizer` loads with it."""
    if not (folder / "tokenizer.json").is_file():
        return False
    named = read_json(folder / "tokenizer_config.json").get("tokenizer_class")
    model_type = read_json(folder / "config.json").get("model_type")
    return named in GENERIC_CLASSES and model_type in GENERIC_MODEL_TYPES


def read_json(path: Path) -> dict:
    """The JSON object in `path`; {} where there is none (`AutoTokenizer` then says what is
    wrong)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}

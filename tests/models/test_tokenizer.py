"""`load_tokenizer`: the tokenizer `AutoTokenizer` gives, without its import where it need not
(jaxrlhf/models/tokenizer.py)."""

import subprocess
import sys

import pytest

from jaxrlhf.models.tokenizer import GENERIC_MODEL_TYPES, load_tokenizer
from tests.conftest import REPO, tiny_model

TEXTS = ["What is 12 + 30?", "  a  b\n\nc <|endoftext|> é 漢字 🙂", ""]
CHAT = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2 + 2?"}]


def same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id,
    )  # fmt: skip
    assert len(ours) == len(theirs) and ours.padding_side == theirs.padding_side
    for text in TEXTS:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
        assert ours(text, add_special_tokens=False)["input_ids"] == theirs(
            text, add_special_tokens=False
        )["input_ids"]  # fmt: skip
    if theirs.chat_template:
        kwargs = {"tokenize": False, "add_generation_prompt": True}
        assert ours.apply_chat_template(CHAT, **kwargs) == theirs.apply_chat_template(
            CHAT, **kwargs
        )  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "llama3", "gpt_neox", "qwen2"])
def test_each_tiny_models_tokenizer_is_autotokenizers(arch):
    import transformers

    folder = tiny_model(arch)
    same_tokenizer(load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder))


def test_smollm2s_tokenizer_is_autotokenizers(smollm2):
    import transformers

    same_tokenizer(load_tokenizer(smollm2), transformers.AutoTokenizer.from_pretrained(smollm2))


def test_the_model_types_taken_directly_keep_the_generic_class_in_autotokenizer():
    """A transformers that starts mapping Llama or GPT-NeoX folders naming the generic class to
    their own class (as it does Qwen2's) fails here, not in a run."""
    from transformers.models.auto import tokenization_auto

    assert not GENERIC_MODEL_TYPES & set(
        tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    )
    assert "qwen2" in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS  # ours: Auto


def test_a_generic_folder_loads_without_the_auto_classes():
    folder = tiny_model("llama")
    code = (
        "import sys; from jaxrlhf.models.tokenizer import load_tokenizer; "
        f"load_tokenizer({str(folder)!r}); "
        "print('transformers.models.auto.tokenization_auto' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=True).stdout  # fmt: skip
    assert out.split()[-1] == "False"

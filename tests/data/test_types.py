"""PromptExample holds exactly one of a chat conversation or a plain-text prompt."""

import pytest

from jaxrlhf.data.types import PreferencePair, PromptExample, SFTExample


def test_chat_or_text():
    chat = PromptExample("a", [{"role": "user", "content": "hi"}], None, "hello")
    text = PromptExample("b", None, "Q: 1 + 1?", " 2", answer="2")
    assert chat.is_chat and not text.is_chat
    assert chat.answer is None and text.answer == "2"
    assert SFTExample(text, " 2").response == " 2"
    assert PreferencePair(chat, "hello", "go away").rejected == "go away"


@pytest.mark.parametrize(
    ("messages", "text", "match"),
    [
        ([{"role": "user", "content": "hi"}], "hi", "exactly one"),
        (None, None, "exactly one"),
        ([], None, "messages is empty"),
    ],
)
def test_invalid_prompts(messages, text, match):
    with pytest.raises(ValueError, match=match):
        PromptExample("x", messages, text, "ref")

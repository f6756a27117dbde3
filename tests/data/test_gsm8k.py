"""GSM8k: answer extraction and checking by hand, and the loaders on the fixture."""

from __future__ import annotations

import json

import pytest

from jaxrlhf.data import gsm8k


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("48 - 15 = <<48-15=33>>33 pencils.\n#### 33", "33"),
        ("#### 1,500", "1500"),
        ("#### $18", "18"),
        ("####-5", "-5"),
        ("####  2.5 liters", "2.5"),
        ("#### 7\nthen 9 more", "7"),
        ("The answer is 42.", "42"),
        ("She has 1,234,567 coins in total", "1234567"),
        ("pages 10-15", "15"),
        ("It drops to -3 degrees", "-3"),
        ("#### none, I think 12", "12"),
        ("no idea", None),
        ("", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert gsm8k.extract_final_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "answer", "correct"),
    [
        ("#### 1,500", "1500", True),
        ("#### 1500", "1,500", True),
        ("The total is $20.", "20", True),
        ("#### 20.0", "20", True),
        ("#### 20.00", "20", True),
        ("So he sells 124 cookies.", "124", True),
        ("#### 21", "20", False),
        ("#### 20.5", "20", False),
        ("#### -20", "20", False),
        ("#### 20 but really 21", "20", True),
        ("I do not know", "20", False),
        ("#### 3", "three", False),
    ],
)
def test_is_correct(text, answer, correct):
    assert gsm8k.is_correct(text, answer) is correct


def test_gold_answer():
    assert gsm8k.gold_answer("a\nb\n#### 1,500") == "1500"
    with pytest.raises(ValueError, match="no '#### <number>' line"):
        gsm8k.gold_answer("just 5")


def test_prompt_examples(fixtures):
    prompts = gsm8k.prompt_examples(str(fixtures / "gsm8k"), "train")
    assert len(prompts) == 6
    first = prompts[0]
    assert first.id == "train-0"
    assert first.text == (
        "[MATH_TASK] Problem:\nMaria buys 4 packs of pencils with 12 pencils in each pack. She "
        "gives 15 pencils to her brother. How many pencils does she have left?\n\nSolution:"
    )
    assert first.answer == "33"
    assert first.reference.endswith("#### 33") and first.reference.startswith("Maria buys 4 * 12")
    assert prompts[2].answer == "1500"
    # Every reference solution is correct for its own answer.
    assert all(gsm8k.is_correct(p.reference, p.answer) for p in prompts)


def test_chat_prompts_and_sft(fixtures):
    chat = gsm8k.sft_examples(str(fixtures / "gsm8k" / "test.jsonl"), "test", chat=True, limit=2)
    assert chat[0].prompt.messages == [
        {
            "role": "user",
            "content": "A baker makes 9 trays of 16 cookies and sells all but 20 of "
            "them. How many cookies does he sell?",
        }
    ]
    assert chat[0].prompt.text is None
    assert chat[0].response == chat[0].prompt.reference
    plain = gsm8k.sft_examples(str(fixtures / "gsm8k"), "test")
    assert len(plain) == 4
    assert plain[1].response == " " + plain[1].prompt.reference
    assert plain[1].prompt.answer == "20"


def test_custom_template(fixtures):
    (prompt,) = gsm8k.prompt_examples(
        str(fixtures / "gsm8k"), "test", limit=1, template="Q: {question}\nA:"
    )
    assert prompt.text.startswith("Q: A baker") and prompt.text.endswith("\nA:")


def test_hub_config_subfolder(fixtures, tmp_path):
    (tmp_path / "main").mkdir()
    (tmp_path / "main" / "test.jsonl").write_text((fixtures / "gsm8k" / "test.jsonl").read_text())
    assert len(gsm8k.prompt_examples(str(tmp_path), "test")) == 4


def test_solution_without_final_answer(tmp_path):
    rows = [{"question": "1 + 1?", "answer": "It is 2"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"train row 0: GSM8k solution has no '####"):
        gsm8k.prompt_examples(str(tmp_path), "train")


def test_missing_answer_column(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"question": "1 + 1?"}) + "\n")
    with pytest.raises(ValueError, match="no column 'answer'"):
        gsm8k.sft_examples(str(tmp_path), "train")

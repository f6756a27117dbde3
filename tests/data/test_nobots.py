"""No Robots loaders: prompt = all but the final assistant turn; bring-your-own preference pairs."""

from __future__ import annotations

import json

import pytest

from jaxrlhf.data import nobots


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_prompts_drop_the_final_assistant_turn(fixtures):
    rows = read_jsonl(fixtures / "no_robots" / "train.jsonl")
    prompts = nobots.prompt_examples(str(fixtures / "no_robots"), "train")
    assert len(prompts) == len(rows) == 6
    for prompt, row in zip(prompts, rows, strict=True):
        assert prompt.id == row["prompt_id"]
        assert prompt.text is None and prompt.answer is None
        assert prompt.messages == [
            {"role": m["role"], "content": m["content"]} for m in row["messages"][:-1]
        ]
        assert prompt.reference == row["messages"][-1]["content"]
    first = prompts[0]
    assert first.messages == [
        {
            "role": "user",
            "content": "Give me three names for a small bakery that sells mostly bread.",
        }
    ]
    assert first.reference == "1. The Daily Crust\n2. Rise and Shine Bakery\n3. Flour and Stone"


def test_system_message_and_earlier_turns_stay_in_the_prompt(fixtures):
    chat = nobots.prompt_examples(str(fixtures / "no_robots"), "train")[2]
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert chat.messages[0]["content"].startswith("You are Milo")
    assert chat.reference.startswith("Cats spend about two thirds")


def test_sft_examples_on_the_test_split(fixtures):
    examples = nobots.sft_examples(str(fixtures / "no_robots" / "test.jsonl"), "test", limit=3)
    assert len(examples) == 3
    assert examples[2].prompt.messages[0] == {
        "role": "system",
        "content": "Answer using only the text the user gives you.",
    }
    assert examples[2].response == "The Atlantic Ocean."
    assert all(e.response == e.prompt.reference for e in examples)


def test_old_split_names(fixtures, tmp_path):
    (tmp_path / "test_sft.jsonl").write_text((fixtures / "no_robots" / "test.jsonl").read_text())
    assert len(nobots.prompt_examples(str(tmp_path), "test")) == 4
    with pytest.raises(ValueError, match=r"no split 'train'.*'test_sft'"):
        nobots.prompt_examples(str(tmp_path), "train")


def test_conversation_must_end_with_the_assistant(fixtures, tmp_path):
    row = read_jsonl(fixtures / "no_robots" / "train.jsonl")[0]
    row["messages"] = row["messages"][:-1]
    write_jsonl(tmp_path / "train.jsonl", [row])
    with pytest.raises(ValueError, match="last message is from 'user', expected the assistant"):
        nobots.prompt_examples(str(tmp_path), "train")


def test_missing_messages_column(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "hi", "prompt_id": "1"}])
    with pytest.raises(ValueError, match="no column 'messages'"):
        nobots.sft_examples(str(tmp_path), "train")


def test_toy_preference_pairs(fixtures):
    pairs = nobots.preference_pairs(str(fixtures / "toy_pref"), "train")
    assert len(pairs) == 64
    first = pairs[0]
    assert first.prompt.id == "toy-train-000"
    assert first.prompt.messages == [{"role": "user", "content": "What is 9 + 3?"}]
    assert (first.chosen, first.rejected) == ("Sure: 12", "No. Go away. It is 11")
    assert first.prompt.reference == first.chosen
    assert len(nobots.preference_pairs(str(fixtures / "toy_pref"), "test", limit=5)) == 5


def test_no_robots_rows_with_pairs_keep_their_reference(fixtures, tmp_path):
    rows = read_jsonl(fixtures / "no_robots" / "train.jsonl")[:2]
    for row in rows:
        row["chosen"], row["rejected"] = "a good answer", "a bad answer"
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    pairs = nobots.preference_pairs(str(tmp_path / "pairs.jsonl"), "train")
    assert pairs[0].prompt.messages == [
        {"role": "user", "content": rows[0]["messages"][0]["content"]}
    ]
    assert pairs[0].prompt.reference == rows[0]["messages"][-1]["content"]
    assert (pairs[1].chosen, pairs[1].rejected) == ("a good answer", "a bad answer")


def test_trl_layout(tmp_path):
    write_jsonl(
        tmp_path / "train.jsonl",
        [
            {
                "prompt": "Name a colour.",
                "chosen": [{"role": "assistant", "content": "Blue."}],
                "rejected": [{"role": "assistant", "content": "No."}],
            }
        ],
    )
    (pair,) = nobots.preference_pairs(str(tmp_path), "train")
    assert pair.prompt.messages == [{"role": "user", "content": "Name a colour."}]
    assert (pair.chosen, pair.rejected, pair.prompt.id) == ("Blue.", "No.", "train-0")


def test_preference_file_without_rejected(tmp_path):
    write_jsonl(
        tmp_path / "train.jsonl",
        [{"messages": [{"role": "user", "content": "hi"}], "chosen": "hello"}],
    )
    with pytest.raises(ValueError, match=r"no column 'rejected'.*messages \(or prompt\) \+ chosen"):
        nobots.preference_pairs(str(tmp_path / "train.jsonl"), "train")


def test_missing_preference_file():
    with pytest.raises(FileNotFoundError, match="'./pairs/train.jsonl' does not exist"):
        nobots.preference_pairs("./pairs/train.jsonl", "train")

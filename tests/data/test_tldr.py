"""TL;DR loaders on the fixtures: prompt format, responses, both preference layouts, errors."""

from __future__ import annotations

import json

import pytest

from jaxrlhf.data import tldr

FIRST_PROMPT = (
    "SUBREDDIT: r/relationships\n\n"
    "TITLE: My [24F] roommate [25F] keeps eating my food and says it is no big deal\n\n"
    "POST: We have lived together for a year. Every week some of my groceries disappear and "
    "when I asked her about it she laughed and said we should share anyway.\n\nI pay for my own "
    "food and I am on a tight budget. How do I bring this up again without a fight?\n\n"
    "TL;DR:"
)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_prompt_format_exact(fixtures):
    prompts = tldr.prompt_examples(str(fixtures / "tldr_sft"), "train")
    assert len(prompts) == 6
    first = prompts[0]
    assert first.id == "t3_1a2b3c"
    assert first.text == FIRST_PROMPT
    assert first.messages is None and first.answer is None
    assert first.reference == (
        " roommate eats my groceries and shrugs it off, how do I ask her to stop without "
        "starting a fight?"
    )


def test_prompts_match_the_preprocessed_columns(fixtures):
    rows = read_jsonl(fixtures / "tldr_sft" / "validation.jsonl")
    prompts = tldr.prompt_examples(str(fixtures / "tldr_sft"), "validation")
    assert [p.text for p in prompts] == [row["query"] for row in rows]
    assert [p.reference for p in prompts] == [
        row["reference_response"].removesuffix("<|endoftext|>") for row in rows
    ]


def test_sft_examples(fixtures):
    examples = tldr.sft_examples(str(fixtures / "tldr_sft" / "train.jsonl"), "train", limit=2)
    assert len(examples) == 2
    rows = read_jsonl(fixtures / "tldr_sft" / "train.jsonl")
    for example, row in zip(examples, rows, strict=False):
        assert example.response == " " + row["summary"]
        assert example.prompt.reference == example.response


def test_comparison_pairs_follow_choice(fixtures):
    rows = read_jsonl(fixtures / "tldr_pref" / "train.jsonl")
    pairs = tldr.preference_pairs(str(fixtures / "tldr_pref"), "train")
    assert len(pairs) == len(rows) == 6
    for pair, row in zip(pairs, rows, strict=True):
        texts = [s["text"] for s in row["summaries"]]
        assert pair.chosen == texts[row["choice"]]
        assert pair.rejected == texts[1 - row["choice"]]
        assert pair.chosen.startswith(" ") and pair.rejected.startswith(" ")
        assert pair.prompt.id == row["info"]["id"]
        assert pair.prompt.text == row["query"]
        assert pair.prompt.reference == pair.chosen
    # Two comparisons of one post share its prompt.
    assert (pairs[0].prompt.id, pairs[0].prompt.text) == (pairs[1].prompt.id, pairs[1].prompt.text)
    assert pairs[0].prompt.text == FIRST_PROMPT


def test_article_rows_get_the_article_prompt(fixtures):
    pairs = tldr.preference_pairs(str(fixtures / "tldr_pref"), "validation_cnndm")
    assert len(pairs) == 2
    assert pairs[0].prompt.text.startswith("Article:\nA small town has turned")
    assert pairs[0].prompt.text.endswith("\n\nTL;DR:\n")
    assert pairs[1].chosen.startswith("A record number")


def test_flat_layout_gives_the_same_pairs(fixtures, tmp_path):
    # Relabelled sets keep only query / chosen / rejected (with <|endoftext|>).
    rows = read_jsonl(fixtures / "tldr_pref" / "validation.jsonl")
    flat = [{k: row[k] for k in ("query", "chosen", "rejected")} for row in rows]
    write_jsonl(tmp_path / "relabelled.jsonl", flat)
    from_flat = tldr.preference_pairs(str(tmp_path / "relabelled.jsonl"), "validation")
    from_comparisons = tldr.preference_pairs(str(fixtures / "tldr_pref"), "validation")
    assert [(p.prompt.text, p.chosen, p.rejected) for p in from_flat] == [
        (p.prompt.text, p.chosen, p.rejected) for p in from_comparisons
    ]
    assert [p.prompt.id for p in from_flat] == [f"validation-{i}" for i in range(4)]


def test_fit_prompt_cuts_post_at_newlines():
    post = "first paragraph\nsecond paragraph\nthird paragraph"
    full = tldr.format_prompt("test", "title", post)
    assert tldr.fit_prompt("test", "title", post, len, max_tokens=len(full)) == full
    shorter = tldr.fit_prompt("test", "title", post, len, max_tokens=len(full) - 1)
    assert shorter == tldr.format_prompt("test", "title", "first paragraph\nsecond paragraph")
    one_line = tldr.fit_prompt(
        "s", "t", "abcdef", len, max_tokens=len(tldr.format_prompt("s", "t", "abc"))
    )
    assert one_line == tldr.format_prompt("s", "t", "abc")
    with pytest.raises(ValueError, match="even without a post"):
        tldr.fit_prompt("s", "t", "abc", len, max_tokens=5)


def test_missing_column_is_named(fixtures, tmp_path):
    rows = read_jsonl(fixtures / "tldr_sft" / "train.jsonl")
    write_jsonl(
        tmp_path / "train.jsonl", [{k: v for k, v in r.items() if k != "summary"} for r in rows]
    )
    with pytest.raises(ValueError) as error:
        tldr.sft_examples(str(tmp_path), "train")
    assert "no column 'summary'" in str(error.value)
    assert str(tmp_path) in str(error.value)


def test_preference_set_in_neither_layout(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"query": "q", "better": " a", "worse": " b"}])
    with pytest.raises(ValueError, match=r"no column 'chosen'.*info \+ summaries \+ choice"):
        tldr.preference_pairs(str(tmp_path), "train")


def test_bad_choice(fixtures, tmp_path):
    row = read_jsonl(fixtures / "tldr_pref" / "train.jsonl")[0]
    row["choice"] = 2
    write_jsonl(tmp_path / "train.jsonl", [row])
    with pytest.raises(ValueError, match="choice 0 or 1, got 2 summaries and choice 2"):
        tldr.preference_pairs(str(tmp_path), "train")


def test_missing_split_of_the_sft_folder(fixtures):
    with pytest.raises(ValueError, match=r"no split 'test'.*'train', 'validation'"):
        tldr.prompt_examples(str(fixtures / "tldr_sft"), "test")

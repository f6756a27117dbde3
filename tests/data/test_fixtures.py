"""The fixtures are in the hub schemas, small, regenerable, and toy_pref is learnable."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

# Columns of the hub datasets (dataset cards and the preprocessing script of
# vwxyzjn/summarize_from_feedback_details, tldr_dataset.py).
HUB_COLUMNS = {
    "tldr_sft": [
        "id", "subreddit", "title", "post", "summary", "query_token", "query",
        "reference_response", "reference_response_token", "reference_response_token_len",
        "query_reference_response", "query_reference_response_token",
        "query_reference_response_token_response_label", "query_reference_response_token_len",
    ],
    "tldr_pref": [
        "info", "summaries", "choice", "worker", "batch", "split", "extra", "query_token",
        "query", "chosen", "chosen_token", "chosen_token_len", "rejected", "rejected_token",
        "rejected_token_len", "chosen_policy", "rejected_policy", "policies",
        "chosen_len_minus_rejected_len", "query_chosen", "query_chosen_token",
        "query_chosen_token_len", "query_rejected", "query_rejected_token",
        "query_rejected_token_len", "query_token_len", "query_chosen_token_response_label",
        "query_rejected_token_response_label",
    ],
    "no_robots": ["prompt", "prompt_id", "messages", "category"],
    "gsm8k": ["question", "answer"],
}  # fmt: skip
SPLITS = {
    "tldr_sft": ["train", "validation"],
    "tldr_pref": ["train", "validation", "validation_cnndm"],
    "no_robots": ["test", "train"],
    "gsm8k": ["test", "train"],
    "toy_pref": ["test", "train"],
}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("name", HUB_COLUMNS)
def test_hub_schema_and_size(name, fixtures):
    assert sorted(f.stem for f in (fixtures / name).glob("*.jsonl")) == sorted(SPLITS[name])
    for path in (fixtures / name).glob("*.jsonl"):
        rows = read_jsonl(path)
        assert 2 <= len(rows) <= 12, path
        for row in rows:
            assert list(row) == HUB_COLUMNS[name], path


def test_tldr_pref_nested_schema(fixtures):
    for row in read_jsonl(fixtures / "tldr_pref" / "train.jsonl"):
        assert list(row["info"]) == ["id", "post", "title", "subreddit", "site", "article"]
        assert [list(s) for s in row["summaries"]] == [["text", "policy", "note"]] * 2
        assert row["choice"] in (0, 1)
        assert row["chosen"] == row["summaries"][row["choice"]]["text"] + "<|endoftext|>"


def test_no_robots_nested_schema(fixtures):
    for row in read_jsonl(fixtures / "no_robots" / "train.jsonl"):
        assert all(list(m) == ["content", "role"] for m in row["messages"])
        assert row["messages"][-1]["role"] == "assistant"
        assert row["prompt"] == next(m["content"] for m in row["messages"] if m["role"] == "user")


@pytest.mark.parametrize("script", ["make_fixtures", "make_toy_pref"])
def test_generators_reproduce_the_committed_files(script, fixtures, fixture_script, tmp_path):
    module = fixture_script(script)
    module.main(tmp_path)
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.jsonl"))
    assert written
    base = fixtures if script == "make_fixtures" else fixtures / "toy_pref"
    for relative in written:
        assert (tmp_path / relative).read_bytes() == (base / relative).read_bytes(), relative


def test_toy_pref_is_learnable_and_disjoint(fixtures):
    splits = {s: read_jsonl(fixtures / "toy_pref" / f"{s}.jsonl") for s in ("train", "test")}
    assert {s: len(rows) for s, rows in splits.items()} == {"train": 64, "test": 32}
    questions = {s: {row["messages"][0]["content"] for row in rows} for s, rows in splits.items()}
    assert len(questions["train"]) == 64 and len(questions["test"]) == 32
    assert not questions["train"] & questions["test"]
    for row in splits["train"] + splits["test"]:
        a, b = map(
            int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", row["messages"][0]["content"]).groups()
        )
        assert row["chosen"] == f"Sure: {a + b}"
        wrong = int(re.fullmatch(r"No\. Go away\. It is (\d+)", row["rejected"]).group(1))
        assert wrong != a + b and wrong > 0
        assert all(text.isascii() for text in (row["chosen"], row["rejected"]))

"""load_split: hub vs local, every local layout, and what its errors say."""

from __future__ import annotations

import datasets
import pytest

from jaxrlhf.data.sources import (
    SplitNotFoundError,
    first_rows,
    load_split,
    looks_like_path,
    require_columns,
)

ROWS = {
    "train": [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(5)],
    "test": [{"question": "t0", "answer": "#### 7"}, {"question": "t1", "answer": "#### 8"}],
}


def as_dataset(split: str) -> datasets.Dataset:
    return datasets.Dataset.from_list(ROWS[split])


def questions(dataset) -> list[str]:
    return list(dataset["question"])


@pytest.fixture
def no_hub(monkeypatch):
    """Fail the test if anything reaches datasets.load_dataset with a hub name."""
    real = datasets.load_dataset

    def guarded(path, *args, **kwargs):
        if path not in ("json", "parquet"):
            raise AssertionError(f"hub lookup of {path!r}")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", guarded)


def test_jsonl_file_is_the_split(fixtures, no_hub):
    dataset = load_split(str(fixtures / "gsm8k" / "test.jsonl"), "test")
    assert dataset.column_names == ["question", "answer"]
    assert len(dataset) == 4


def test_folder_of_split_files(fixtures, no_hub):
    assert len(load_split(str(fixtures / "gsm8k"), "train")) == 6
    assert len(load_split(str(fixtures / "gsm8k"), "test")) == 4


def test_parquet_file_and_folder(tmp_path, no_hub):
    as_dataset("train").to_parquet(tmp_path / "train.parquet")
    as_dataset("test").to_parquet(tmp_path / "test.parquet")
    assert questions(load_split(str(tmp_path / "train.parquet"), "train")) == [
        "q0",
        "q1",
        "q2",
        "q3",
        "q4",
    ]
    assert questions(load_split(str(tmp_path), "test")) == ["t0", "t1"]


def test_sharded_parquet_in_data_folder(tmp_path, no_hub):
    # The layout of a downloaded hub snapshot: data/{split}-0000N-of-0000M.parquet.
    (tmp_path / "data").mkdir()
    train = as_dataset("train")
    train.select(range(3)).to_parquet(tmp_path / "data" / "train-00000-of-00002.parquet")
    train.select(range(3, 5)).to_parquet(tmp_path / "data" / "train-00001-of-00002.parquet")
    assert questions(load_split(str(tmp_path), "train")) == ["q0", "q1", "q2", "q3", "q4"]


def test_split_subfolder(tmp_path, no_hub):
    (tmp_path / "test").mkdir()
    as_dataset("test").to_parquet(tmp_path / "test" / "0000.parquet")
    assert questions(load_split(str(tmp_path), "test")) == ["t0", "t1"]


def test_config_subfolder(tmp_path, no_hub):
    (tmp_path / "main").mkdir()
    as_dataset("test").to_json(tmp_path / "main" / "test.jsonl")
    assert questions(load_split(str(tmp_path), "test", name="main")) == ["t0", "t1"]


def test_dataset_save_to_disk(tmp_path, no_hub):
    as_dataset("train").save_to_disk(str(tmp_path / "saved"))
    assert questions(load_split(str(tmp_path / "saved"), "train"))[:2] == ["q0", "q1"]


def test_dataset_dict_save_to_disk(tmp_path, no_hub):
    datasets.DatasetDict({s: as_dataset(s) for s in ROWS}).save_to_disk(str(tmp_path / "dd"))
    assert questions(load_split(str(tmp_path / "dd"), "test")) == ["t0", "t1"]
    with pytest.raises(ValueError, match=r"no split 'validation'.*'test', 'train'"):
        load_split(str(tmp_path / "dd"), "validation")


def test_home_relative_path(tmp_path, monkeypatch, no_hub):
    monkeypatch.setenv("HOME", str(tmp_path))
    as_dataset("test").to_json(tmp_path / "eval.jsonl")
    assert len(load_split("~/eval.jsonl", "test")) == 2


@pytest.mark.parametrize(
    "source",
    ["./missing/train.jsonl", "/no/such/folder", "~/no_such_dir", "a/b/c", "gsm8k.parquet"],
)
def test_missing_local_path_is_named_and_never_looked_up(source, no_hub):
    with pytest.raises(FileNotFoundError) as error:
        load_split(source, "train")
    assert repr(source) in str(error.value)
    assert "does not exist" in str(error.value)


def test_missing_split_lists_the_ones_there(fixtures, no_hub):
    with pytest.raises(SplitNotFoundError) as error:
        load_split(str(fixtures / "gsm8k"), "validation")
    assert isinstance(error.value, ValueError)
    assert error.value.available == ["test", "train"]
    assert "no split 'validation'" in str(error.value)
    assert "'test', 'train'" in str(error.value)


def test_folder_without_data(tmp_path, no_hub):
    with pytest.raises(ValueError, match="none found"):
        load_split(str(tmp_path), "train")


def test_unsupported_file_type(tmp_path, no_hub):
    (tmp_path / "train.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_split(str(tmp_path / "train.csv"), "train")


def test_hub_name_goes_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name, kwargs))
        return datasets.DatasetDict({s: as_dataset(s) for s in ROWS})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert questions(load_split("openai/gsm8k", "test", name="main")) == ["t0", "t1"]
    assert calls == [("openai/gsm8k", "main", {})]
    with pytest.raises(SplitNotFoundError, match=r"'openai/gsm8k' has no split 'dev'"):
        load_split("openai/gsm8k", "dev", name="main")


@pytest.mark.parametrize(
    ("source", "is_path"),
    [
        ("openai/gsm8k", False),
        ("HuggingFaceH4/no_robots", False),
        ("owner/data-v1.5", False),
        ("./gsm8k", True),
        ("/data/gsm8k", True),
        ("~/gsm8k", True),
        ("data/gsm8k/main", True),
        ("train.jsonl", True),
        ("pairs.parquet", True),
    ],
)
def test_looks_like_path(source, is_path):
    assert looks_like_path(source) is is_path


def test_require_columns_names_column_and_source():
    dataset = as_dataset("test")
    require_columns(dataset, ["question", "answer"], source="src", split="test")
    with pytest.raises(ValueError) as error:
        require_columns(dataset, ["question", "summary"], source="my/src", split="test")
    message = str(error.value)
    assert "'my/src'" in message and "'summary'" in message and "question, answer" in message


def test_first_rows_limit_and_columns():
    dataset = as_dataset("train")
    assert first_rows(dataset, ["question"], limit=2) == [{"question": "q0"}, {"question": "q1"}]
    assert len(first_rows(dataset, ["question"], limit=100)) == 5
    assert first_rows(dataset, ["answer"], limit=0) == []
    with pytest.raises(ValueError, match="limit must be >= 0"):
        first_rows(dataset, ["question"], limit=-1)

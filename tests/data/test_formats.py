"""Every task loader gives the same examples from each way of storing its fixture."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from jaxrlhf.data import gsm8k, nobots, tldr

# (fixture folder, split, loader)
LOADERS = {
    "tldr_sft": ("tldr_sft", "validation", tldr.sft_examples),
    "tldr_prompts": ("tldr_sft", "train", tldr.prompt_examples),
    "tldr_pref": ("tldr_pref", "validation", tldr.preference_pairs),
    "no_robots": ("no_robots", "test", nobots.sft_examples),
    "toy_pref": ("toy_pref", "test", nobots.preference_pairs),
    "gsm8k": ("gsm8k", "test", gsm8k.prompt_examples),
}
FORMATS = ["jsonl_file", "parquet_file", "parquet_folder", "save_to_disk", "dataset_dict"]


def store(fixture_dir: Path, split: str, how: str, tmp_path: Path) -> str:
    """The fixture's splits re-stored as `how`; returns the source to load `split` from."""
    splits = {
        f.stem: datasets.Dataset.from_json(str(f)) for f in sorted(fixture_dir.glob("*.jsonl"))
    }
    if how == "jsonl_file":
        return str(fixture_dir / f"{split}.jsonl")
    if how == "parquet_file":
        splits[split].to_parquet(tmp_path / "eval.parquet")
        return str(tmp_path / "eval.parquet")
    if how == "parquet_folder":
        for name, dataset in splits.items():
            dataset.to_parquet(tmp_path / f"{name}-00000-of-00001.parquet")
        return str(tmp_path)
    if how == "save_to_disk":
        splits[split].save_to_disk(str(tmp_path / "one_split"))
        return str(tmp_path / "one_split")
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "all_splits"))
    return str(tmp_path / "all_splits")


@pytest.mark.parametrize("how", FORMATS)
@pytest.mark.parametrize("loader", LOADERS)
def test_same_examples_from_every_format(loader, how, fixtures, tmp_path):
    folder, split, load = LOADERS[loader]
    expected = load(str(fixtures / folder), split)
    assert 4 <= len(expected) <= 64
    assert load(store(fixtures / folder, split, how, tmp_path), split) == expected

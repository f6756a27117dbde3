"""Builds a test bed (`jaxrlhf.models.bed`) in this process: random init, then the project's
own SFT stage on the train split's additions.

`python -m jaxrlhf.stages.bed_build RECIPE_JSON FOLDER` is what `jaxrlhf.models.bed.build`
runs, in a fresh process pinned to one core (so the bytes depend on the recipe alone).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from jaxrlhf.models.bed import (
    RECIPE_VERSION,
    SFT_SECTIONS,
    SFT_UNREAD,
    Recipe,
    hf_config,
    make_tokenizer,
    sft_settings,
    token_id,
)


def build_here(folder: Path, recipe: Recipe, log=print) -> dict[str, Any]:
    """Builds `recipe` into `folder` in this process: random init, then the SFT stage.
    Returns the SFT stage's summary with the build's seconds."""
    import jax

    from jaxrlhf.models import init_params, make_model, save_pretrained
    from jaxrlhf.models.config import config_from_hf
    from jaxrlhf.stages import sft

    started = time.perf_counter()
    folder = Path(folder)
    with tempfile.TemporaryDirectory(prefix="bed-build-") as work:
        init = Path(work) / "init"
        make_tokenizer(init)
        generation = {"eostoken_id": token_id("<|im_end|>"),
                      "padtoken_id": token_id("<|endoftext|>")}  # fmt: skip
        (init / "generation_config.json").write_text(json.dumps(generation, indent=2))
        hf = hf_config(recipe.size)
        model = make_model(config_from_hf(hf))
        save_pretrained(model, init_params(model, jax.random.PRNGKey(recipe.seed)), init)
        (init / "config.json").write_text(json.dumps(hf, indent=2))
        run = Path(work) / "sft"
        summary = sft.run(sft_config(recipe, run), init, log)
        for item in sorted(Path(summary["export_dir"]).iterdir()):
            shutil.copy(item, folder / item.name)
        record = folder / ".build"  # hidden: timings, which differ between builds
        record.mkdir(exist_ok=True)
        shutil.copy(run / "metrics.jsonl", record / "sft_metrics.jsonl")
        summary.pop("export_dir")  # gone with `work`
        (record / "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    described = {"name": recipe.size, "recipe": dataclasses.asdict(recipe),
                 "digest": recipe.digest(), "recipe_version": RECIPE_VERSION}  # fmt: skip
    (folder / "bed.json").write_text(json.dumps(described, indent=2) + "\n")
    return {**summary, "build_seconds": time.perf_counter() - started}


def sft_config(recipe: Recipe, output_dir: Path):
    """The SFT stage's config for `recipe`: `base_config()` with every key the stage reads set
    from `bed.sft_settings` (the bed's digest covers them all). Refuses while `base_config()`
    has a key in those sections that the bed neither sets nor names as unread."""
    from jaxrlhf.config import base_config

    config = base_config()
    settings = sft_settings(recipe)
    unknown = sorted(set(section_keys(config)) - set(settings) - set(SFT_UNREAD))
    if unknown:
        raise ValueError(
            f"base_config() has SFT keys the test bed does not set: {', '.join(unknown)}. Set "
            "each in jaxrlhf.models.bed.SFT_FIXED (to the value the committed start models were "
            "built with, or raise RECIPE_VERSION), or name it in SFT_UNREAD if the SFT stage "
            "does not read it"
        )
    config.stage = "sft"
    config.output_dir = str(output_dir)
    for key, value in settings.items():
        *sections, name = key.split(".")
        node = config
        for section in sections:
            node = node[section]
        node[name] = value
    return config


def section_keys(config) -> list[str]:
    """The "section.key" names of `config`'s sections that the SFT stage reads."""
    return [f"{section}.{key}" for section in SFT_SECTIONS for key in config[section]]


def main(argv: list[str]) -> None:
    """`python -m jaxrlhf.stages.bed_build RECIPE_JSON FOLDER`: `build_here`."""
    if len(argv) != 2:
        raise SystemExit("usage: python -m jaxrlhf.stages.bed_build RECIPE_JSON FOLDER")
    recipe_json, folder = argv
    summary = build_here(Path(folder), Recipe(**json.loads(recipe_json)))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

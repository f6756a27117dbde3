"""The bed's cache key (`jaxrlhf.models.bed.Recipe.digest`) covers what a build's bytes depend
on: a changed input either changes the key (a new build) or cannot reach a build at all.

- The SFT stage's config: the bed sets every key of it the stage reads, so a `base_config()`
  default changed for other runs reaches no bed; the bed's own settings are in the key; and a
  new key in those sections stops the build until the bed sets it or names it unread.
- The chat template and the versions of jax, jaxlib, flax and optax are in the key.
- The code that trains a bed is pinned here (`PINNED`): an edit fails this test, which says
  how to go on (the module docstring of `jaxrlhf.models.bed` says why it is pinned rather than
  hashed into the key).
"""

from __future__ import annotations

import re

import pytest

import jaxrlhf.config
from jaxrlhf.config import keys
from jaxrlhf.models import bed, tiny
from jaxrlhf.stages import bed_build

# bed.build_code_digest() of the code that built the committed start models, as it is now.
PINNED = "49a73368e5efebb4f385302d9733f62214cd0c05be3a8b8cf87b85a576ebdca6"

RECIPE = bed.Recipe(size="bed", steps=3, batch_size=4)


def _with_base_config(monkeypatch, change):
    """`base_config()` returns its config after `change(config)`, for the rest of the test."""
    original = keys.base_config

    def changed():
        config = original()
        change(config)
        return config

    monkeypatch.setattr(keys, "base_config", changed)
    monkeypatch.setattr(jaxrlhf.config, "base_config", changed)


def _set(config, key: str, value) -> None:
    section, name = key.split(".")
    config[section][name] = value


DEFAULTS = [("train.weight_decay", 0.1), ("train.max_grad_norm", 0.5),
            ("train.micro_batch_size", 2), ("model.dtype", "bfloat16"),
            ("model.param_dtype", "bfloat16"), ("model.remat", True),
            ("task.validation_fraction", 0.1)]  # fmt: skip


@pytest.mark.parametrize("key,value", DEFAULTS, ids=[key for key, _ in DEFAULTS])
def test_a_changed_sft_default_never_builds_other_bytes_under_the_same_key(monkeypatch, key, value):
    before = RECIPE.digest(), bed_build.sft_config(RECIPE, "out").to_dict()
    _with_base_config(monkeypatch, lambda config: _set(config, key, value))
    after = RECIPE.digest(), bed_build.sft_config(RECIPE, "out").to_dict()
    assert after[0] != before[0] or after[1] == before[1], (
        f"base_config's {key} changed what a bed trains with, under the same key"
    )


def test_the_beds_own_sft_settings_are_in_its_key(monkeypatch):
    digest = RECIPE.digest()
    monkeypatch.setitem(bed.SFT_FIXED, "train.weight_decay", 0.1)
    assert RECIPE.digest() != digest
    assert bed_build.sft_config(RECIPE, "out").train.weight_decay == 0.1


def test_a_new_key_of_an_sft_section_stops_the_build_until_the_bed_names_it(monkeypatch):
    _with_base_config(monkeypatch, lambda config: config.train.update(warmup_steps=0))
    with pytest.raises(ValueError, match=r"does not set: train\.warmup_steps\. "):
        bed_build.sft_config(RECIPE, "out")
    monkeypatch.setattr(bed_build, "SFT_UNREAD", (*bed.SFT_UNREAD, "train.warmup_steps"))
    assert bed_build.sft_config(RECIPE, "out").train.warmup_steps == 0


def test_the_chat_template_and_library_versions_are_in_the_key(monkeypatch):
    digest = RECIPE.digest()
    monkeypatch.setattr(tiny, "CHAT_TEMPLATE", tiny.CHAT_TEMPLATE + " ")
    assert RECIPE.digest() != digest
    monkeypatch.undo()
    assert RECIPE.digest() == digest
    version = bed.metadata.version
    for library in ("jax", "jaxlib"):

        def other(name, library=library):
            return "0.0.1" if name == library else version(name)

        monkeypatch.setattr(bed.metadata, "version", other)
        assert RECIPE.digest() != digest, library


def test_the_code_digest_skips_comments_and_docstrings_only(tmp_path):
    code = '"""Doc."""\n\n\ndef f(x):\n    """Doc."""\n    return x + 1  # one\n'
    path = tmp_path / "m.py"
    path.write_text(code)
    first = bed._code_of(path)
    path.write_text(code.replace("Doc.", "Other\n    words.").replace("# one", "# two") + "\n\n")
    assert bed._code_of(path) == first
    path.write_text(code.replace("x + 1", "x + 2"))
    assert bed._code_of(path) != first


def test_the_code_that_trains_the_bed_is_pinned():
    now = bed.build_code_digest()
    assert now == PINNED, (
        f"The code that trains the test bed changed ({', '.join(bed.BUILD_CODE)} under "
        "jaxrlhf/, comments and docstrings left out). If the change can change what a build "
        "writes (the weights: anything of the init, the data, the loss, the optimizer, the "
        "step), raise RECIPE_VERSION in jaxrlhf/models/bed.py: every cached bed is built "
        "again, and the claims' committed start models (results/claims/start-models) must be "
        "renamed to the new digest, each with its bed.json's digest, as "
        "tests/experiments/test_claims.py::test_the_committed_start_models_are_the_recipes_builds "
        "then asks:\n" + "\n".join(_renames()) + "\nEither way, set PINNED in "
        f"tests/models/test_bed_key.py to {now!r}."
    )


def _renames() -> list[str]:
    """The `git mv` of each committed start model whose name is not its recipe's digest now."""
    from jaxrlhf.experiments.claims.start_models import COMMITTED

    moves = []
    for size in bed.SIZES:
        name = f"{size}-{bed.Recipe(size=size).digest()[:16]}"
        pattern = re.compile(re.escape(size) + r"-[0-9a-f]{16}")
        for old in COMMITTED.glob(f"{size}-*"):
            if pattern.fullmatch(old.name) and old.name != name:
                old = old.relative_to(COMMITTED.parents[2])
                moves.append(f"  git mv {old} {old.parent / name}")
    return moves or ["  (none yet: the digest is the same until RECIPE_VERSION is raised)"]

"""Config validation: every problem is reported before any work starts.

Configs are `ml_collections.ConfigDict`s returned by `configs/*.py:get_config()`. Command-line
overrides (`--config.a.b=value`) of unknown keys or of the wrong type are rejected by
ml_collections itself (the config is locked); `validate` checks values.
"""

from __future__ import annotations

import math

import ml_collections

STAGES = ("sft",)
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises ConfigError naming the first bad key."""
    _require(config.stage in STAGES, f"config.stage={config.stage!r}: must be one of {STAGES}")
    _require(
        config.model.dtype in DTYPES, f"config.model.dtype={config.model.dtype!r}: one of {DTYPES}"
    )
    shape = tuple(config.mesh.shape)
    _require(
        len(shape) == 3 and all(s == -1 or s >= 1 for s in shape) and shape.count(-1) <= 1,
        f"config.mesh.shape={shape}: three sizes (data, fsdp, tensor), each >= 1 or one -1",
    )
    train = config.train
    for key in ("batch_size", "total_steps", "max_length"):
        _require(train[key] >= 1, f"config.train.{key}={train[key]}: must be >= 1")
    _require(train.learning_rate > 0, f"config.train.learning_rate={train.learning_rate}: > 0")
    known = math.prod(s for s in shape if s != -1)
    _require(
        train.batch_size % known == 0 or -1 in shape,
        f"config.train.batch_size={train.batch_size} is not divisible by the mesh {shape}",
    )
    _require(bool(config.output_dir), "config.output_dir: must name a folder")

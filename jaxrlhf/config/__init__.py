"""Configs: `base_config()` holds every key with its default; `configs/*.py` start from it.

Configs are `ml_collections.ConfigDict`s returned by `configs/*.py:get_config()`. Command-line
overrides (`--config.a.b=value`) of unknown keys or of the wrong type are rejected by
ml_collections itself (the config is locked; `parse_flags` turns an unknown key into one line
naming it); `validate` checks values. Both happen before any work starts.

- `keys`: `base_config()`, every key with its default and meaning, section by section.
- `checks`: `validate`, `checked`, `resolve`, `ConfigError`.
- `flags`: `parse_flags` and the one line an unknown override gets.
"""

from jaxrlhf.config.checks import ConfigError, checked, resolve, validate
from jaxrlhf.config.flags import closest_keys, config_keys, parse_flags, unknown_override_message
from jaxrlhf.config.keys import DTYPES, STAGES, base_config, model_options

__all__ = [
    "DTYPES",
    "STAGES",
    "ConfigError",
    "base_config",
    "checked",
    "closest_keys",
    "config_keys",
    "model_options",
    "parse_flags",
    "resolve",
    "unknown_override_message",
    "validate",
]

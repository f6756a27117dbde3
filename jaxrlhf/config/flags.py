"""Command-line overrides of a config (`--config.KEY=VALUE`): an unknown key is one line naming
the closest known keys, not ml_collections' traceback."""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Iterator, Sequence

import ml_collections
from absl import app, flags


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's flag parsing, for `app.run(main, flags_parser=parse_flags)` in every entry point
    with a `--config`: an override of a key the config does not have exits 2 with one line
    (`config error: unknown key config.train.learning_rte; closest known keys: ...`) instead
    of ml_collections' traceback. Other flag errors keep absl's own message."""
    try:
        return app.parse_flags_with_usage(list(argv))
    except (AttributeError, KeyError):
        message = unknown_override_message(argv)
        if message is None:
            raise
        print(f"config error: {message}", file=sys.stderr)
        sys.exit(2)


def unknown_override_message(argv: Sequence[str]) -> str | None:
    """What is wrong with the first `--config.KEY` override of argv whose key the config file
    (`--config=PATH[:ARG]`) lacks, with the closest known keys; None when every key exists."""
    path = _config_argument(argv)
    if path is None:
        return None
    config = flags.FLAGS["config"].parser.parse(path)  # the entry point's config file parser
    known = list(config_keys(config))
    for key in _override_keys(argv):
        if key not in known and not any(k.startswith(key + ".") for k in known):
            close = closest_keys(key, known)
            hint = (
                "closest known keys: " + ", ".join(f"config.{k}" for k in close)
                if close
                else "jaxrlhf/config/keys.py:base_config() lists every key"
            )
            return f"unknown key config.{key}; {hint}"
    return None


def config_keys(config: ml_collections.ConfigDict, prefix: str = "") -> Iterator[str]:
    """The dotted paths of every leaf of `config` ("train.learning_rate", ...)."""
    for name, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from config_keys(value, f"{prefix}{name}.")
        else:
            yield prefix + name


def closest_keys(key: str, known: Sequence[str], count: int = 3) -> list[str]:
    """Up to `count` known keys most like `key`: by the whole path (a typo) or by its last
    part (a key put in the wrong section), best first."""

    def similarity(candidate: str) -> float:
        whole = difflib.SequenceMatcher(None, key, candidate).ratio()
        last = difflib.SequenceMatcher(None, key.split(".")[-1], candidate.split(".")[-1]).ratio()
        return max(whole, last if last >= 0.8 else 0.0)

    scored = sorted(((similarity(k), k) for k in known), key=lambda item: -item[0])
    return [k for score, k in scored[:count] if score >= 0.7]


def _config_argument(argv: Sequence[str]) -> str | None:
    """The value of `--config=PATH` (or `--config PATH`) in argv, None without one."""
    for i, arg in enumerate(argv):
        match = re.fullmatch(r"--?config(=(.*))?", arg)
        if match and match.group(1):
            return match.group(2)
        if match:
            return argv[i + 1] if i + 1 < len(argv) else None
    return None


def _override_keys(argv: Sequence[str]) -> list[str]:
    """The keys of the `--config.KEY[=VALUE]` (or `--noconfig.KEY`) overrides, in order."""
    keys = []
    for arg in argv:
        match = re.match(r"--?(?:no)?config\.([^=]+)", arg)
        if match:
            keys.append(match.group(1))
    return keys

"""A cache of the greedy responses of a run's starting weights, so `make run` evaluates its base
model once, not on every run.

A run evaluates the weights it starts from on the validation and test splits (927 greedy
generations for the default job, a third of its time on 2 CPU cores). Those weights are the
model folder's files, so the responses are the same every time the same folder is served the same
way. The cache holds the responses (token ids), not the scores: a run scores them itself, with its
current verifier or reward model, so the figure is the one a fresh evaluation gives.

An entry is keyed by a SHA-256 over everything the responses depend on:

- the digest of every file of the model folder (weights, config, generation config, tokenizer),
  so an edited or retrained model never reuses another's responses;
- the split's prompts (their token ids, in order);
- the generation settings (greedy, max tokens) and the generator that produced them (its vLLM
  version, dtype and context length).

Entries live in `$JAXRLHF_CACHE/evaluations/` (default `~/.cache/jaxrlhf`), one JSON file each,
written atomically; delete the folder to forget them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Part of every key: raise it when the meaning of a stored entry changes.
FORMAT = 1
_READ_BYTES = 1 << 22


def default_root() -> Path:
    """Where entries live: the package's cache dir (`JAXRLHF_CACHE`) / evaluations."""
    from jaxrlhf.models.built import cache_dir

    return cache_dir() / "evaluations"


def folder_digest(folder: str | os.PathLike) -> str:
    """SHA-256 over the names and contents of the folder's visible files (sorted by name): any
    change to a weight, the config or the tokenizer changes it."""
    root = Path(folder)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not _hidden(p.relative_to(root)))
    if not files:
        raise FileNotFoundError(f"no model files in {root} to take the digest of")
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as stream:
            while chunk := stream.read(_READ_BYTES):
                digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def _hidden(relative: Path) -> bool:
    """Dot files (markers such as `.complete`) say nothing about the weights."""
    return any(part.startswith(".") for part in relative.parts)


class EvaluationCache:
    """Greedy responses of one model's weights, as one generator serves them.

    `model_digest`: `folder_digest` of the served folder; `generator`: what of the generator
    decides its output (e.g. its status's vllm_version, dtype, max_model_len)."""

    def __init__(self, model_digest: str, generator: dict[str, Any], root: Path | None = None):
        self.model_digest = model_digest
        self.generator = dict(generator)
        self.root = Path(root) if root is not None else default_root()
        self.hits = 0  # entries found by `load`

    def key(self, prompts: Sequence[Sequence[int]], sampling: dict[str, Any]) -> str:
        """The entry's name: a digest of the model, the generator, the prompts and sampling."""
        identity = {
            "format": FORMAT,
            "model": self.model_digest,
            "generator": self.generator,
            "sampling": sampling,
            "prompts": hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest(),
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()

    def _path(self, prompts, sampling) -> Path:
        return self.root / f"{self.key(prompts, sampling)}.json"

    def load(
        self, prompts: Sequence[Sequence[int]], sampling: dict[str, Any]
    ) -> list[tuple[int, ...]] | None:
        """The stored responses (one per prompt, in order), or None when there is no entry (or
        an unreadable or mismatched one, which is then treated as absent)."""
        path = self._path(prompts, sampling)
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        responses = entry.get("responses")
        if not isinstance(responses, list) or len(responses) != len(prompts):
            return None
        self.hits += 1
        return [tuple(int(t) for t in r) for r in responses]

    def store(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: dict[str, Any],
        responses: Sequence[Sequence[int]],
        note: str = "",
    ) -> Path:
        """Writes the entry atomically (a reader sees the whole entry or none); `note` says
        what it is for a person looking in the folder."""
        if len(responses) != len(prompts):
            raise ValueError(f"{len(responses)} responses for {len(prompts)} prompts")
        path = self._path(prompts, sampling)
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {
            "note": note,
            "model": self.model_digest,
            "generator": self.generator,
            "sampling": sampling,
            "responses": [list(r) for r in responses],
        }
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(entry, f)
        os.replace(f.name, path)
        return path

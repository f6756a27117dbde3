"""Where a `config.model.path` (or any model argument) points."""

from __future__ import annotations

from pathlib import Path

from jaxrlhf.models.built import cache_dir

# The test bed's sizes (`jaxrlhf.models.bed.SIZES`, checked equal by its tests).
BED_NAMES = ("bed", "bed-m", "bed-l")


def resolve_model(path: str) -> Path:
    """ "smollm2" = the packaged model (converted once), "tiny" = a tiny random model (256
    positions), "tiny-long" = the same with 1024 positions (long responses in benches), "bed",
    "bed-m", "bed-l" = the test bed's sizes (trained once on the arithmetic task,
    `jaxrlhf.models.bed`), a stage's output dir = its exported `hf_export/`, else a Hugging
    Face folder or hub name."""
    if path in BED_NAMES:
        from jaxrlhf.models.bed import bed_path

        return bed_path(path)
    if path == "smollm2":
        from jaxrlhf.models.smollm2 import smollm2_path

        return smollm2_path()
    if path == "tiny":
        from jaxrlhf.models.tiny import make_tiny_model

        return make_tiny_model(cache_dir() / "models" / "tiny-llama")
    if path == "tiny-long":
        from jaxrlhf.models.tiny import make_tiny_model

        return make_tiny_model(
            cache_dir() / "models" / "tiny-llama-1024", max_position_embeddings=1024
        )
    from jaxrlhf.models.hf_io import resolve_model_path

    exported = Path(path).expanduser() / "hf_export"
    if (exported / "config.json").exists():
        return exported
    return resolve_model_path(path)

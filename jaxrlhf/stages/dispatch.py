"""One stage of a run, started the same way by every command: `run_stage`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax

from jaxrlhf.models.paths import resolve_model
from jaxrlhf.stages import provenance


def run_stage(config, log, afresh: bool = False) -> dict:
    """Runs one stage; returns its summary. Its old summary.json and export go first (and with
    `afresh`, its whole folder), so that a run killed half-way never reads as finished."""
    out = Path(config.output_dir)
    log(f"stage {config.stage}; outputs in {out.resolve()}")
    if jax.process_index() == 0:
        if afresh:
            shutil.rmtree(out, ignore_errors=True)
        provenance.clear_outputs(out)
    model_path = resolve_model(config.model.path)
    if config.stage == "sft":
        from jaxrlhf.stages import sft as stage
    elif config.stage == "reward":
        from jaxrlhf.stages import reward as stage
    else:
        from jaxrlhf.stages import rlhf as stage
    summary = stage.run(config, model_path, log)
    log("summary: " + json.dumps(summary))
    return summary

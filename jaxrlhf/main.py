"""Entry point: `python -m jaxrlhf.main --config=configs/default.py [--config.key=value ...]`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
from absl import app, logging
from ml_collections import config_flags

from jaxrlhf.config import checked, parse_flags
from jaxrlhf.models.paths import resolve_model

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")


def pin_process(cpus: set[int]) -> None:
    """Pins every thread of this process to `cpus`, and so every thread started later.

    `os.sched_setaffinity(0, ...)` pins the calling thread alone: XLA's compute threads, started
    when JAX first ran, kept every core, and a bench's learner "pinned" to core 0 computed on
    the generator's core as well."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except ProcessLookupError:
            pass  # the thread ended meanwhile


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax and JAX log every save at INFO
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config=configs/NAME.py is required")
    checked(config)
    earlier = checkpoint_steps(Path(config.output_dir) / "checkpoints")
    if earlier and not config.resume:
        print(
            f"config error: config.output_dir={config.output_dir} already holds the checkpoints "
            f"of an earlier run (steps {earlier}): add --config.resume=true to continue it, or "
            "pick a new --config.output_dir (or delete that folder) to start afresh",
            file=sys.stderr,
        )
        sys.exit(2)
    if config.distributed.enabled:
        from jaxrlhf.distributed import return_freed_host_memory
        from jaxrlhf.sharding import initialize_distributed

        d = config.distributed
        initialize_distributed(d.coordinator_address, d.num_processes, d.process_id)
        return_freed_host_memory()  # weight publishing keeps host memory to one tensor's

    def log(message: str) -> None:
        if jax.process_index() == 0:  # one process speaks for a multi-process learner
            print(f"[jaxrlhf] {message}", flush=True)

    log(f"stage {config.stage}; outputs in {Path(config.output_dir).resolve()}")
    if config.learner_cpus:
        pin_process({int(c) for c in config.learner_cpus.split(",")})
    model_path = resolve_model(config.model.path)
    if config.stage == "sft":
        from jaxrlhf.stages import sft as stage
    elif config.stage == "reward":
        from jaxrlhf.stages import reward as stage
    else:
        from jaxrlhf.stages import rlhf as stage
    summary = stage.run(config, model_path, log)
    log("summary: " + json.dumps(summary))


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of the complete Orbax checkpoints in `directory` (folders named by their step)."""
    if not directory.is_dir():
        return []
    return sorted(int(child.name) for child in directory.iterdir() if child.name.isdigit())


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

"""Entry point: `python -m jaxrlhf.main --config=configs/default.py [--config.key=value ...]`.

A recipe config without a stage (`--config=configs/nobots.py`) runs the whole recipe
(`jaxrlhf.stages.chain`); with one (`configs/nobots.py:sft`) that stage alone. Before any work,
bad config values and missing models or data (`jaxrlhf.prerequisites`) exit 2 with one line.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from jaxrlhf import prerequisites
from jaxrlhf.config import checked, parse_flags
from jaxrlhf.models.paths import resolve_model
from jaxrlhf.stages.chain import StageRun, is_whole_recipe, recipe_runs

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
    argument = config_flags.get_config_filename(flags.FLAGS["config"])
    runs = stage_runs(config)
    for run in runs:
        checked(run.config)
    to_run = [run for run in runs if not run.finished]
    refuse_earlier_checkpoints(to_run, whole=is_whole_recipe(config))
    check_prerequisites(to_run, prerequisites.recipe_of(config, argument))
    if config.distributed.enabled:
        from jaxrlhf.distributed import return_freed_host_memory
        from jaxrlhf.sharding import initialize_distributed

        d = config.distributed
        initialize_distributed(d.coordinator_address, d.num_processes, d.process_id)
        return_freed_host_memory()  # weight publishing keeps host memory to one tensor's

    def log(message: str) -> None:
        if jax.process_index() == 0:  # one process speaks for a multi-process learner
            print(f"[jaxrlhf] {message}", flush=True)

    if is_whole_recipe(config):
        for line in announce(argument, runs):
            log(line)
    if config.learner_cpus:
        pin_process({int(c) for c in config.learner_cpus.split(",")})
    for run in to_run:
        run_stage(run.config, log)
    if is_whole_recipe(config):
        last = runs[-1].config.output_dir
        log(f"recipe done: the policy is in {last}/hf_export; evaluate it with `python -m "
            f"jaxrlhf.evaluate --config={argument} --checkpoint={last}`")  # fmt: skip


def stage_runs(config) -> list[StageRun]:
    """The stages this command runs: a whole recipe's (`jaxrlhf.stages.chain`), else the one
    its config names (never skipped: an earlier run's folder is refused or resumed)."""
    flag = flags.FLAGS["config"]
    file = config_flags.get_config_filename(flag).split(":", 1)[0]
    overrides = config_flags.get_override_values(flag)
    if config.get("recipe") and "stage" in overrides:  # the paths would be another stage's
        _config_error(f"--config.stage with a recipe: name the stage after the colon, "
                      f"--config={file}:{config.stage}")  # fmt: skip
    if not is_whole_recipe(config):
        return [StageRun(config.stage, config, finished=False)]
    if not config.export:
        _config_error("config.export=false: the stages of a whole recipe start from each "
                      f"other's hf_export/; run one alone (--config={file}:STAGE)")  # fmt: skip
    return recipe_runs(overrides, lambda stage: flag.parser.parse(f"{file}:{stage}"))


def _config_error(message: str) -> None:
    print(f"config error: {message}", file=sys.stderr)
    sys.exit(2)


def check_prerequisites(runs: list[StageRun], recipe) -> None:
    """Exit 2 with one line for each model or dataset the stages of `runs` lack (not the
    folders that one of them makes for a later one), before any of them starts."""
    needs = [need for run in runs for need in prerequisites.stage_needs(run.config)]
    found = prerequisites.problems(needs, [run.config.output_dir for run in runs], recipe)
    if found:
        prerequisites.refuse(found)


def refuse_earlier_checkpoints(runs: list[StageRun], whole: bool) -> None:
    """Exit 2 when a stage would start afresh over the checkpoints of an earlier run."""
    for run in runs:
        config = run.config
        earlier = checkpoint_steps(Path(config.output_dir) / "checkpoints")
        if not earlier or config.resume:
            continue
        if whole:
            again = shlex.join(["python", "-m", "jaxrlhf.main", *sys.argv[1:]])
            message = (
                f"{config.output_dir} (the recipe's {run.stage} stage) holds the checkpoints of "
                f"a run that did not finish (steps {earlier}): continue it with `{again} "
                "--config.resume=true`, or delete that folder to run the stage afresh"
            )
        else:
            message = (
                f"config.output_dir={config.output_dir} already holds the checkpoints of an "
                f"earlier run (steps {earlier}): add --config.resume=true to continue it, or "
                "pick a new --config.output_dir (or delete that folder) to start afresh"
            )
        _config_error(message)


def announce(argument: str, runs: list[StageRun]) -> list[str]:
    """The first lines of a whole recipe: its stages, their folders, which run."""
    lines = [
        f"recipe {argument}: {' -> '.join(run.stage for run in runs)} (a stage whose folder "
        "holds a finished run, summary.json and a whole hf_export/, is skipped)"
    ]
    for run in runs:
        folder = Path(run.config.output_dir).resolve()
        if run.finished:
            status = "finished: skipped"
        elif run.config.resume and checkpoint_steps(folder / "checkpoints"):
            status = "resumes"
        else:
            status = f"runs, from {run.config.model.path}"
        lines.append(f"  {run.stage:<6} {folder}: {status}")
    return lines


def run_stage(config, log) -> dict:
    """Runs one stage; returns its summary."""
    log(f"stage {config.stage}; outputs in {Path(config.output_dir).resolve()}")
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


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of the complete Orbax checkpoints in `directory` (folders named by their step)."""
    if not directory.is_dir():
        return []
    return sorted(int(child.name) for child in directory.iterdir() if child.name.isdigit())


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

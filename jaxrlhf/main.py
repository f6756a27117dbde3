"""Entry point: `python -m jaxrlhf.main --config=configs/default.py [--config.key=value ...]`.

A recipe config without a stage (`--config=configs/nobots.py`) runs the whole recipe
(`jaxrlhf.stages.chain`); with one (`configs/nobots.py:sft`) that stage alone. Before any work,
bad config values, missing models or data (`jaxrlhf.prerequisites`) and stage folders the
command would neither skip nor overwrite exit 2 with one line each.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from jaxrlhf import prerequisites
from jaxrlhf.config import checked, parse_flags
from jaxrlhf.stages.chain import (
    RERUN_KEY,
    RecipeError,
    StageRun,
    checkpoint_steps,
    is_whole_recipe,
    recipe_runs,
    refusals,
)
from jaxrlhf.stages.dispatch import run_stage

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
    to_run = [run for run in runs if run.status in ("runs", "resumes", "reruns")]
    if is_whole_recipe(config):
        refuse(refusals(runs, sys.argv[1:]))
    else:
        refuse_earlier_checkpoints(to_run)
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
        run_stage(run.config, log, afresh=run.status == "reruns")
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
        if config.get("recipe") and config.recipe.get("rerun_from"):
            _config_error(f"--config.{RERUN_KEY} reruns the stages of a whole recipe "
                          f"(--config={file}); one stage alone always runs")  # fmt: skip
        return [StageRun(config.stage, config, status="runs")]
    if not config.export:
        _config_error("config.export=false: the stages of a whole recipe start from each "
                      f"other's hf_export/; run one alone (--config={file}:STAGE)")  # fmt: skip
    try:
        return recipe_runs(overrides, lambda stage: flag.parser.parse(f"{file}:{stage}"),
                           rerun_from=config.recipe.rerun_from)  # fmt: skip
    except RecipeError as error:
        _config_error(str(error))


def _config_error(message: str) -> None:
    print(f"config error: {message}", file=sys.stderr)
    sys.exit(2)


def refuse(lines: list[str]) -> None:
    """Exit 2 with one `config error:` line each, when there are any."""
    for line in lines:
        print(f"config error: {line}", file=sys.stderr)
    if lines:
        sys.exit(2)


def check_prerequisites(runs: list[StageRun], recipe) -> None:
    """Exit 2 with one line for each model or dataset the stages of `runs` lack (not the
    folders that one of them makes for a later one), before any of them starts."""
    needs = [need for run in runs for need in prerequisites.stage_needs(run.config)]
    found = prerequisites.problems(needs, [run.config.output_dir for run in runs], recipe)
    if found:
        prerequisites.refuse(found)


def refuse_earlier_checkpoints(runs: list[StageRun]) -> None:
    """Exit 2 when one stage would start afresh over the checkpoints of an earlier run (a
    whole recipe's stages: `jaxrlhf.stages.chain.refusals`)."""
    for run in runs:
        config = run.config
        earlier = checkpoint_steps(Path(config.output_dir) / "checkpoints")
        if earlier and not config.resume:
            _config_error(
                f"config.output_dir={config.output_dir} already holds the checkpoints of an "
                f"earlier run (steps {earlier}): add --config.resume=true to continue it, or "
                "pick a new --config.output_dir (or delete that folder) to start afresh"
            )


STATUS = {"finished": "finished: skipped", "resumes": "resumes",
          "reruns": "reruns afresh (its folder emptied first)", "refused": "refused"}  # fmt: skip


def announce(argument: str, runs: list[StageRun]) -> list[str]:
    """The first lines of a whole recipe: its stages, their folders, which run, and the
    command line's keys each stage got."""
    lines = [
        f"recipe {argument}: {' -> '.join(run.stage for run in runs)} (a stage is skipped when "
        "its folder holds a finished run made by the same settings and inputs)"
    ]
    for run in runs:
        folder = Path(run.config.output_dir).resolve()
        status = STATUS.get(run.status, f"runs, from {run.config.model.path}")
        lines.append(f"  {run.stage:<6} {folder}: {status}")
        if run.overrides and not run.finished:
            given = ", ".join(f"{key}={value}" for key, value in run.overrides.items())
            lines.append(f"         overrides: {given}")
    return lines


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

"""Experiments that drive several `python -m jaxrlhf.main` runs and compare them.

- `jaxrlhf.experiments.offpolicy`: the paper's off-policyness test bed (final reward, held-out
  accuracy and KL against the number of mini-batches generated with one policy, per loss).
- `bench/async_speedup.py` uses the helpers here too (synchronous vs asynchronous speedup).

Each run is the RLHF stage exactly as a user starts it (a `jaxrlhf.main` subprocess with
`--config.key=value` overrides), so a run's output dir holds the usual `metrics.jsonl`,
`summary.json` and its log; these helpers build the command, run it and read the outputs back
(loose, or packed once committed: `jaxrlhf.experiments.records`).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


# `--model` names with a config file of their own (else configs/default.py, `model.path` set).
OWN_CONFIG = {"tiny": "tiny.py", "bed": "bed.py", "smollm2": "default.py"}
BED_SIZES = ("bed-m", "bed-l")  # configs/bed.py's workload on the test bed's larger sizes


def config_file_for(model: str) -> Path:
    """configs/tiny.py for the tiny random model (its small rollout sizes), configs/bed.py for
    the test bed at any size ("bed", "bed-m", "bed-l"), else the offline default's
    configs/default.py (with `model.path` overridden when `model` is not smollm2)."""
    return CONFIGS / ("bed.py" if model in BED_SIZES else OWN_CONFIG.get(model, "default.py"))


def placement_overrides(model: str, cpus_generator: str, cpus_learner: str) -> dict[str, Any]:
    """The overrides of a bench's `--model` (a folder or a name; "smollm2", "tiny" and "bed" are
    their config files' own) and its cores (`--cpus-generator`, `--cpus-learner`; "" = not
    pinned)."""
    overrides: dict[str, Any] = {}
    if cpus_generator:
        overrides["generator.cpus"] = cpus_generator
    if cpus_learner:
        overrides["learner_cpus"] = cpus_learner
    if model not in OWN_CONFIG:
        overrides["model.path"] = model
    return overrides


def timed_run_overrides(folder: Path, steps: int, evaluate: bool = False) -> dict[str, Any]:
    """The overrides of a run a bench times: `steps` updates into `folder`, weights published
    after every one, a checkpoint only at the end, no export, and no held-out evaluation between
    steps (in an async run the producer would keep generating during it, outside any step's
    time); none before or after training either, unless `evaluate`."""
    overrides: dict[str, Any] = {
        "output_dir": str(folder),
        "sync_every": 1,
        "num_mini_batches": 0,
        "total_steps": steps,
        "checkpoint.every": steps,
        "export": False,
        "eval.every": 0,
    }
    if not evaluate:
        overrides |= {"eval.at_start": False, "eval.at_end": False}
    return overrides


def load_config(config_file: str | Path, overrides: Mapping[str, Any] = ()):
    """The ConfigDict a run gets from `config_file` plus `--config.KEY=VALUE` overrides (dotted
    keys), with the shorthands resolved (`num_mini_batches`)."""
    from jaxrlhf.config import resolve

    spec = importlib.util.spec_from_file_location("_experiment_config", config_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    for key, value in dict(overrides).items():
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[leaf] = _coerce(node[leaf], value)
    return resolve(config)


def _coerce(current: Any, value: Any) -> Any:
    """`value` (possibly command-line text) as the type of the field's `current` value."""
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or isinstance(current, str):
        return value
    if isinstance(current, bool):
        return value.lower() in ("true", "1", "yes")
    return type(current)(ast.literal_eval(value))


def format_override(value: Any) -> str:
    """A value as `--config.key=` parses it: booleans lower-case, sequences as tuples."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(str(v) for v in value) + ")"
    return str(value)


def main_command(config_file: str | Path, overrides: Mapping[str, Any]) -> list[str]:
    """`python -m jaxrlhf.main --config=FILE --config.KEY=VALUE ...`."""
    flags = [f"--config.{key}={format_override(value)}" for key, value in overrides.items()]
    return [sys.executable, "-m", "jaxrlhf.main", f"--config={config_file}", *flags]


CODE_LINE = "# code: "  # the second line of a run's log: the code it ran (`code_version`)


# What "+changes" ignores: the records experiments write and the documents (not code).
NOT_CODE = (":(exclude)results", ":(exclude,glob)**/*.md")


def code_version(repo: Path = REPO) -> str:
    """The repository's commit, abbreviated, with "+changes" when tracked files other than
    results/ and Markdown documents (`NOT_CODE`) differ from it ("unknown" outside a git
    checkout): what an experiment's run ran, since an experiment may span commits (its runs are
    reused until their overrides change, and its own records change as it runs)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                              timeout=60, check=True).stdout.strip()  # fmt: skip

    try:
        commit = git("rev-parse", "--short=7", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_CODE)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+changes" if changed else "")


def run_code(folder: str | Path) -> str | None:
    """The code version `run_main` wrote in the log of the run in `folder`, loose or packed
    (`records`; None: not recorded, or no log)."""
    from jaxrlhf.experiments import records

    log = records.text(folder, "run.log")
    head = [*(log or "").splitlines()[:2], "", ""]
    line = head[1].strip()
    return line[len(CODE_LINE) :] if line.startswith(CODE_LINE) else None


def run_main(command: list[str], log_path: str | Path) -> tuple[int, float]:
    """Runs one `jaxrlhf.main` command from the repository root, its stdout and stderr into
    `log_path` (after the command and the code version); returns (exit code, seconds)."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.write(CODE_LINE + code_version() + "\n")
        log.flush()
        returncode = subprocess.call(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return returncode, time.perf_counter() - started


def log_tail(log_path: str | Path, lines: int = 30) -> str:
    path = Path(log_path)
    if not path.exists():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return parse_jsonl(Path(path).read_text())


def parse_jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def read_run(output_dir: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(metrics.jsonl records sorted by step, summary.json) of a finished run, loose in
    `output_dir` or packed (`records`)."""
    from jaxrlhf.experiments import records

    out = Path(output_dir)
    files = records.files(out)
    for name in ("metrics.jsonl", "summary.json"):
        if name not in files:
            raise FileNotFoundError(f"{out / name} is missing: the run did not finish")
    metrics = sorted(parse_jsonl(files["metrics.jsonl"]), key=lambda r: r["step"])
    return metrics, json.loads(files["summary.json"])


def save_figure(fig, path: str | Path) -> Path:
    """Writes a matplotlib Figure to `path` (its folder made first); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out

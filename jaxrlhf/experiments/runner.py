"""Many `python -m jaxrlhf.main` runs, one after another, against shared generator services.

An experiment plans its runs (`PlannedRun`: the labels that place it in a table, a folder and
its `--config.KEY=VALUE` overrides), and `Runner.run_all` executes them. A run uses the service
the previous run used when both have the same swap setting (`generator.swap_mode`,
`generator.in_flight_kv`); otherwise that one is stopped and one is started in the run's own
(`jaxrlhf.experiments.services.SharedServices`, one at a time: an experiment's model may be
large). Each run that shares saves an engine start; it publishes its initial weights first,
since the service serves the previous run's. A run whose folder holds a finished run with the
same overrides is reused (loose or packed: `jaxrlhf.experiments.records`); a failed run is
recorded and the experiment goes on. A service of the experiment's own that dies during a run
is replaced and the run is run again (at most `MAX_GENERATOR_RESTARTS` times).
Each run's figures (`run_figures`) come from its `metrics.jsonl` and `summary.json`; its log's
second line names the commit it ran (`code_version`), and every experiment prints which commits
its runs ran (`code_summary`), since reused runs may be older than the code.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments import log_tail, main_command, read_run, records, run_code, run_main
from jaxrlhf.experiments.services import SWAP_SETTINGS, SharedServices, parse_generators

SETTINGS_FILE = "experiment.json"  # in each run's folder: the overrides it ran with
# Held-out figures of summary.json: the validation split's (eval_*) and the test split's.
_SUMMARY_KEY = re.compile(r"^(eval|test)_(accuracy|reward)_(start|end)(_stderr)?$")
_EVAL_KEYS = ("eval_accuracy", "test_accuracy", "eval_reward", "test_reward")


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    labels: dict[str, Any]  # e.g. {"loss": "rloo", "num_mini_batches": 4, "seed": 0}
    folder: Path
    overrides: dict[str, Any]  # without the generator address (it changes per experiment)


def run_figures(
    records: Sequence[dict[str, Any]], summary: dict[str, Any], last: int
) -> dict[str, Any]:
    """One finished run's figures: final reward and KL (means over the last `last` steps),
    the held-out figures before and after training (validation: eval_*, test: test_*), the
    evaluations during the run by step, staleness and time."""
    if not records:
        raise ValueError("the run has no metrics records")
    tail = list(records)[-last:]
    figures: dict[str, Any] = {
        "final_reward": sum(r["reward_mean"] for r in tail) / len(tail),
        "staleness_mean": sum(r["staleness_mean"] for r in records) / len(records),
        "staleness_max": max(r["staleness_max"] for r in records),
        "steps_done": len(records),
        "wall_seconds": summary.get("wall_seconds"),
    }
    if all("kl" in r for r in tail):
        figures["final_kl"] = sum(r["kl"] for r in tail) / len(tail)
    figures |= {key: value for key, value in summary.items() if _SUMMARY_KEY.match(key)}
    figures["evals"] = {
        str(r["step"]): {key: r[key] for key in _EVAL_KEYS if key in r}
        for r in records
        if any(key in r for key in _EVAL_KEYS)
    }
    return figures


# Where a run wrote its outputs, not what it ran: the folder is the run's place already, so a
# clone elsewhere (another path, another machine) resumes the records committed under results/.
_PLACE_KEYS = ("output_dir",)


def finished_with(folder: Path, overrides: dict[str, Any]) -> bool:
    """Whether `folder` holds a finished run made with these overrides (`output_dir` aside),
    loose or packed (`records`: committed records resume in any clone)."""
    files = records.files(folder)
    if not ("summary.json" in files and SETTINGS_FILE in files):
        return False
    ran, planned = json.loads(files[SETTINGS_FILE]), json.loads(json.dumps(overrides))
    for key in _PLACE_KEYS:
        ran.pop(key, None), planned.pop(key, None)
    return ran == planned


MAX_GENERATOR_RESTARTS = 3
# Continuous generation as the experiments run it (`rollout.continuous`): in-flight swaps that
# keep the KV cache, so a sample's tail continues on newer weights (unseeded: see
# `jaxrlhf.rl.continuous`).
CONTINUOUS_OVERRIDES = {"rollout.continuous": True, "generator.swap_mode": "in-flight",
                        "generator.in_flight_kv": "keep"}  # fmt: skip


class Runner:
    """Executes planned runs against generator services shared per swap setting (module
    docstring)."""

    def __init__(
        self,
        config_file: Path,
        out: Path,
        name: str,
        generator_addresses: str = "",
        cpus_generator: str = "",
        rerun: bool = False,
        report_only: bool = False,
        keep_checkpoints: bool = False,
    ):
        self.config_file, self.out, self.name = config_file, out, name
        self.services = SharedServices(
            config_file, out, given_generators(generator_addresses), cpus=cpus_generator,
            one_at_a_time=True,
        )  # fmt: skip
        self.rerun, self.report_only = rerun, report_only
        self.keep_checkpoints = keep_checkpoints
        self.generator_restarts = 0
        # Finished runs to run again all the same (e.g. a claim's runs from another start model).
        self.stale: Callable[[PlannedRun], bool] = lambda run: False

    def needs_run(self, run: PlannedRun) -> bool:
        return not self.report_only and (
            self.rerun or not finished_with(run.folder, run.overrides) or self.stale(run)
        )

    def run_all(
        self,
        runs: Sequence[PlannedRun],
        last: int,
        on_progress: Callable[[list[dict[str, Any]]], None] = lambda entries: None,
    ) -> list[dict[str, Any]]:
        """Each run's entry (labels, status, figures), in plan order; `on_progress(entries)`
        after each one (e.g. to write results.json as the experiment goes)."""
        pending = [run for run in runs if self.needs_run(run)]
        entries: list[dict[str, Any]] = []
        started = time.perf_counter()
        try:
            for run in runs:
                returncode = seconds = None
                if run in pending:
                    done = pending.index(run)
                    print(f"[{self.name}] run {done + 1}/{len(pending)}: {run.labels} -> "
                          f"{run.folder}", flush=True)  # fmt: skip
                    returncode, seconds = self._execute(run)
                entry = self.entry(run, last)
                if returncode:
                    entry["status"] = f"failed (exit {returncode}, log {run.folder / 'run.log'})"
                entry["seconds"] = seconds or entry["seconds"]
                entries.append(entry)
                on_progress(entries)
                if returncode is not None:
                    left = (time.perf_counter() - started) / (done + 1) * (len(pending) - done - 1)
                    print(f"[{self.name}] {run.labels}: {entry['status']} in {seconds:.0f} s; "
                          f"about {left / 60:.0f} min left", flush=True)  # fmt: skip
        finally:
            self.close()
        print(f"[{self.name}] code of the runs: {code_summary(entries)}", flush=True)
        return entries

    def entry(self, run: PlannedRun, last: int) -> dict[str, Any]:
        """The run's figures, or the reason there are none."""
        entry: dict[str, Any] = {**run.labels, "output_dir": str(run.folder),
                                 "code": run_code(run.folder)}  # fmt: skip
        try:
            records, summary = read_run(run.folder)
            entry.update(status="ok", **run_figures(records, summary, last))
            entry["seconds"] = summary.get("total_seconds")
        except (FileNotFoundError, ValueError) as error:
            entry.update(status="missing", error=str(error), seconds=None)
        return entry

    def _execute(self, run: PlannedRun) -> tuple[int, float]:
        while True:
            address = self.services.address(run.overrides)
            if run.folder.exists():
                shutil.rmtree(run.folder)
            overrides = {**run.overrides, "generator.addresses": address}
            command = main_command(self.config_file, overrides)
            returncode, seconds = run_main(command, run.folder / "run.log")
            dead = self.services.died(address)
            if returncode == 0 or dead is None:
                break
            print(f"[{self.name}] the generator service died during the run: it is run again "
                  f"on a new one", flush=True)  # fmt: skip
            if self.generator_restarts >= MAX_GENERATOR_RESTARTS:
                sys.exit(f"the generator service exited (restarted {self.generator_restarts} "
                         f"times already):\n{dead.log_tail()}")  # fmt: skip
            print(f"[{self.name}] the generator service exited; starting a new one:\n"
                  f"{dead.log_tail()}", flush=True)  # fmt: skip
            self.generator_restarts += 1
        if returncode == 0:
            (run.folder / SETTINGS_FILE).write_text(json.dumps(run.overrides, indent=2))
        else:
            print(log_tail(run.folder / "run.log"), flush=True)
        if not self.keep_checkpoints:
            shutil.rmtree(run.folder / "checkpoints", ignore_errors=True)
        return returncode, seconds

    def close(self) -> None:
        self.services.close()


def code_summary(entries: Sequence[dict[str, Any]]) -> str:
    """Which code the runs ran, e.g. "82f61e9 (8 runs), 086f9a2+changes (4 runs)", in order of
    first appearance (`code_version`; runs from before it was recorded: "not recorded")."""
    counts: dict[str, int] = {}
    for entry in entries:
        if entry.get("status") != "missing":
            code = entry.get("code") or "not recorded"
            counts[code] = counts.get(code, 0) + 1
    return ", ".join(f"{code} ({n} run{'s' * (n != 1)})" for code, n in counts.items()) or "none"


def given_generators(text: str) -> dict[str, str]:
    """`--generator-addresses`: one HOST:PORT for every run (each run checks that the service
    swaps as its config says), or SETTING=HOST:PORT,... per swap setting (`parse_generators`)."""
    if "=" in text:
        return parse_generators(text)
    return {setting: text for setting in SWAP_SETTINGS} if text.strip() else {}


def runner_from_args(args, name: str) -> tuple[Runner, Path]:
    """The Runner of an experiment's command line (`add_runner_arguments`), and its folder."""
    from jaxrlhf.experiments import config_file_for

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(
        config_file_for(args.model), out, name, args.generator_addresses, args.cpus_generator,
        args.rerun, args.report_only, args.keep_checkpoints,
    )  # fmt: skip
    return runner, out


def add_runner_arguments(parser) -> None:
    """The command-line flags every experiment shares."""
    parser.add_argument(
        "--model", default="smollm2", help="smollm2, tiny, bed, bed-m, bed-l, or a model folder"
    )
    parser.add_argument(
        "--seeds", default="0,1,2", help='config.seed values, one run each: "0,1,2", "0-19"'
    )
    parser.add_argument("--last", type=int, default=5, help="steps averaged for final figures")
    parser.add_argument("--cpus-generator", default="", help='e.g. "1" (default: not pinned)')
    parser.add_argument("--cpus-learner", default="", help='e.g. "0" (default: not pinned)')
    parser.add_argument(
        "--generator-addresses", default="",
        help="use running services instead of starting them: HOST:PORT for every run, or "
             "SETTING=HOST:PORT,... per swap setting (drain, in-flight-keep, in-flight-recompute)",
    )  # fmt: skip
    parser.add_argument("--rerun", action="store_true", help="rerun runs already finished")
    parser.add_argument("--keep-checkpoints", action="store_true")
    parser.add_argument(
        "--report-only", action="store_true", help="only read the runs already in --out"
    )


def parse_experiment_args(parser, argv: Sequence[str] | None):
    """An experiment's command line with the runner's flags (`add_runner_arguments`): seeds as
    a list, `--config.KEY=VALUE` pass-throughs in `args.passthrough`, and `--vary` (when the
    parser has it) as (KEY, values) (`parse_vary`)."""
    add_runner_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    args.passthrough = parse_passthrough(parser, extra)
    args.seeds = parse_seeds(args.seeds)
    if hasattr(args, "vary"):
        try:
            args.vary = parse_vary(args.vary)
        except ValueError as error:
            parser.error(str(error))
    return args


def parse_vary(text: str) -> tuple[str, list[str]]:
    """ "KEY=V1,V2" -> (KEY, [V1, V2]); "" -> ("", [""]) (one variant: the config as is)."""
    if not text:
        return "", [""]
    key, _, values = text.partition("=")
    if not key or not values:
        raise ValueError(f"--vary {text!r}: expected KEY=V1,V2,... (e.g. train.learning_rate=3e-6)")
    return key, [v.strip() for v in values.split(",") if v.strip()]


def variant_label(key: str, value: str) -> str:
    return f"{key}={value}" if key else "default"


def parse_passthrough(parser, extra: Sequence[str]) -> dict[str, str]:
    """`--config.KEY=VALUE` arguments passed to every run; anything else is an error."""
    unknown = [a for a in extra if not a.startswith("--config.") or "=" not in a]
    if unknown:
        parser.error(f"unknown arguments {unknown} (only --config.KEY=VALUE pass through)")
    return dict(a.removeprefix("--config.").split("=", 1) for a in extra)


def parse_seeds(text: str) -> list[int]:
    """ "0-9" or "0,1,5" or a mix ("0-4,9")."""
    seeds: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if "-" in part:
            low, high = (int(x) for x in part.split("-"))
            seeds.update(range(low, high + 1))
        elif part:
            seeds.add(int(part))
    return sorted(seeds)


def common_overrides(args, output_dir: Path, steps: int) -> dict[str, Any]:
    """Overrides every experiment run gets: its folder, length, checkpoints only at the end,
    no export, the model and the learner's cores."""
    overrides: dict[str, Any] = {
        "output_dir": str(output_dir),
        "total_steps": steps,
        "checkpoint.every": steps,
        "export": False,
    }
    if args.cpus_learner:
        overrides["learner_cpus"] = args.cpus_learner
    from jaxrlhf.experiments import OWN_CONFIG

    if args.model not in OWN_CONFIG:
        overrides["model.path"] = args.model
    return overrides

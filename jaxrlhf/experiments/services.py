"""Generator services shared by a bench's runs, one per engine setting.

A bench that compares modes (`bench/pipeline_modes.py`, `bench/swap_modes.py`) runs
`python -m jaxrlhf.main` once per mode and repeat. Runs whose engines would be started alike
(same model, same `python -m generator_service` options: the swap setting, capacity, length,
dtype, seed) share one service, started by the first of them and pinned to its
`generator.cpus`; each run publishes its initial weights before generating, so it never samples
from the previous run's policy. That saves an engine start (~25 s of CPU here) per run. One
service runs at a time: a run in another setting stops the running one first (two SmolLM2
engines beside the learner did not fit 24 GB), so a setting's service can be started again
when the order of the modes comes back to it.

`--generators drain=HOST:PORT,in-flight-keep=HOST:PORT` (`parse_generators`) points the runs of a
swap setting at a running service instead. The run checks at start that the service swaps as
its config says, and refuses with a message naming both otherwise.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxrlhf.experiments import load_config, log_tail, main_command, run_main

# A swap setting's name -> (generator.swap_mode, generator.in_flight_kv).
SWAP_SETTINGS = {
    "drain": ("drain", "keep"),
    "in-flight-keep": ("in-flight", "keep"),
    "in-flight-recompute": ("in-flight", "recompute"),
}


def swap_setting(gen) -> str:
    """The name of a config's `generator` swap setting (in_flight_kv only counts in flight),
    with "-no-preload" when its swaps are not preloaded (`generator.preload`; never one of
    `SWAP_SETTINGS`, so such a run always gets a service of its own); "lora" for a server of
    LoRA adapters (`--max-lora-rank`: never given either)."""
    if gen.swap_mode == "lora":
        return "lora"
    name = "drain" if gen.swap_mode == "drain" else f"in-flight-{gen.in_flight_kv}"
    return name + ("" if gen.preload else "-no-preload")


def parse_generators(text: str) -> dict[str, str]:
    """`drain=HOST:PORT,in-flight-keep=HOST:PORT` -> {setting: address}; ValueError naming the
    part that is not SETTING=HOST:PORT with a known setting."""
    given: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        setting, _, address = part.partition("=")
        if setting not in SWAP_SETTINGS or ":" not in address:
            raise ValueError(
                f"--generators: {part!r} is not SETTING=HOST:PORT with SETTING one of "
                f"{', '.join(SWAP_SETTINGS)}"
            )
        given[setting] = address
    return given


class SharedServices:
    """The address a run's `generator.addresses` should be (module docstring)."""

    def __init__(
        self,
        config_file: Path,
        out: Path,
        given: dict[str, str] | None = None,
        cpus: str | None = None,
        one_at_a_time: bool = False,
    ):
        self.config_file, self.out = config_file, out
        self.given = dict(given or {})
        self.cpus = cpus  # the services' cores, in place of the runs' generator.cpus
        # Stop the running service before starting one with other options: one engine's memory
        # (on a GPU, two engines that each take most of its memory cannot both start).
        self.one_at_a_time = one_at_a_time
        self.started: dict[tuple, Any] = {}  # (model, engine options) -> ServerProcess
        self.starts = 0

    def address(self, overrides: dict[str, Any]) -> str:
        from jaxrlhf.fleet.service import engine_args, start_server
        from jaxrlhf.models.paths import resolve_model

        config = load_config(self.config_file, overrides)
        gen = config.generator
        setting = swap_setting(gen)
        if setting in self.given:
            return self.given[setting]
        model, options = resolve_model(config.model.path), engine_args(gen, config.model.lora.rank)
        key = (str(model), tuple(options))
        server = self.started.get(key)
        if server is None or server.process.poll() is not None:  # first use, or it died
            if self.one_at_a_time:
                self.close()
            log = self.out / f"generator-{setting}-{self.starts}.log"
            self.starts += 1
            print(f"starting a generator service ({setting}; log: {log})", flush=True)
            cores = gen.cpus if self.cpus is None else self.cpus
            cpus = [int(c) for c in cores.split(",")] if cores else None
            server = self.started[key] = start_server(model, log, options, cpus=cpus)
        return server.address

    def died(self, address: str) -> Any:
        """The started service at `address` if it has exited (its log tells why), else None."""
        for server in self.started.values():
            if server.address == address and server.process.poll() is not None:
                return server
        return None

    def close(self) -> None:
        for server in self.started.values():
            server.terminate()
        self.started.clear()

    def __enter__(self) -> SharedServices:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_side_by_side(
    name: str,
    labels: Sequence[str],
    repeats: int,
    out: Path,
    config_file: Path,
    given: dict[str, str],
    overrides_for: Callable[[str, Path], dict[str, Any]],
    figures_of: Callable[[Path], dict[str, float]],
    analyze_only: bool = False,
) -> dict[str, list[dict[str, float]]]:
    """Runs `python -m jaxrlhf.main` once per label and repeat, in `{out}/{label}-{repeat}`
    (emptied first), the labels' order rotating from one repeat to the next, against services
    shared per swap setting, one at a time (`SharedServices`); returns each label's figures
    per repeat (`figures_of(folder)`). Exits naming the run and its log's tail when one fails. With
    `analyze_only`, reads the runs already there."""
    per_run: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    with SharedServices(config_file, out, given, one_at_a_time=True) as services:
        for repeat in range(repeats):
            shift = repeat % len(labels)
            for label in [*labels[shift:], *labels[:shift]]:
                folder = out / f"{label}-{repeat}"
                log = folder / "run.log"
                if not analyze_only:
                    shutil.rmtree(folder, ignore_errors=True)
                    overrides = overrides_for(label, folder)
                    overrides["generator.addresses"] = services.address(overrides)
                    print(f"[{name}] {label} run {repeat + 1}/{repeats}, log: {log}", flush=True)
                    returncode, _ = run_main(main_command(config_file, overrides), log)
                    if returncode != 0:
                        sys.exit(f"the {label} run failed ({returncode}):\n{log_tail(log)}")
                per_run[label].append(figures_of(folder))
    return per_run

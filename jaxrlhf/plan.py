"""A memory plan for a config, without a GPU and without a download.

    python -m jaxrlhf.plan --config=configs/nobots.py [--devices 8] [--device-memory-gib 80]
    python -m jaxrlhf.plan --config=configs/tldr.py:sft

The config's stage is built from abstract shapes on a mesh of `--devices` fake CPU devices
(default: the hardware the config names, `config.hardware`): no weight is loaded and nothing is
downloaded (the architectures of the paper's models are known offline,
`jaxrlhf.models.known`). The real jitted programs of the stage are lowered and compiled for that
mesh — the train step (micro-batches, chunked log-probs, mixed precision and all) and, for RLHF,
the reference log-prob forward and the reward model's scoring — and XLA's memory analysis of
each gives its per-device arguments, outputs and temporaries. Printed per device:

- parameters, optimizer state and frozen models (reference, reward model; a LoRA run's base,
  which is its reference too): the sizes of their shards on the mesh; gradients and
  activations live in XLA's temporaries of the train step (a LoRA run trains its adapters
  alone: they are its parameters, and its optimizer state and gradients are theirs);
- beside them, an analytic estimate (FSDP over all devices: parameters, two Adam moments and
  float32 gradients of the trained models; a micro-batch's remat checkpoints, one layer's
  working set and one chunk of logits);
- the peak: the largest program's arguments + outputs + temporaries (minus what it updates in
  place), plus whatever else stays resident meanwhile (the frozen models, or the train state
  while the reference runs); it fits when the peak is at most the device memory.

The last line is one JSON object: devices, device_memory_bytes, per_device_bytes (with total),
analytic_bytes, programs, fits. XLA:CPU's compiler lays memory out as GPU compilers do in
spirit, not byte for byte: treat the figures as a plan, to be checked on the hardware.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from absl import app, flags
from ml_collections import config_flags

from jaxrlhf.stage_programs import GIB, stage_programs


def analytic_bytes(config, shapes: dict[str, Any], devices: int) -> dict[str, int]:
    """The estimate of the module docstring, per device, FSDP over all devices."""
    import numpy as np

    from jaxrlhf.models.known import architecture_of  # noqa: F401 (shapes hold the models)

    def count(model) -> int:
        import flax.linen as nn
        import jax

        from jaxrlhf.models import abstract_params

        return sum(
            math.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(abstract_params(model)))
        )

    def adapters(model) -> int:  # a LoRA policy trains its factors alone
        from jaxrlhf.models import lora

        return count(model) - count(lora.base_model(model)) if model.config.lora_rank else 0

    param_bytes = np.dtype(config.model.param_dtype).itemsize
    compute_bytes = np.dtype(config.model.dtype).itemsize
    trained = sum(adapters(m) or count(m) for m in shapes["trained"])
    frozen = sum(count(m) for m in shapes["frozen"])
    policy = shapes["trained"][0].config
    rows = max(1, shapes["rows"] // devices)  # one micro-batch's rows on one device
    tokens = rows * shapes["length"]
    chunk = config.model.logprob_chunk or shapes["length"]
    layers = policy.num_layers
    checkpoints = tokens * policy.hidden_size * compute_bytes * (layers if config.model.remat else
                                                                 layers * 16)  # fmt: skip
    layer_work = tokens * (4 * policy.hidden_size + 3 * policy.intermediate_size) * 4
    attention = rows * policy.num_heads * shapes["length"] ** 2 * 4 * 2
    logits = rows * min(chunk, shapes["length"]) * policy.vocab_size * 4 * 3
    return {
        "parameters": trained * param_bytes // devices,
        "optimizer_state": 2 * trained * 4 // devices,
        "gradients": trained * 4 // devices,
        "frozen_models": frozen * compute_bytes // devices,
        "activations": checkpoints + layer_work + attention + logits,
    }


def plan(config, devices: int, device_memory_bytes: int) -> dict[str, Any]:
    """The plan of the module docstring, as the JSON-able dict the CLI prints last."""
    import jax

    from jaxrlhf.sharding import make_mesh

    mesh = make_mesh(tuple(config.mesh.shape), jax.devices()[:devices])
    stage, sizes, shapes = stage_programs(config, mesh)
    programs = [program.memory() for program in stage]
    train = programs[0]
    peak = max(programs, key=lambda p: p.peak_bytes)
    per_device = {
        **sizes,
        # Gradients, activations and every other temporary of the train step, as XLA lays
        # them out.
        "train_step_temporaries": train.temp_bytes,
        "total": peak.peak_bytes,
    }
    estimate = analytic_bytes(config, shapes, devices)
    estimate["total"] = sum(estimate.values())
    return {
        "config_stage": config.stage,
        "devices": devices,
        "mesh": dict(mesh.shape),
        "device_memory_bytes": device_memory_bytes,
        "micro_batches": shapes["micro_batches"],
        "per_device_bytes": per_device,
        "analytic_bytes": estimate,
        "peak_program": peak.name,
        "programs": {
            p.name: dataclasses.asdict(p) | {"peak_bytes": p.peak_bytes} for p in programs
        },  # fmt: skip
        "fits": per_device["total"] <= device_memory_bytes,
    }


def report_lines(result: dict[str, Any]) -> list[str]:
    def gib(value: int) -> str:
        return f"{value / GIB:8.2f} GiB"

    xla, estimate = result["per_device_bytes"], result["analytic_bytes"]
    lines = [f"stage {result['config_stage']} on {result['devices']} devices {result['mesh']}, "
             f"{result['micro_batches']} micro-batch(es) per update; per device:",
             f"  {'':28}{'XLA':>12}{'analytic':>14}"]  # fmt: skip
    for key, label in (("parameters", "parameters"), ("optimizer_state", "optimizer state"),
                       ("frozen_models", "frozen models")):  # fmt: skip
        lines.append(f"  {label:28}{gib(xla[key])}  {gib(estimate[key])}")
    lines.append(f"  {'gradients + activations':28}{gib(xla['train_step_temporaries'])}  "
                 f"{gib(estimate['gradients'] + estimate['activations'])}"
                 f"   (XLA: the train step's temporaries)")  # fmt: skip
    for name, program in result["programs"].items():
        lines.append(f"  program {name:20}{gib(program['peak_bytes'])}   (arguments "
                     f"{program['argument_bytes'] / GIB:.2f}, temporaries "
                     f"{program['temp_bytes'] / GIB:.2f}, resident besides "
                     f"{program['resident_bytes'] / GIB:.2f} GiB)")  # fmt: skip
    memory = result["device_memory_bytes"]
    verdict = "fits" if result["fits"] else "does NOT fit"
    lines.append(f"  {'peak (' + result['peak_program'] + ')':28}{gib(xla['total'])}  "
                 f"{gib(estimate['total'])}   of {memory / GIB:.0f} GiB: {verdict}")  # fmt: skip
    return lines


def main() -> None:
    """The command line (flags defined here, not at import: `jaxrlhf.evaluate` and
    `jaxrlhf.main` define `--config` too, and a process may import them all)."""
    config_flag = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")
    devices_flag = flags.DEFINE_integer("devices", 0, "Fake devices (0: config.hardware.devices).")
    memory_flag = flags.DEFINE_float(
        "device_memory_gib", 0.0, "GiB per device (0: config.hardware.device_memory_gib)."
    )

    def run(argv) -> None:
        del argv
        config = config_flag.value
        if config is None:
            raise app.UsageError("--config=configs/NAME.py is required")
        checked(config)
        found = plan_problems(config)
        if found:
            refuse(found)
        devices = devices_flag.value or config.hardware.devices
        memory_gib = memory_flag.value or config.hardware.device_memory_gib
        import jax

        # Before the first use of a backend: fake CPU devices stand in for the accelerators.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", devices)
        result = plan(config, devices, int(memory_gib * GIB))
        print("\n".join(report_lines(result)))
        print(json.dumps(result), flush=True)

    from jaxrlhf.config import checked, parse_flags
    from jaxrlhf.prerequisites import plan_problems, refuse

    app.run(run, flags_parser=parse_flags)


if __name__ == "__main__":
    main()

"""A config's learner programs run for real, their measured device memory beside the plan's.

    python bench/plan_check.py --config=configs/tldr.py --steps 3     # one GPU: Pythia 1B
    python bench/plan_check.py --config=configs/tiny.py --steps 1     # smoke run on the CPU

1. The plan: `python -m jaxrlhf.plan` (a subprocess, on fake CPU devices) for the same config
   and device count gives its per-device peak and the peak program.
2. The run, on this machine's devices: the stage's programs exactly as the plan builds them
   (`jaxrlhf.stage_programs.stage_programs`: the train step with the config's micro-batches, chunked
   log-probs and mixed precision; for RLHF the reference forward and the reward model's
   scoring), on random weights of the config's architectures (nothing is downloaded) and a
   synthetic batch of the config's full shapes: `--steps` train steps, then each forward once.
   The device's `peak_bytes_in_use` (`jax.Device.memory_stats`, accelerators only) is the
   measured peak.

Prints one JSON line: the plan's total and peak program, the measured peak, their ratio, and
the median train-step time. The GPU figure goes in BENCHMARKS.md beside the plan's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def load_stage_config(spec: str):
    """`configs/x.py[:stage]` -> its ConfigDict (as `--config=` would give it)."""
    from jaxrlhf.config import resolve, validate

    path, _, stage = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_plan_check_config", REPO / path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.get_config(stage) if stage else module.get_config()
    validate(resolve(config))
    return config


def planned(spec: str, devices: int, memory_gib: float) -> dict:
    command = [sys.executable, "-m", "jaxrlhf.plan", f"--config={spec}", f"--devices={devices}"]
    if memory_gib:
        command.append(f"--device_memory_gib={memory_gib}")
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200)
    if result.returncode != 0:
        sys.exit(f"the plan failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def materialize(tree, seed: int = 0, ones=(), random: bool = True):
    """Concrete arrays for a tree of sharded ShapeDtypeStructs, each created on its shards:
    leaves whose path names one of `ones` (masks, valid flags) 1, other floats ~ N(0, 0.02²)
    (0 when not `random`: Adam's moments start at 0), the rest (token ids) 0."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), max(len(leaves), 1))
    out = []
    for key, (path, leaf) in zip(keys, leaves, strict=False):
        name = jax.tree_util.keystr(path)
        if any(word in name for word in ones):
            make = lambda leaf=leaf: jnp.ones(leaf.shape, leaf.dtype)  # noqa: E731
        elif random and jnp.issubdtype(leaf.dtype, jnp.floating):
            make = lambda key=key, leaf=leaf: (  # noqa: E731
                jax.random.normal(key, leaf.shape, jnp.float32) * 0.02
            ).astype(leaf.dtype)
        else:
            make = lambda leaf=leaf: jnp.zeros(leaf.shape, leaf.dtype)  # noqa: E731
        out.append(jax.jit(make, out_shardings=leaf.sharding)())
    return jax.tree.unflatten(treedef, out)


BATCH_ONES = ("mask", "valid")  # a batch of real tokens everywhere, every pair valid


def peak_bytes(devices) -> int | None:
    stats = [device.memory_stats() for device in devices]
    if any(s is None or "peak_bytes_in_use" not in s for s in stats):
        return None  # the CPU backend keeps no such statistics
    return max(s["peak_bytes_in_use"] for s in stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="configs/x.py[:stage]")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=0, help="0 = config.hardware.devices")
    parser.add_argument("--device-memory-gib", type=float, default=0.0)
    args = parser.parse_args()
    import jax

    from jaxrlhf.sharding import make_mesh
    from jaxrlhf.stage_programs import stage_programs

    config = load_stage_config(args.config)
    devices = min(args.devices or config.hardware.devices, len(jax.devices()))
    plan = planned(args.config, devices, args.device_memory_gib)
    mesh = make_mesh(tuple(config.mesh.shape), jax.devices()[:devices])
    programs, _, _ = stage_programs(config, mesh)
    train, forwards = programs[0], programs[1:]
    state = train.args[0]
    state = state.replace(params=materialize(state.params),
                          opt_state=materialize(state.opt_state, random=False),
                          step=materialize(state.step))  # fmt: skip
    batch = materialize(train.args[1], 1, BATCH_ONES)
    started = time.perf_counter()
    state, metrics = train.jitted(state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - started
    step_times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        state, metrics = train.jitted(state, batch)
        jax.block_until_ready(metrics)
        step_times.append(time.perf_counter() - started)
    for program in forwards:  # (params, input_ids, attention_mask)
        params, ids, mask = program.args
        arrays = materialize(params, 2), materialize(ids), materialize(mask, ones=("",))
        jax.block_until_ready(program.jitted(*arrays))
    measured = peak_bytes(jax.devices()[:devices])
    total = plan["per_device_bytes"]["total"]
    result = {
        "config": args.config,
        "device": f"{devices}x {jax.devices()[0].device_kind}",
        "micro_batches": plan["micro_batches"],
        "plan_peak_bytes": total,
        "plan_peak_program": plan["peak_program"],
        "plan_fits": plan["fits"],
        "measured_peak_bytes": measured,
        "measured_over_plan": None if measured is None else round(measured / total, 3),
        "compile_and_first_step_s": round(compile_s, 2),
        "step_s_median": round(statistics.median(step_times), 4) if step_times else None,
        "loss_finite": bool(jax.numpy.isfinite(metrics["loss"])),
        "programs_run": [p.name for p in programs],
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

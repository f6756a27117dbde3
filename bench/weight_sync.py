"""Weight sync: JAX arrays -> generator service -> "swap done", by both transports, next to an
in-process vLLM `reload_weights` of the same tensors, measured side by side in one run.

    python bench/weight_sync.py                 # SmolLM2-135M, fp32 and bf16, preloaded and not
    python bench/weight_sync.py --dtypes bfloat16 --repeats 9 --preload on

End to end = converting the (sharded) Flax params to the HF layout tensor by tensor, getting them
to the service, validating, and swapping them in: vLLM's `reload_weights` on views of a mapped
file, plus the repack of the tied lm_head (which a plain reload leaves stale). Two transports,
alternating update by update on one server:

- stream: 4 MiB chunks over loopback gRPC (conversion in a thread, overlapped with the sending),
  written into the service's update file in /dev/shm as they arrive; works across hosts.
- shared: the learner converts straight into a file in the service's shared folder (/dev/shm)
  and sends only where each tensor lies (`UpdateWeightsShared`); same host only.

In-process = `LLM.collective_rpc("reload_weights", weights_iterator=...)` on the same tensors
already in memory (the paper's in-process copy, without conversion or that repack). `convert_s`
is the conversion alone (iterating `iter_hf_tensors` and making each tensor contiguous, the
one copy every consumer makes); `{transport}_pause_s` is the part of the update during which the
service paused generation (reload, tied-head repack, prefix-cache reset), `{transport}_preload_s`
the part before it, while generation could go on (receiving and checking the update), and
`{transport}_pause_over_in_process` the pause ÷ the in-process reload. `{transport}_cpu_s` is the
CPU time one update takes, all threads of the learner's side (this process) and of the service's
processes together; ÷ the `cores` this process may run on, it is the least wall time the update
could take on them however well its parts overlapped, and `{transport}_cpu_floor_over_in_process`
that floor ÷ the in-process reload (when it is over 1.5, end to end <= 1.5 cannot be met on
these cores).

Two services per dtype, one after the other: `preload: true` preloads each update (converts it into
the engine's layout in a thread of the worker while generation could go on, then pauses only to
copy it in: generator_service/updates/worker_preload.py), `preload: false` (`--no-preload`) loads it
in the pause.
With preloading, `{transport}_preload_s` also holds the preloading and the pause is the commit; its
`{transport}_over_in_process` ratios are the targets (pause <= 0.25, end to end <= 1.5). Prints
one JSON line per dtype and mode: medians over the repeats, and the fastest repeat of each, after
`--warmup` updates by each transport (and as many in-process reloads) that are not measured: a
service's first updates are its slowest (its files and buffers are new; a preloading worker's
allocator reaches the steady state where each preload reuses the memory the one before freed after
a few updates).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np


@contextmanager
def engine_in_this_process():
    """vLLM's engine core and worker in this process while inside, so that `collective_rpc` hands
    the worker the tensors themselves, not pickled copies. Scoped: the generator services started
    by this script (child processes) must keep vLLM's default, as in a real run."""
    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    previous = os.environ.get(key)
    os.environ[key] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[key]
        else:
            os.environ[key] = previous


def in_process_reload_seconds(
    model_dir: Path, dtype: str, tensors, repeats: int, warmup: int
) -> list[float]:
    import torch
    from vllm import LLM

    torch_tensors = [(name, torch.from_numpy(array.astype("float32"))) for name, array in tensors]
    if dtype == "bfloat16":
        torch_tensors = [(n, t.to(torch.bfloat16)) for n, t in torch_tensors]
    times = []
    with engine_in_this_process():
        llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=True, max_model_len=256,
                  gpu_memory_utilization=0.3)  # fmt: skip
        for repeat in range(warmup + repeats):
            start = time.perf_counter()
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(torch_tensors)})
            if repeat >= warmup:
                times.append(time.perf_counter() - start)
        del llm
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--warmup", type=int, default=3,
        help="updates by each transport (and in-process reloads) before those measured",
    )  # fmt: skip
    parser.add_argument(
        "--preload", default="on,off",
        help="services to measure: preloaded (on), reloading in the pause (off), or both",
    )  # fmt: skip
    parser.add_argument(
        "--address", default="",
        help="a running service of --model in the one dtype of --dtypes, instead of starting "
             "one (the versions sent follow the one it serves)",
    )  # fmt: skip
    parser.add_argument(
        "--service-pid", type=int, default=0,
        help="with --address: the service's process, for the CPU time of its side",
    )  # fmt: skip
    args = parser.parse_args()
    if args.address and "," in args.dtypes:
        parser.error("--address serves one dtype: give one in --dtypes")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from jaxrlhf.models import hf_tensor_specs, iter_hf_tensors, load_pretrained

    model_dir = Path(args.model)
    if args.model == "smollm2":
        from jaxrlhf.models.smollm2 import smollm2_path

        model_dir = smollm2_path()
    model, params = load_pretrained(model_dir)
    for dtype in args.dtypes.split(","):
        specs = hf_tensor_specs(model, params, dtype)
        num_bytes = sum(math.prod(shape) * dt.itemsize for _, shape, dt in specs)
        convert_times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _name, array in iter_hf_tensors(model, params, dtype):
                np.ascontiguousarray(array)  # the one copy every consumer makes
            convert_times.append(time.perf_counter() - start)
        tensors = list(iter_hf_tensors(model, params, "float32"))
        reload_times = in_process_reload_seconds(
            model_dir, dtype, tensors, args.repeats, args.warmup
        )
        modes = [None] if args.address else args.preload.split(",")
        for mode in modes:
            row = measure_service(args, model, params, model_dir, dtype, specs, mode)
            row.update(model=args.model, dtype=dtype, tensors=len(specs), bytes=num_bytes,
                       convert_s=round(statistics.median(convert_times), 3))  # fmt: skip
            print(json.dumps(summarize(row, reload_times, num_bytes)), flush=True)


def measure_service(args, model, params, model_dir, dtype, specs, mode) -> dict:
    """Publishes `args.repeats` updates by each transport, alternating, to `args.address` or to a
    service started here (`mode` "on": preloaded, "off": --no-preload); their seconds."""
    from jaxrlhf.fleet.pool import GeneratorPool
    from jaxrlhf.fleet.service import start_server
    from jaxrlhf.models import iter_hf_tensors

    server, address = None, args.address
    if not address:
        log = Path(tempfile.mkdtemp()) / "generator.log"
        preload = {"on": "--preload", "off": "--no-preload"}[mode]
        server = start_server(model_dir, log, ["--dtype", dtype, "--max-model-len", "256", preload])
        address = server.address
    pools = {t: GeneratorPool([address], transport=t) for t in ("stream", "shared")}
    times: dict[str, list[float]] = {t: [] for t in pools}
    pauses: dict[str, list[float]] = {t: [] for t in pools}
    preloads: dict[str, list[float]] = {t: [] for t in pools}
    cpus: dict[str, list[float]] = {t: [] for t in pools}
    service = server.process.pid if server is not None else (args.service_pid or None)
    try:
        (status,) = pools["stream"].wait_until_serving()
        if status.dtype != dtype or Path(status.model).resolve() != model_dir.resolve():
            raise SystemExit(f"{address} serves {status.model} in {status.dtype}, not "
                             f"{model_dir} in {dtype}")  # fmt: skip
        version = status.policy_version
        preloaded = status.preloaded_swaps
        for repeat in range(args.warmup + args.repeats):
            for transport, pool in pools.items():
                version += 1
                cpu = cpu_seconds(service)
                stats = pool.publish_weights(
                    lambda d=dtype: iter_hf_tensors(model, params, d), len(specs), version,
                    specs=specs,
                )  # fmt: skip
                cpu = cpu_seconds(service) - cpu
                if repeat < args.warmup:
                    continue
                times[transport].append(stats.seconds)
                pauses[transport].append(stats.pause_seconds)
                preloads[transport].append(stats.preload_seconds)
                if service is not None:  # (a service not started here: its CPU is unknown)
                    cpus[transport].append(cpu)
    finally:
        for pool in pools.values():
            pool.close()
        if server is not None:
            server.terminate()
    return {
        "preload": preloaded,
        "times": times,
        "pauses": pauses,
        "preloads": preloads,
        "cpus": cpus,
    }


def cpu_seconds(service_pid: int | None) -> float:
    """CPU seconds so far of this process (the learner's side: converting, writing, sending)
    and of the service's processes (its server, engine and worker), all threads."""
    import psutil

    total = time.process_time()
    if service_pid is not None:
        root = psutil.Process(service_pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
    return total


def summarize(measured: dict, reload_times: list[float], num_bytes: int) -> dict:
    """One JSON row: the medians and ratios described in the module docstring."""
    reload_s = statistics.median(reload_times)
    times, pauses, preloads, cpus = (
        measured.pop(k) for k in ("times", "pauses", "preloads", "cpus")
    )  # fmt: skip
    cores = len(os.sched_getaffinity(0))
    row = {**measured, "in_process_reload_s": round(reload_s, 3),
           "in_process_reload_min_s": round(min(reload_times), 3), "cores": cores}  # fmt: skip
    for transport, seconds in times.items():
        median = statistics.median(seconds)
        row[f"{transport}_s"] = round(median, 3)
        row[f"{transport}_min_s"] = round(min(seconds), 3)
        row[f"{transport}_gb_per_s"] = round(num_bytes / median / 1e9, 3)
        row[f"{transport}_ratio_over_in_process"] = round(median / reload_s, 2)
        row[f"{transport}_pause_s"] = round(statistics.median(pauses[transport]), 3)
        row[f"{transport}_preload_s"] = round(statistics.median(preloads[transport]), 3)
        if cpus[transport]:
            cpu = statistics.median(cpus[transport])
            row[f"{transport}_cpu_s"] = round(cpu, 3)
            row[f"{transport}_cpu_floor_over_in_process"] = round(cpu / cores / reload_s, 2)
        row[f"{transport}_pause_over_in_process"] = round(
            statistics.median(pauses[transport]) / reload_s, 3
        )
    return row


if __name__ == "__main__":
    main()

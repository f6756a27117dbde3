"""Host memory of each learner process while a multi-process learner publishes its weights.

    python bench/publish_memory.py             # 2 processes x 2 CPU devices, a 540 MB model
    python bench/publish_memory.py --address HOST:PORT --model PATH   # a running generator

The learner is N `jax.distributed` processes (gloo) with one mesh over all their devices, the
model's parameters sharded over it (FSDP). Publishing goes as in the RLHF loop
(`jaxrlhf.rl.publisher.publish`): every process gathers one HF tensor at a time (collectives),
the driver streams each to a real generator service in 4 MiB chunks (`transport="stream"`), and
the service swaps the new version in. Each process samples its resident set size (VmRSS) every
2 ms during the publish; its baseline is the RSS just before (its own shards are in it: fake CPU
devices keep them in host memory), taken after `malloc_trim` returned freed heap to the system.
Reported per process: the peak increase over the baseline,
beside the largest single tensor, one decoder layer (all its tensors) and the whole model. The
bound to hold on this CPU emulation: each process's own shards plus `--max-increase-layers`
decoder layers (1.5: the gathered tensor's copies and XLA:CPU's collective buffers are host
memory here, and the driver holds the transport's chunk queue), far under the model; the bench
exits 1, naming each process over it, when one is. `--publishes` updates are made and the last
one is reported:
the first also compiles each gather program (once per tensor shape), as the first update of a
run does. The shared-memory transport is left out on purpose: its file in
/dev/shm is the generator's staging copy of the whole model by design.

Prints one JSON line per process, then a summary JSON line (printed whether or not the bound
holds).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class PeakSampler:
    """Samples VmRSS in a thread until stopped; `peak` is the largest sample."""

    def __init__(self, interval: float = 0.002):
        self.interval, self.peak, self._stop = interval, rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def _python_error(err: str) -> str:
    """A failed process's Python traceback if it has one (else the end of its stderr), without
    the native stack dump a dying jax.distributed process appends."""
    lines = [line for line in err.splitlines() if not line.lstrip().startswith("@ ")]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    text = "\n".join(lines[starts[-1] :] if starts else lines)
    return text[-3000:]


def worker(args) -> None:
    """One learner process (argv: --worker ID)."""
    import jax

    from jaxrlhf.sharding import initialize_distributed

    initialize_distributed(f"127.0.0.1:{args.port}", args.processes, args.worker)
    import numpy as np

    from jaxrlhf.distributed import (
        broadcast,
        driven_streams,
        is_driver,
        return_freed_host_memory,
    )

    return_freed_host_memory()  # as jaxrlhf.main does for a multi-process learner
    from jaxrlhf.models import hf_tensor_specs, iter_hf_tensors, load_pretrained
    from jaxrlhf.models.mapping import flatten
    from jaxrlhf.rl.pool import GeneratorPool
    from jaxrlhf.sharding import make_mesh

    mesh = make_mesh((1, -1, 1))
    model, params = load_pretrained(args.model, mesh=mesh)
    flat = flatten(params)
    own = sum(sum(s.data.nbytes for s in leaf.addressable_shards) for leaf in flat.values())
    specs = hf_tensor_specs(model, params)
    tensor_bytes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for _, shape, dtype in specs]
    layer = sum(b for (name, _, _), b in zip(specs, tensor_bytes, strict=True)
                if name.startswith("model.layers.0."))  # fmt: skip
    pool = GeneratorPool([args.address], transport="stream") if is_driver() else None
    version = broadcast(max(s.policy_version for s in pool.wait_until_serving()) + 1
                        if pool is not None else None)  # fmt: skip
    increases, seconds = [], []
    libc = ctypes.CDLL("libc.so.6")
    for attempt in range(args.publishes):  # the first also compiles the gathers: run it twice
        # Freed heap back to the system first, so that the baseline is live memory only and a
        # publish cannot hide its buffers in memory an earlier one left mapped.
        libc.malloc_trim(0)
        baseline = rss_bytes()
        started = time.perf_counter()
        with PeakSampler() as sampler:
            stats = driven_streams(
                lambda: iter_hf_tensors(model, params),
                lambda tensors, v=version + attempt: pool.publish_weights(tensors, len(specs), v),
            )
        seconds.append(round(time.perf_counter() - started, 3))
        increases.append(sampler.peak - baseline)
    result = {
        "process": jax.process_index(),
        "devices": jax.local_device_count(),
        "own_shard_bytes": own,
        "baseline_rss_bytes": baseline,
        "peak_increase_bytes": increases[-1],  # the last publish: steady state
        "peak_increase_bytes_each": increases,
        "largest_tensor_bytes": max(tensor_bytes),
        "layer_bytes": layer,
        "model_bytes": sum(tensor_bytes),
        "publish_seconds": seconds,
        "swapped_version": stats.policy_version if stats is not None else None,
    }
    if pool is not None:
        pool.close()
    print(json.dumps(result), flush=True)


def over_bound(results: list[dict], max_layers: float) -> list[str]:
    """Each process whose peak increase over its baseline (which holds its own shards) exceeds
    `max_layers` decoder layers, described."""
    return [
        f"process {r['process']}: +{r['peak_increase_bytes'] / 1e6:.1f} MB = "
        f"{r['peak_increase_bytes'] / r['layer_bytes']:.2f} layers over its own shards "
        f"(bound {max_layers} layers = {max_layers * r['layer_bytes'] / 1e6:.1f} MB)"
        for r in results
        if r["peak_increase_bytes"] > max_layers * r["layer_bytes"]
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=2)
    parser.add_argument("--model", default="", help="HF folder (default: a 540 MB random Llama)")
    parser.add_argument("--address", default="", help="a running generator for --model")
    parser.add_argument("--publishes", type=int, default=3, help="updates; the last is reported")
    parser.add_argument(
        "--max-increase-layers",
        type=float,
        default=1.5,
        help="the bound: a process's peak increase over its own shards, in decoder layers "
        "(exit 1 when a process exceeds it)",
    )
    parser.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.max_increase_layers < 0:
        parser.error(f"--max-increase-layers must be >= 0, got {args.max_increase_layers}")
    if args.worker >= 0:
        worker(args)
        return
    from jaxrlhf.models.tiny import make_tiny_model

    # Layers of 67 MB: large next to the transport's fixed 16 MiB chunk queue, as a real
    # model's are (Llama 3.1 8B: ~870 MB per layer in float32).
    model = args.model or str(make_tiny_model(
        REPO / ".cache" / "bench_publish_llama_1024", arch="llama", hidden_size=1024,
        intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=16))  # fmt: skip
    server = None
    address = args.address
    if not address:
        from jaxrlhf.rl.service import start_server

        log = REPO / ".cache" / "bench_publish_generator.log"
        server = start_server(model, log, ["--dtype", "float32", "--max-model-len", "256"],
                              env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
        address = server.address
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_process}",
    )
    port = free_port()
    try:
        worker_args = [
            "--port",
            str(port),
            "--processes",
            str(args.processes),
            "--model",
            model,
            "--address",
            address,
            "--publishes",
            str(args.publishes),
        ]
        procs = [
            subprocess.Popen([sys.executable, __file__, "--worker", str(i), *worker_args],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
            for i in range(args.processes)
        ]  # fmt: skip
        outputs = [p.communicate(timeout=600) for p in procs]
    finally:
        if server is not None:
            server.terminate()
    failed = [
        f"process {i} (exit {proc.returncode}):\n{_python_error(err)}"
        for i, (proc, (_, err)) in enumerate(zip(procs, outputs, strict=True))
        if proc.returncode != 0
    ]
    if failed:
        sys.exit("learner process(es) failed:\n" + "\n".join(failed))
    results = []
    for out, _ in outputs:
        results.append(json.loads(out.strip().splitlines()[-1]))
    for result in results:
        print(json.dumps(result))
    worst = max(r["peak_increase_bytes"] for r in results)
    summary = {
        "processes": args.processes,
        "devices": args.processes * args.devices_per_process,
        "model_bytes": results[0]["model_bytes"],
        "layer_bytes": results[0]["layer_bytes"],
        "largest_tensor_bytes": results[0]["largest_tensor_bytes"],
        "worst_peak_increase_bytes": worst,
        "increase_over_layer": round(worst / results[0]["layer_bytes"], 3),
        "increase_over_model": round(worst / results[0]["model_bytes"], 3),
        "swapped_version": results[0]["swapped_version"],
        "max_increase_layers": args.max_increase_layers,
    }
    over = over_bound(results, args.max_increase_layers)
    summary["within_bound"] = not over
    print(json.dumps(summary), flush=True)
    if over:
        sys.exit("publishing exceeded the memory bound:\n" + "\n".join(over))


if __name__ == "__main__":
    main()

"""Host memory of each learner process while a multi-process learner publishes its weights.

    python bench/publish_memory.py             # 2 processes x 2 CPU devices, a 540 MB model
    python bench/publish_memory.py --address HOST:PORT --model PATH   # a running generator

The learner is N `jax.distributed` processes (gloo) with one mesh over all their devices, the
model's parameters sharded over it (FSDP). Two ways of publishing, each to a real generator
service over gRPC, measured in one run (`--modes`):

- `sliced` (the learner's way when it streams): every process streams the slices its own
  devices hold (`jaxrlhf.rl.publisher.publish_sliced`), one of N senders of the update; the
  service assembles them. A test hook makes any gather in the process fail the bench.
- `gathered` (the fallback, and how it was done before): every process gathers one HF tensor
  at a time (collectives) and the driver streams it.

Each process samples its resident set size (VmRSS) every 2 ms during the publish; its baseline
is the RSS just before (its own shards are in it: fake CPU devices keep them in host memory),
taken after `malloc_trim` returned freed heap to the system. Reported per process and mode:
the peak increase over the baseline, beside the largest single tensor, one decoder layer (all
its tensors) and the whole model. The bound, on `sliced`: each process's own shards plus
`--max-increase-layers` decoder layers (0.25). What a sender holds beyond its shards is about
ten chunks (its queue, the one being encoded, gRPC's copies), a fixed number of bytes: with
`--chunk-bytes` 1 MiB (the default here) that is ~0.16 of this model's 67 MB layer; with the
learner's default 4 MiB chunks ~0.6 of it, but 0.05 of a Llama-3.1-8B layer (870 MB, fp32).
`--publishes` updates are made per mode and the last one is reported (the first also compiles
the gathers). After the last (sliced) publish, the served weights are checked bit for bit
against one stream of the model folder's own tensors from one process: greedy tokens and
log-probs must be identical.

The bench exits 1, naming each process over the bound, when one is, or when the served weights
differ. The shared-memory transport is left out (the pool here streams): its file in /dev/shm
is the generator's preloading copy, and the pages each process writes its slices into would
count in that process's RSS. `tests/test_multiprocess.py` runs it sliced.

Prints one JSON line per process, then a summary JSON line (printed in every case).
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

from jaxrlhf_wire.chunks import DEFAULT_CHUNK_BYTES  # noqa: E402 - after the path


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


def forbid_gathers() -> None:
    """A test hook: any gather of a tensor in this process (`to_host`) raises, so that a
    publish with no gather proves it."""
    import jaxrlhf.distributed
    import jaxrlhf.models.hf_io

    def gathered(array):
        raise AssertionError(f"a tensor of shape {array.shape} was gathered to the host")

    jaxrlhf.distributed.to_host = jaxrlhf.models.hf_io.to_host = gathered


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
    from jaxrlhf.fleet.pool import GeneratorPool
    from jaxrlhf.models import (
        hf_tensor_specs,
        iter_hf_slices,
        iter_hf_tensors,
        load_pretrained,
        slice_plan,
    )
    from jaxrlhf.models.mapping import flatten
    from jaxrlhf.rl.publisher import PublishJob, publish_sliced
    from jaxrlhf.sharding import make_mesh

    mesh = make_mesh((1, -1, 1))
    model, params = load_pretrained(args.model, mesh=mesh)
    flat = flatten(params)
    own = sum(sum(s.data.nbytes for s in leaf.addressable_shards) for leaf in flat.values())
    specs = hf_tensor_specs(model, params)
    tensor_bytes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for _, shape, dtype in specs]
    layer = sum(b for (name, _, _), b in zip(specs, tensor_bytes, strict=True)
                if name.startswith("model.layers.0."))  # fmt: skip
    plan = slice_plan(model, params)
    sent = sum(piece.data.nbytes for _, piece in iter_hf_slices(model, params, plan=plan))
    pool = (GeneratorPool([args.address], transport="stream", chunk_bytes=args.chunk_bytes)
            if is_driver() else None)  # fmt: skip
    version = broadcast(max(s.policy_version for s in pool.wait_until_serving()) + 1
                        if pool is not None else None)  # fmt: skip
    libc = ctypes.CDLL("libc.so.6")
    result = {"process": jax.process_index(), "devices": jax.local_device_count(),
              "own_shard_bytes": own, "sliced_bytes": sent,
              "senders": len(plan.senders)}  # fmt: skip
    for mode in args.modes.split(","):
        if mode == "sliced":
            forbid_gathers()  # from here on: a gather fails the bench
        increases, seconds = [], []
        for _ in range(args.publishes):  # the first also compiles (gathers): run it twice
            # Freed heap back to the system first, so that the baseline is live memory only
            # and a publish cannot hide its buffers in memory an earlier one left mapped.
            libc.malloc_trim(0)
            baseline = rss_bytes()
            started = time.perf_counter()
            job = PublishJob(pool, version, specs)
            with PeakSampler() as sampler:
                if mode == "sliced":
                    stats = publish_sliced(model, params, None, plan, job)
                else:
                    stats = driven_streams(lambda: iter_hf_tensors(model, params), job.send)
            seconds.append(round(time.perf_counter() - started, 3))
            increases.append(sampler.peak - baseline)
            version += 1
        result[mode] = {
            "peak_increase_bytes": increases[-1],  # the last publish: steady state
            "peak_increase_bytes_each": increases,
            "publish_seconds": seconds,
            "swapped_version": stats.policy_version if stats is not None else None,
        }
    result.update({
        "baseline_rss_bytes": baseline,
        "largest_tensor_bytes": max(tensor_bytes),
        "layer_bytes": layer,
        "model_bytes": sum(tensor_bytes),
    })  # fmt: skip
    if pool is not None:
        pool.close()
    print(json.dumps(result), flush=True)


def over_bound(results: list[dict], max_layers: float, mode: str = "sliced") -> list[str]:
    """Each process whose peak increase over its baseline (which holds its own shards) in
    `mode` exceeds `max_layers` decoder layers, described."""
    return [
        f"process {r['process']} ({mode}): +{r[mode]['peak_increase_bytes'] / 1e6:.1f} MB = "
        f"{r[mode]['peak_increase_bytes'] / r['layer_bytes']:.2f} layers over its own shards "
        f"(bound {max_layers} layers = {max_layers * r['layer_bytes'] / 1e6:.1f} MB)"
        for r in results
        if r[mode]["peak_increase_bytes"] > max_layers * r["layer_bytes"]
    ]


def served_greedy(address: str) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probs of a few prompts, from what `address` serves."""
    from jaxrlhf.fleet.rpc import GeneratorClient

    prompts = [[5, 6, 7, 8], [9, 10, 11], [1, 200, 31, 77]]
    with GeneratorClient(address) as client:
        done = client.generate(prompts, max_tokens=16, temperature=0.0, ignore_eos=True)
        return [(list(c.token_ids), list(c.logprobs))
                for c in sorted(done, key=lambda c: c.prompt_index)]  # fmt: skip


def served_as_one_stream(address: str, model: str) -> bool:
    """Whether what `address` serves now generates exactly (tokens and log-probs, bit for bit)
    what the model folder's own tensors do, sent as one stream by one process."""
    from safetensors.numpy import load_file

    from jaxrlhf.fleet.rpc import GeneratorClient

    before = served_greedy(address)
    tensors = {}
    for path in sorted(Path(model).glob("*.safetensors")):
        tensors.update(load_file(path))
    with GeneratorClient(address) as client:
        client.update_weights(tensors, client.status().policy_version + 1)
    return served_greedy(address) == before


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
        "--modes",
        default="gathered,sliced",
        help="sliced: each process streams its own slices (the learner's publish, no gather); "
        "gathered: each tensor gathered, the driver streams it (the fallback); comma-separated",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=1 << 20,
        help="bytes per streamed chunk: the learner's generator.weight_chunk_bytes (default "
        f"there {DEFAULT_CHUNK_BYTES >> 20} MiB); a sender holds about ten chunks",
    )
    parser.add_argument(
        "--max-increase-layers",
        type=float,
        default=0.25,
        help="the bound: a process's peak increase over its own shards when publishing sliced, "
        "in decoder layers (exit 1 when a process exceeds it)",
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
        from jaxrlhf.fleet.service import start_server

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
            "--modes",
            args.modes,
            "--chunk-bytes",
            str(args.chunk_bytes),
        ]
        procs = [
            subprocess.Popen([sys.executable, __file__, "--worker", str(i), *worker_args],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
            for i in range(args.processes)
        ]  # fmt: skip
        outputs = [p.communicate(timeout=600) for p in procs]
        failed = [
            f"process {i} (exit {proc.returncode}):\n{_python_error(err)}"
            for i, (proc, (_, err)) in enumerate(zip(procs, outputs, strict=True))
            if proc.returncode != 0
        ]
        if failed:
            sys.exit("learner process(es) failed:\n" + "\n".join(failed))
        # The last publish's weights (the model's own) against one stream of the same tensors.
        same = served_as_one_stream(address, model) if args.modes.endswith("sliced") else None
    finally:
        if server is not None:
            server.terminate()
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for result in results:
        print(json.dumps(result))
    modes = args.modes.split(",")
    summary = {
        "processes": args.processes,
        "devices": args.processes * args.devices_per_process,
        "chunk_bytes": args.chunk_bytes,
        "model_bytes": results[0]["model_bytes"],
        "layer_bytes": results[0]["layer_bytes"],
        "largest_tensor_bytes": results[0]["largest_tensor_bytes"],
        "sliced_bytes_all_processes": sum(r["sliced_bytes"] for r in results),
        "served_equal_one_stream": same,
        "max_increase_layers": args.max_increase_layers,
    }
    for mode in modes:
        worst = max(r[mode]["peak_increase_bytes"] for r in results)
        summary[mode] = {
            "worst_peak_increase_bytes": worst,
            "increase_over_layer": round(worst / results[0]["layer_bytes"], 3),
            "increase_over_model": round(worst / results[0]["model_bytes"], 3),
            "swapped_version": results[0][mode]["swapped_version"],
        }
    over = over_bound(results, args.max_increase_layers) if "sliced" in modes else []
    summary["within_bound"] = not over
    print(json.dumps(summary), flush=True)
    problems = list(over)
    if same is False:
        problems.append("the served weights differ from one stream of the same tensors")
    if problems:
        sys.exit("publishing exceeded the memory bound or served other weights:\n"
                 + "\n".join(problems))  # fmt: skip


if __name__ == "__main__":
    main()

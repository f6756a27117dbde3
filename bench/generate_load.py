"""Load on one generator service: many concurrent Generate streams while the weights change.

    python bench/generate_load.py                          # tiny model, 4 x 16 streams, 60 s
    python bench/generate_load.py --address HOST:PORT --model PATH --processes 8 --streams 16

Phase 1 (baseline): one client process, one stream, `--baseline-seconds` long: that client's
tokens/s. Phase 2 (load): `--processes` client processes x `--streams` threads each keep a
Generate call in flight for `--seconds`, while this process publishes a new version of the
weights (the model's own tensors, perturbed) every `--update-every` seconds through
UpdateWeights. Every call is checked: it must end without an error, and all its completions
must carry one policy version (a call never spans a swap). Prints one JSON line: calls, failed
calls, calls with mixed versions, updates made, p50 / p99 call latency, tokens/s of the load and
of the one baseline client, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def client_process(address: str, streams: int, seconds: float, args: dict, out) -> None:
    """`streams` threads, each looping Generate calls for `seconds`; sends its call records."""
    import grpc

    from jaxrlhf.fleet.rpc import GeneratorClient

    records: list[tuple[float, int, int, str]] = []  # (latency, tokens, versions, error)
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def loop(seed: int) -> None:
        with GeneratorClient(address) as client:
            prompt = [[(seed * 31 + i) % 200 + 3 for i in range(args["prompt_len"])]]
            while time.monotonic() < stop:
                started = time.perf_counter()
                try:
                    completions = list(client.generate(
                        prompt, max_tokens=args["max_tokens"], n=1, temperature=1.0,
                        timeout=120))  # fmt: skip
                    versions = {c.policy_version for c in completions}
                    tokens = sum(len(c.token_ids) for c in completions)
                    record = (time.perf_counter() - started, tokens, len(versions), "")
                except grpc.RpcError as error:
                    record = (time.perf_counter() - started, 0, 0, error.code().name)
                with lock:
                    records.append(record)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.send(records)


def run_clients(address: str, processes: int, streams: int, seconds: float, args: dict):
    """Every call record of `processes` x `streams` streams, and the wall time."""
    context = multiprocessing.get_context("spawn")
    pipes, workers = [], []
    started = time.perf_counter()
    for _ in range(processes):
        receive, send = context.Pipe(duplex=False)
        worker = context.Process(target=client_process,
                                 args=(address, streams, seconds, args, send))  # fmt: skip
        worker.start()
        pipes.append(receive)
        workers.append(worker)
    records = [record for pipe in pipes for record in pipe.recv()]
    for worker in workers:
        worker.join()
    return records, time.perf_counter() - started


def updater(address: str, model: Path, every: float, stop: threading.Event, done: list) -> None:
    """Publishes perturbed copies of the model's tensors every `every` seconds."""
    import numpy as np

    from jaxrlhf.fleet.rpc import GeneratorClient
    from jaxrlhf.models.safetensors_io import SafetensorsFile

    file = SafetensorsFile(model / "model.safetensors")
    base = {name: np.array(file.get(name)) for name in file.names()}
    rng = np.random.default_rng(0)
    with GeneratorClient(address) as client:
        version = client.status(timeout=10).policy_version
        while not stop.wait(every):
            version += 1
            tensors = {k: (v + rng.normal(0, 1e-3, v.shape)).astype(v.dtype)
                       for k, v in base.items()}  # fmt: skip
            client.update_weights(tensors, version, timeout=120)
            done.append(version)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(records, seconds: float) -> dict:
    ok = [r for r in records if not r[3]]
    latencies = [r[0] for r in ok]
    return {
        "calls": len(records),
        "failed_calls": len(records) - len(ok),
        "errors": sorted({r[3] for r in records if r[3]}),
        "mixed_version_calls": sum(r[2] > 1 for r in ok),
        "tokens_per_s": sum(r[1] for r in ok) / seconds,
        "latency_p50_s": round(statistics.median(latencies), 4) if latencies else None,
        "latency_p99_s": round(percentile(latencies, 0.99), 4) if latencies else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="HF folder (default: the tiny Llama)")
    parser.add_argument("--address", default="", help="a running server for --model")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--streams", type=int, default=16, help="concurrent calls per process")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--baseline-seconds", type=float, default=15.0)
    parser.add_argument("--update-every", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    args = parser.parse_args()
    from jaxrlhf.models.tiny import make_tiny_model

    model = Path(args.model) if args.model else make_tiny_model(
        REPO / ".cache" / "bench_tiny_llama", arch="llama")  # fmt: skip
    server = None
    address = args.address
    if not address:
        from jaxrlhf.fleet.service import start_server

        log = REPO / ".cache" / "bench_generate_load.log"
        server = start_server(model, log, ["--dtype", "float32", "--max-model-len", "256"],
                              env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
        address = server.address
    sampling = {"max_tokens": args.max_tokens, "prompt_len": args.prompt_len}
    try:
        baseline, baseline_s = run_clients(address, 1, 1, args.baseline_seconds, sampling)
        stop, updates = threading.Event(), []
        thread = threading.Thread(
            target=updater, args=(address, model, args.update_every, stop, updates)
        )
        thread.start()  # fmt: skip
        try:
            load, load_s = run_clients(address, args.processes, args.streams, args.seconds,
                                       sampling)  # fmt: skip
        finally:
            stop.set()
            thread.join()
    finally:
        if server is not None:
            server.terminate()
    single, loaded = summarize(baseline, baseline_s), summarize(load, load_s)
    result = {
        "model": str(model),
        "processes": args.processes,
        "streams": args.processes * args.streams,
        "seconds": round(load_s, 1),
        "updates": len(updates),
        **loaded,
        "one_client_tokens_per_s": single["tokens_per_s"],
        "throughput_over_one_client": round(loaded["tokens_per_s"] / single["tokens_per_s"], 2),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Publishing a LoRA policy: its adapter alone to a "lora" generator, against the whole (merged)
policy to a "drain" one, side by side in one run.

    python bench/lora_sync.py                     # SmolLM2-135M (packaged), rank 16, 6 publishes
    python bench/lora_sync.py --model tiny --rank 8 --publishes 2 --quiet-seconds 1   # smoke
    python bench/lora_sync.py --full-address HOST:PORT --adapter-address HOST:PORT  # running ones

Each variant starts its own generator service on `--model` (fp32, `--dtype`): `full`, the
default drain mode with preloaded swaps, takes every tensor of the model at each publish (what a
LoRA run publishes to any other generator: its merged weights); `adapter`, started with
`--max-lora-rank`, takes the PEFT tensors of a rank `--rank` adapter on all seven linear
layers of each block (A [rank, in], B [out, rank], random). The publishes go through the
learner's own pool (`jaxrlhf.fleet.GeneratorPool.publish_weights`, its default transport). While
they run, a client keeps the generator busy with a stream of short greedy calls, back to back
(`--probe-tokens` tokens each), and records when each ends. `--full-address` and
`--adapter-address` take running services of the model instead (in those modes; fp32 for the
full variant's tensors) and leave them running. Per publish of version v:

- `bytes`: what the server received (UpdateWeightsResponse.num_bytes);
- `to_first_sample_s`: from the publish's start to the end of a one-token greedy call made as
  soon as the publish returned, its sample tagged v: the time from the learner's update to the
  first sample on it;
- `pause_s`: the server's own pause for the swap (UpdateWeightsResponse.pause_seconds);
- `stall_s`: the longest gap between two probe calls' ends from the publish's start to that
  first sample. Against it, `quiet_stall_s`: the longest such gap over `--quiet-seconds` before
  any publish, on the same server. The generation a swap stops shows as the difference. And
  `quiet_calls_per_s`, the probe calls a second then: how fast each engine generates (vLLM's
  CPU backend runs a LoRA-enabled engine uncompiled).

Per variant the medians over its publishes; the ratios adapter / full of bytes and of the time
to the first sample. Prints a table and one JSON line; writes it to `--out` if given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxrlhf.fleet.pool import GeneratorPool  # noqa: E402
from jaxrlhf.fleet.rpc import generator_pb2  # noqa: E402
from jaxrlhf.fleet.service import start_server  # noqa: E402
from jaxrlhf.models.paths import resolve_model  # noqa: E402

ATTENTION, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
TARGETS = {**dict.fromkeys(ATTENTION, "self_attn"), **dict.fromkeys(MLP, "mlp")}
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def model_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """The model's tensors as float32 (what a fp32 learner publishes)."""
    from safetensors.numpy import load_file

    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update({k: v.astype(np.float32) for k, v in load_file(str(path)).items()})
    return tensors


def adapter_tensors(base: dict[str, np.ndarray], rank: int, seed: int) -> dict[str, np.ndarray]:
    """A random rank-`rank` adapter in PEFT's layout on every target of every layer of `base`."""
    rng = np.random.default_rng(seed)
    out = {}
    layers = sorted({int(k.split(".")[2]) for k in base if k.startswith("model.layers.")})
    for layer in layers:
        for target, block in TARGETS.items():
            prefix = f"model.layers.{layer}.{block}.{target}"
            rows, cols = base[f"{prefix}.weight"].shape
            name = f"base_model.model.{prefix}"
            out[f"{name}.lora_A.weight"] = rng.normal(0, 0.02, (rank, cols)).astype(np.float32)
            out[f"{name}.lora_B.weight"] = rng.normal(0, 0.02, (rows, rank)).astype(np.float32)
    return out


class Probe:
    """Short greedy calls, back to back, in a thread; `ends` holds when each ended."""

    def __init__(self, pool: GeneratorPool, tokens: int) -> None:
        self.pool, self.tokens, self.ends = pool, tokens, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        sampling = dict(n=1, temperature=0.0, max_tokens=self.tokens)
        while not self._stop.is_set():
            self.pool.generate([PROMPT], sampling)
            self.ends.append(time.perf_counter())

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def longest_gap(self, start: float, end: float) -> float:
        """The longest gap between call ends within [start, end] (its edges count as ends)."""
        times = [start, *(t for t in list(self.ends) if start < t < end), end]
        return max(b - a for a, b in zip(times, times[1:], strict=False))


def run_variant(name: str, model_dir: Path, tensors: dict, args, folder: Path) -> dict:
    """One variant's server (started here, or the running one given), quiet period and
    publishes (module docstring)."""
    address, server = getattr(args, f"{name}_address"), None
    if not address:
        lora_mode = ["--max-lora-rank", str(args.max_lora_rank), "--no-preload"]
        extra = lora_mode if name == "adapter" else []
        options = ["--dtype", "float32", "--max-model-len", "256", "--seed", "0", *extra]
        server = start_server(model_dir, folder / f"{name}.log", options,
                              env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
        address = server.address
    pool = GeneratorPool([address])
    lora = None
    if name == "adapter":
        lora = generator_pb2.LoraAdapter(rank=args.rank, alpha=2.0 * args.rank,
                                         target_modules=list(TARGETS))  # fmt: skip
    try:
        version = pool.wait_until_serving()[0].policy_version
        pool.generate([PROMPT], dict(n=1, temperature=0.0, max_tokens=args.probe_tokens))
        rows = []
        with Probe(pool, args.probe_tokens) as probe:
            started = time.perf_counter()
            time.sleep(args.quiet_seconds)
            ended = time.perf_counter()
            quiet = probe.longest_gap(started, ended)
            calls = sum(started < t < ended for t in list(probe.ends)) / (ended - started)
            for _ in range(args.publishes):
                version += 1
                rows.append(publish_once(pool, tensors, version, lora, probe))
                time.sleep(args.between_seconds)
    finally:
        pool.close()
        if server is not None:
            server.terminate()
    return {**summary(name, rows, quiet), "quiet_calls_per_s": calls}


def publish_once(pool: GeneratorPool, tensors: dict, version: int, lora, probe: Probe) -> dict:
    """Publishes `tensors` as `version`, then samples one token on it (module docstring)."""
    started = time.perf_counter()
    # Both through the pool's default transport ("auto": the shared file on this host, as a
    # run publishes them); the adapter's layout tells the pool it is one.
    extra = {"specs": [(k, v.shape, v.dtype) for k, v in tensors.items()],
             **({"lora": lora} if lora is not None else {})}  # fmt: skip
    stats = pool.publish_weights(lambda: iter(tensors.items()), len(tensors), version, **extra)
    (sample,) = pool.generate([PROMPT], dict(n=1, temperature=0.0, max_tokens=1))
    first = time.perf_counter()
    if sample.policy_version != version:
        raise RuntimeError(f"the first sample after publishing {version} is tagged "
                           f"{sample.policy_version}")  # fmt: skip
    return {"bytes": stats.num_bytes, "publish_s": stats.seconds,
            "to_first_sample_s": first - started, "pause_s": stats.pause_seconds,
            "stall_s": probe.longest_gap(started, first)}  # fmt: skip


def summary(name: str, rows: list[dict], quiet: float) -> dict:
    medians = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    return {"variant": name, "publishes": len(rows), **medians, "quiet_stall_s": quiet,
            "rows": rows}  # fmt: skip


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--publishes", type=int, default=6)
    parser.add_argument("--probe-tokens", type=int, default=4)
    parser.add_argument("--quiet-seconds", type=float, default=5.0)
    parser.add_argument("--between-seconds", type=float, default=1.0)
    parser.add_argument("--full-address", default="", help="a running drain-mode service")
    parser.add_argument("--adapter-address", default="", help="a running LoRA-mode service")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    model_dir = resolve_model(args.model)
    full = model_tensors(model_dir)
    adapter = adapter_tensors(full, args.rank, seed=0)
    results = {}
    with tempfile.TemporaryDirectory(prefix="lora-sync-") as tmp:
        for name, tensors in (("full", full), ("adapter", adapter)):
            results[name] = run_variant(name, model_dir, tensors, args, Path(tmp))
    out = {"model": args.model, "rank": args.rank, **results,
           "bytes_ratio": results["adapter"]["bytes"] / results["full"]["bytes"],
           "to_first_sample_ratio": results["adapter"]["to_first_sample_s"]
           / results["full"]["to_first_sample_s"]}  # fmt: skip
    print_table(out)
    print(json.dumps(out))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


def print_table(out: dict) -> None:
    keys = (
        "bytes",
        "publish_s",
        "to_first_sample_s",
        "pause_s",
        "stall_s",
        "quiet_stall_s",
        "quiet_calls_per_s",
    )
    print(f"{'variant':10}" + "".join(f"{k:>20}" for k in keys))
    for name in ("full", "adapter"):
        row = out[name]
        print(f"{name:10}" + "".join(f"{row[k]:>20.4g}" for k in keys))
    print(
        f"adapter / full: bytes {out['bytes_ratio']:.4f}, time to the first sample "
        f"{out['to_first_sample_ratio']:.3f}"
    )


if __name__ == "__main__":
    main()

"""Overhead of the generator service: the same prompts through gRPC and through in-process vLLM.

    python bench/generate_overhead.py                       # tiny random model, a smoke run
    python bench/generate_overhead.py --model PATH          # e.g. a SmolLM2-135M folder
    python bench/generate_overhead.py --address HOST:PORT   # a service that is already running

Both sides get identical engine settings (dtype, max_model_len, seed, eager mode, processed
logprobs) and identical sampling (temperature, n, max_tokens, one logprob per token, no
detokenisation, ignore_eos so that both generate exactly the same number of tokens). One side
is `python -m generator_service` (a subprocess) timed through Generate calls, the other is
`LLM.generate` in this process. Both engines stay up and the `--repeats` timed runs alternate
between them after a warm-up each; the best run of each side counts.
With `--address` the service side is a running service instead of a subprocess (it saves
starting a second engine, e.g. in the tests): the in-process engine then takes the served model,
dtype and max_model_len from its status; start that service with the same --seed and KV cache.
Prints tokens/s of each and their ratio (target >= 0.95), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: a tiny random Llama)")
    parser.add_argument(
        "--address", default=None, help="HOST:PORT of a running service to time (not started here)"
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--calls", type=int, default=1, help="concurrent Generate calls")
    parser.add_argument("--repeats", type=int, default=5)
    # float32, not vLLM's CPU default bfloat16: on CPUs without AVX512-BF16/AMX (this machine has
    # AVX2 only) bfloat16 matmuls are emulated and ~5x slower. Both sides use the same dtype.
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", default=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    args = parser.parse_args()
    if args.address and args.model:
        parser.error("--address times the model that service serves; drop --model")
    return args


def adopt_served_settings(args: argparse.Namespace) -> None:
    """With --address: the in-process engine takes the model, dtype and length the service has."""
    from jaxrlhf.fleet.rpc import GeneratorClient

    with GeneratorClient(args.address) as client:
        status = client.wait_until_serving(timeout=120)
    args.model, args.dtype, args.max_model_len = status.model, status.dtype, status.max_model_len


def make_prompts(model_dir: str, count: int, length: int, seed: int) -> list[list[int]]:
    import numpy as np

    config = json.loads((Path(model_dir) / "config.json").read_text())
    rng = np.random.default_rng(seed)
    # Skip the lowest ids, where special tokens usually live.
    high = config["vocab_size"]
    return rng.integers(min(16, high - 1), high, size=(count, length)).tolist()


@contextmanager
def service_address(args, model_dir: str, log_path: Path):
    """--address as given, else that of a service started here (and stopped on exit)."""
    if args.address:
        yield args.address
        return
    from jaxrlhf.fleet.service import start_server

    server_args = ["--dtype", args.dtype, "--seed", str(args.seed)]
    if args.max_model_len:
        server_args += ["--max-model-len", str(args.max_model_len)]
    server = start_server(model_dir, log_path, server_args)
    try:
        yield server.address
    finally:
        server.terminate(timeout=120)


@contextmanager
def service_runner(args, address: str):
    """Yields a function that runs all prompts once through the service and returns seconds."""
    from jaxrlhf.fleet.rpc import GeneratorClient

    with GeneratorClient(address) as client:
        sampling = dict(
            max_tokens=args.max_tokens, n=args.n, temperature=args.temperature, ignore_eos=True
        )

        def one_call(part: list[list[int]], counts: list[int]) -> None:
            counts.append(sum(len(c.token_ids) for c in client.generate(part, **sampling)))

        def timed_run(batch: list[list[int]]) -> float:
            parts = [batch[i :: args.calls] for i in range(args.calls)]
            counts: list[int] = []
            threads = [threading.Thread(target=one_call, args=(p, counts)) for p in parts]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            seconds = time.perf_counter() - started
            assert sum(counts) == len(batch) * args.n * args.max_tokens, counts
            return seconds

        yield timed_run


@contextmanager
def in_process_runner(args, model_dir: str):
    """Builds an in-process `LLM`; yields a function that runs all prompts once."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        disable_log_stats=True,
    )
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
    )

    def timed_run(batch: list[list[int]]) -> float:
        token_prompts = [TokensPrompt(prompt_token_ids=p) for p in batch]
        started = time.perf_counter()
        outputs = llm.generate(token_prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        produced = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        assert produced == len(batch) * args.n * args.max_tokens, produced
        return seconds

    try:
        yield timed_run
    finally:
        # Now, so that its shutdown logs come before the results, not after them.
        llm.llm_engine.engine_core.shutdown()


def main() -> None:
    args = parse_args()
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    if args.address:
        adopt_served_settings(args)
    model_dir = args.model
    if model_dir is None:
        from jaxrlhf.models.tiny import make_tiny_model

        model_dir = str(make_tiny_model(REPO_ROOT / ".cache" / "bench_tiny_llama"))
        if args.max_model_len is None:
            args.max_model_len = 256
    prompts = make_prompts(model_dir, args.num_prompts, args.prompt_len, args.seed)
    tokens = args.num_prompts * args.n * args.max_tokens
    log_path = Path(tempfile.gettempdir()) / "generate_overhead_service.log"

    service: list[float] = []
    in_process: list[float] = []
    # Both engines stay up (an idle engine uses no CPU) and the timed runs alternate, so that
    # load from other processes on the machine hits both sides alike.
    with service_address(args, model_dir, log_path) as address:
        with (
            service_runner(args, address) as run_service,
            in_process_runner(args, model_dir) as run_in_process,
        ):
            run_service(prompts[:4])  # warm-up
            run_in_process(prompts[:4])
            for _ in range(args.repeats):
                service.append(run_service(prompts))
                in_process.append(run_in_process(prompts))

    service_tps = tokens / min(service)
    in_process_tps = tokens / min(in_process)
    ratio = service_tps / in_process_tps
    print()
    print(f"model {model_dir}: {args.num_prompts} prompts x {args.prompt_len} tokens, n={args.n}, ")
    print(f"  {args.max_tokens} new tokens each (ignore_eos), T={args.temperature}, "
          f"{args.calls} call(s), best of {args.repeats}")  # fmt: skip
    print(f"{'path':<28}{'seconds':>10}{'tokens/s':>12}")
    print(f"{'gRPC generator_service':<28}{min(service):>10.3f}{service_tps:>12.1f}")
    print(f"{'in-process LLM.generate':<28}{min(in_process):>10.3f}{in_process_tps:>12.1f}")
    paired = statistics.median(b / a for a, b in zip(service, in_process, strict=True))
    verdict = "meets" if ratio >= 0.95 else "BELOW"
    print(f"ratio service / in-process: {ratio:.3f} ({verdict} the 0.95 target)")
    print(f"median ratio of the {args.repeats} alternating pairs: {paired:.3f}")
    print(
        json.dumps(
            {
                "model": model_dir,
                "tokens": tokens,
                "service_seconds": service,
                "in_process_seconds": in_process,
                "service_tokens_per_s": round(service_tps, 1),
                "in_process_tokens_per_s": round(in_process_tps, 1),
                "ratio": round(ratio, 4),
                "median_paired_ratio": round(paired, 4),
            }
        )
    )


if __name__ == "__main__":
    main()

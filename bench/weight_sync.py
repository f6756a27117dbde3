"""Weight sync: JAX arrays -> generator service -> "swap done", next to an in-process vLLM
`reload_weights` of the same tensors, measured side by side in one run.

    python bench/weight_sync.py                 # SmolLM2-135M, fp32 and bf16
    python bench/weight_sync.py --dtypes bfloat16 --repeats 9

End to end = converting the (sharded) Flax params to the HF layout tensor by tensor (in a thread,
overlapped with the sending), streaming them in 4 MiB chunks over loopback gRPC, validating and
writing them into the service's staging file as they arrive, and swapping them in: vLLM's
`reload_weights` on views of that file, plus the repack of the tied lm_head (which a plain
reload leaves stale). In-process = `LLM.collective_rpc("reload_weights", weights_iterator=...)`
on the same tensors already in memory (the paper's in-process copy, without conversion or that
repack). Prints one JSON line per dtype: medians over the repeats (the first update of a server
is the slowest: its staging file and buffers are new), and the fastest repeat of each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path


def in_process_reload_seconds(model_dir: Path, dtype: str, tensors, repeats: int) -> list[float]:
    import torch
    from vllm import LLM

    llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.3)  # fmt: skip
    torch_tensors = [(name, torch.from_numpy(array.astype("float32"))) for name, array in tensors]
    if dtype == "bfloat16":
        torch_tensors = [(n, t.to(torch.bfloat16)) for n, t in torch_tensors]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(torch_tensors)})
        times.append(time.perf_counter() - start)
    del llm
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from jaxrlhf.models import hf_tensor_specs, iter_hf_tensors, load_pretrained
    from jaxrlhf.rl.generators import GeneratorPool
    from jaxrlhf.rl.service import start_server

    model_dir = Path(args.model)
    if args.model == "smollm2":
        from jaxrlhf.models.smollm2 import smollm2_path

        model_dir = smollm2_path()
    model, params = load_pretrained(model_dir)
    for dtype in args.dtypes.split(","):
        specs = hf_tensor_specs(model, params, dtype)
        num_bytes = sum(math.prod(shape) * dt.itemsize for _, shape, dt in specs)
        log = Path(tempfile.mkdtemp()) / "generator.log"
        server = start_server(model_dir, log, ["--dtype", dtype, "--max-model-len", "256"])
        pool = GeneratorPool([server.address])
        try:
            pool.wait_until_serving()
            service_times = []
            for version in range(1, args.repeats + 1):
                stats = pool.publish_weights(
                    lambda d=dtype: iter_hf_tensors(model, params, d), len(specs), version
                )
                service_times.append(stats.seconds)
        finally:
            pool.close()
            server.terminate()
        tensors = list(iter_hf_tensors(model, params, "float32"))
        reload_times = in_process_reload_seconds(model_dir, dtype, tensors, args.repeats)
        service_s, reload_s = statistics.median(service_times), statistics.median(reload_times)
        print(json.dumps({
            "model": args.model, "dtype": dtype, "tensors": len(specs), "bytes": num_bytes,
            "end_to_end_s": round(service_s, 3), "in_process_reload_s": round(reload_s, 3),
            "end_to_end_gb_per_s": round(num_bytes / service_s / 1e9, 3),
            "ratio_end_to_end_over_in_process": round(service_s / reload_s, 2),
            "end_to_end_min_s": round(min(service_times), 3),
            "in_process_reload_min_s": round(min(reload_times), 3),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

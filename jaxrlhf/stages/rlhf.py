"""The RLHF stage: connect to generator service(s) — or start one — and run the learner loop."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from jaxrlhf.rl.generators import GeneratorPool
from jaxrlhf.rl.service import start_server
from jaxrlhf.rl.tasks import build_task
from jaxrlhf.rl.trainer import run_rlhf


@contextlib.contextmanager
def generator_pool(config, model_path: Path, log):
    """A pool over the configured addresses, or over one server started here for the run."""
    gen = config.generator
    token = os.environ.get(gen.auth_token_env) if gen.auth_token_env else None
    server = None
    if gen.addresses:
        targets = [a.strip() for a in gen.addresses.split(",") if a.strip()]
    else:
        log_path = Path(config.output_dir) / "generator.log"
        log(f"starting a generator service for {model_path} (log: {log_path})")
        args = [
            "--dtype", gen.dtype, "--max-model-len", str(gen.max_model_len),
            "--seed", str(gen.seed),
        ]  # fmt: skip
        cpus = [int(c) for c in gen.cpus.split(",")] if gen.cpus else None
        server = start_server(model_path, log_path, args, cpus=cpus)
        targets = [server.address]
    pool = GeneratorPool(targets, auth_token=token)
    try:
        statuses = pool.wait_until_serving()
        log(f"generator(s) serving: {', '.join(targets)} (version {statuses[0].policy_version})")
        yield pool
    finally:
        pool.close()
        if server is not None:
            server.terminate()


def run(config, model_path: Path, log) -> dict:
    import transformers

    started = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    task = build_task(config, tokenizer)
    with generator_pool(config, model_path, log) as pool:
        result = run_rlhf(config, model_path, task, pool, log)
    summary = {**result.summary, "total_seconds": time.perf_counter() - started}
    out = Path(config.output_dir)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary

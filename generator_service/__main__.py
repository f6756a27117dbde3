"""Command line: `python -m generator_service --model PATH_OR_NAME --port 50051 [...]`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import traceback

from generator_service.auth import (
    AUTH_TOKEN_ENV,
    is_loopback,
    resolve_auth_token,
    server_credentials,
)
from generator_service.engine_config import GIB, EngineConfig
from generator_service.model_check import ModelProblem, check_model
from generator_service.server import EngineDiedError, ServerOptions, serve
from jaxrlhf_wire import IN_FLIGHT_KV, LORA_RANKS, SWAP_MODES

# Refuses to start an engine when set (its value says who forbids it): `make test-fast` sets it.
NO_ENGINE_ENV = "JAXRLHF_NO_ENGINE"
# vLLM's CPU backend: how many of the allowed cores its compute threads leave free.
CPU_RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
# The default of --kv-cache-gib for every server started in this environment (the test suite
# sets it: a tiny model needs a few MB of KV cache, not the usual GB per engine).
KV_CACHE_ENV = "JAXRLHF_KV_CACHE_GIB"
# The default of --engine-executor for every server started in this environment (the test suite
# sets "uni": one process fewer per engine start).
EXECUTOR_ENV = "JAXRLHF_ENGINE_EXECUTOR"
# The default of --engine-threads (the test suite sets 1: its engines compute on one core each).
THREADS_ENV = "JAXRLHF_ENGINE_THREADS"
# Set: a refused --model also prints the traceback behind it (as jaxrlhf's entry points do).
TRACEBACK_ENV = "JAXRLHF_TRACEBACK"
# What to change when the engine cannot start (out of memory is the usual cause).
START_HINT = (
    "If memory ran short: on CPU pass a smaller --kv-cache-gib (default: a quarter of the free "
    "memory), on GPUs a smaller --gpu-memory-utilization; see the log above for the cause."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m generator_service",
        description="vLLM generator behind gRPC with versioned weight updates.",
    )
    _add_engine_options(parser.add_argument_group("model and engine"))
    _add_update_options(parser.add_argument_group("weight updates"))
    _add_server_options(parser.add_argument_group("server"))
    return parser.parse_args(argv)


def _add_engine_options(group) -> None:
    """The served model and vLLM's engine (EngineConfig)."""
    group.add_argument("--model", required=True, help="Hugging Face folder or cached hub name")
    group.add_argument("--dtype", default="auto", help="served dtype, e.g. bfloat16, float32")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--tensor-parallel-size", type=int, default=1)
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="GPUs: the share of device memory vLLM takes")  # fmt: skip
    group.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help=f"the KV cache's size; it takes precedence over vLLM's VLLM_CPU_KVCACHE_SPACE "
        f"(default: ${KV_CACHE_ENV} if set, else on CPU a quarter of the free memory, "
        "0.5-4 GiB, and on GPUs what --gpu-memory-utilization leaves)",
    )
    group.add_argument("--seed", type=int, default=0, help="engine sampling seed")
    group.add_argument(
        "--cpu-reserved-cores",
        type=int,
        default=None,
        help="CPU backend: cores kept free of the engine's compute threads (default: vLLM's, one "
        "per engine process on x86); 0 lets the engine compute on every core it may run on",
    )
    group.add_argument(
        "--engine-executor",
        choices=("mp", "uni"),
        default=os.environ.get(EXECUTOR_ENV) or None,
        help="where vLLM's model runs: mp, a worker process of its own (vLLM's choice on CPU: "
        "it binds the worker's OpenMP threads to the cores left after --cpu-reserved-cores); "
        "uni, inside the engine-core process: one process fewer, ~10-20 s sooner ready and one "
        "torch import less memory, but the model computes on torch's thread count there (1 "
        "when one core is reserved), so use it only where the engine computes on one core, as "
        f"on a 2-core machine (default: ${EXECUTOR_ENV} if set, else vLLM's)",
    )
    group.add_argument(
        "--engine-threads",
        type=int,
        default=int(os.environ.get(THREADS_ENV) or 0),
        help="with --engine-executor uni: torch's threads in the engine (its OMP_NUM_THREADS); 0: "
        "the cores this process may run on less --cpu-reserved-cores when that is given, else "
        f"vLLM's choice, one (default: ${THREADS_ENV} if set, else 0)",
    )
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV-cache block, the unit of prefix caching (default: vLLM's, 128 on CPU)",
    )
    group.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="disable graph capture (default: on CPU only)",
    )


def _add_update_options(group) -> None:
    """How weight updates are received, preloaded and swapped in."""
    group.add_argument(
        "--swap-mode",
        choices=[mode for mode in SWAP_MODES if mode != "lora"],
        default=None,
        help="drain (default): a weight swap waits for running calls to finish (a call never "
        "spans a swap); in-flight: running requests pause, continue on the new weights, and "
        "report each token's policy version. (Swap mode \"lora\" is --max-lora-rank's.)",
    )
    _add_lora_options(group)
    group.add_argument(
        "--in-flight-kv",
        choices=IN_FLIGHT_KV,
        default="keep",
        help="in-flight mode: keep the KV cache computed with older weights (default, as "
        "PipelineRL) or recompute it with the new weights at every swap",
    )
    group.add_argument(
        "--update-dir",
        default=None,
        help="the folder of the file a streamed update is written into (default /dev/shm, else "
        "the temp folder)",
    )
    group.add_argument(
        "--preload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="preload each weight update (convert it into the engine's layout while generation "
        "goes on, then pause only to copy it in; the default, except with --max-lora-rank): one "
        "more copy of the weights in memory while an update is preloaded; --no-preload reloads "
        "in the pause, with one copy",
    )
    group.add_argument(
        "--preload-threads",
        type=int,
        default=1,
        help="CPU threads of the preloading thread (default 1: on a CPU backend it shares the "
        "cores with generation; 0: torch's default)",
    )
    group.add_argument(
        "--senders-timeout",
        type=float,
        default=60.0,
        help="seconds an update sent by several learner processes waits, from its first "
        "stream, for the streams of the others; then it is refused",
    )


def _add_lora_options(group) -> None:
    """LoRA mode: updates are adapters over the served model (swap mode "lora")."""
    group.add_argument(
        "--max-lora-rank",
        type=int,
        choices=LORA_RANKS,
        default=0,
        metavar="R",
        help=f"serve LoRA adapters of rank up to R over the model (one of {list(LORA_RANKS)}, "
        "vLLM's choices): every update is then an adapter (WeightChunk.lora), loaded with no "
        "pause; requests in flight finish on their adapter. Default: off (full-weight updates)",
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="with --max-lora-rank: adapters that may serve requests at once, at least the "
        "versions in flight (a learner's staleness window plus one; more queue) (default 4)",
    )
    group.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="with --max-lora-rank: adapters vLLM keeps loaded, >= --max-loras (default: "
        "--max-loras + 2)",
    )


def _add_server_options(group) -> None:
    """Where the server listens, who may call it, how it stops and logs."""
    group.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    group.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    group.add_argument(
        "--auth-token",
        default=None,
        help=f"shared secret; prefer the {AUTH_TOKEN_ENV} environment variable (not in ps). "
        "Required when --host is not loopback.",
    )
    group.add_argument("--tls-cert", default=None, help="PEM certificate chain for TLS")
    group.add_argument("--tls-key", default=None, help="PEM private key for TLS")
    group.add_argument("--shutdown-grace", type=float, default=10.0)
    group.add_argument("--log-level", default="INFO")


def lead_process_group() -> None:
    """Makes this server the leader of a process group of its own, unless it leads one already
    (a shell's job, a new session). vLLM's processes are born into it, and the reaper kills the
    group as a whole once the server is gone (`generator_service.reaper`): a group started by
    another program (the learner) must not be killed with it."""
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)


def stop_with_parent() -> None:
    """When started with an inherited pipe ($JAXRLHF_PARENT_FD, jaxrlhf.fleet.service), stop
    (SIGTERM: drain and exit) once the process holding its other end is gone."""
    fd = os.environ.get("JAXRLHF_PARENT_FD")
    if not fd:
        return

    def watch() -> None:
        while os.read(int(fd), 1):  # returns b"" (EOF) when the parent process is gone
            pass
        logging.warning("the process that started this server is gone: stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def option_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the options that argparse cannot tell (None: nothing), checked
    before anything starts; reads the KV cache size from the environment when not given."""
    if args.kv_cache_gib is None and os.environ.get(KV_CACHE_ENV):
        try:
            args.kv_cache_gib = float(os.environ[KV_CACHE_ENV])
        except ValueError:
            return f"{KV_CACHE_ENV}={os.environ[KV_CACHE_ENV]!r} is not a number of GiB"
    if args.kv_cache_gib is not None and not args.kv_cache_gib > 0:
        return f"a KV cache of {args.kv_cache_gib} GiB: it must be > 0"
    if args.preload_threads < 0:
        return f"--preload-threads={args.preload_threads}: must be >= 0"
    if args.cpu_reserved_cores is not None and args.cpu_reserved_cores < 0:
        return f"--cpu-reserved-cores={args.cpu_reserved_cores}: must be >= 0"
    if args.engine_threads < 0:
        return f"--engine-threads={args.engine_threads}: must be >= 0"
    if args.engine_executor == "uni" and args.tensor_parallel_size != 1:
        return (f"--engine-executor uni runs one worker, but --tensor-parallel-size="
                f"{args.tensor_parallel_size} needs one per device")  # fmt: skip
    return lora_option_error(args)


def lora_option_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the LoRA options, or their mix with the others (None: nothing)."""
    if not args.max_lora_rank:
        for flag, value in (("--max-loras", args.max_loras),
                            ("--max-cpu-loras", args.max_cpu_loras)):  # fmt: skip
            if value is not None:
                return f"{flag} is for LoRA mode: give --max-lora-rank too"
        return None
    if args.swap_mode is not None:
        return (f"--swap-mode {args.swap_mode} with --max-lora-rank: LoRA mode swaps adapters "
                'with no pause (swap mode "lora"); leave --swap-mode out')  # fmt: skip
    if args.preload:
        return ("--preload with --max-lora-rank: adapters are loaded by vLLM (add_lora), never "
                "preloaded; leave --preload out")  # fmt: skip
    max_loras = 4 if args.max_loras is None else args.max_loras
    if max_loras < 1:
        return f"--max-loras={max_loras}: must be >= 1"
    if args.max_cpu_loras is not None and args.max_cpu_loras < max_loras:
        return f"--max-cpu-loras={args.max_cpu_loras}: must be >= --max-loras ({max_loras})"
    return None


def engine_threads(args: argparse.Namespace) -> int | None:
    """Torch's threads in a `uni` engine, which computes in vLLM's engine-core process (None:
    vLLM's choice): --engine-threads, else every core this process may run on less the
    reserved ones, when --cpu-reserved-cores is given."""
    if args.engine_threads:
        return args.engine_threads
    if args.cpu_reserved_cores is None:
        return None
    return max(1, len(os.sched_getaffinity(0)) - args.cpu_reserved_cores)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        executor=args.engine_executor,
        max_num_seqs=args.max_num_seqs,
        block_size=args.block_size,
        update_dir=args.update_dir,
        kv_cache_bytes=int(args.kv_cache_gib * GIB) if args.kv_cache_gib else None,
        swap_mode="lora" if args.max_lora_rank else args.swap_mode or "drain",
        in_flight_kv=args.in_flight_kv,
        preload=not args.max_lora_rank if args.preload is None else args.preload,
        preload_threads=args.preload_threads,
        max_lora_rank=args.max_lora_rank,
        max_loras=4 if args.max_loras is None else args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
    )


def refusal(args: argparse.Namespace) -> tuple[str, int] | None:
    """(one line, exit code) when the server must not start: bad options or credentials (2),
    a model that is not there (2), or `make test-fast`'s no-engine rule (3); else None.
    Checked in that order: the options first, without touching the network."""
    problem = option_error(args)
    if problem is None:
        try:
            args.auth_token = resolve_auth_token(args.host, args.auth_token)
            args.tls = server_credentials(args.tls_cert, args.tls_key)
        except (ValueError, OSError) as error:
            problem = str(error)
    if problem is None:
        try:
            check_model(args.model)
        except ModelProblem as model_problem:
            if os.environ.get(TRACEBACK_ENV) and model_problem.cause is not None:
                traceback.print_exception(model_problem.cause, file=sys.stderr)
            problem = str(model_problem)
    if problem is not None:
        return f"error: {problem}", 2
    if os.environ.get(NO_ENGINE_ENV):
        # Set by `make test-fast`: a test that starts a generator there lacks its engine fixture.
        return f"error: {NO_ENGINE_ENV} is set: {os.environ[NO_ENGINE_ENV]}", 3
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    refused = refusal(args)
    if refused is not None:
        print(refused[0], file=sys.stderr)
        return refused[1]
    if args.cpu_reserved_cores is not None:
        # Read by vLLM's CPU platform when its engine process binds its OpenMP threads.
        os.environ[CPU_RESERVED_ENV] = str(args.cpu_reserved_cores)
    if args.engine_executor == "uni":
        # vLLM's CPU platform turns "uni" into "mp" unless its own engine process hosts the
        # worker (AsyncLLM still runs the engine core in a process of its own).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        threads = engine_threads(args)
        if threads:
            # vLLM keeps torch at an OMP_NUM_THREADS set from outside, else it computes on one.
            os.environ["OMP_NUM_THREADS"] = str(threads)
    lead_process_group()
    stop_with_parent()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.tls is None and not is_loopback(args.host):
        logging.warning("the auth token crosses the network in plaintext; consider --tls-cert")
    options = ServerOptions(host=args.host, port=args.port, auth_token=args.auth_token,
                            tls=args.tls, shutdown_grace=args.shutdown_grace,
                            senders_timeout=args.senders_timeout)  # fmt: skip
    try:
        asyncio.run(serve(engine_config(args), options))
    except EngineDiedError as error:
        print(f"error: the generator service stopped: {error}", file=sys.stderr, flush=True)
        return 1
    except Exception as error:  # noqa: BLE001 - one line for the user, the trace is logged
        logging.exception("the generator service could not start or failed")
        print(f"error: the generator service stopped: {type(error).__name__}: {error}. "
              f"{START_HINT}", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The engine's settings (`EngineConfig`) and what is made of them before it serves: vLLM's
`AsyncLLM` (`open_llm`), the tensors an update must carry (`served_weight_specs`), the folder
updates are preloaded in (`default_update_dir`).

Rules kept here:

- Sampling log-probs are those of the distribution actually sampled (temperature, top-k/p
  applied: `processed_logprobs`), which is what the learner's importance ratios need.
- Every worker loads updates through this package's extension (`WORKER_EXTENSION`).
- The KV cache's size, when given, wins over vLLM's VLLM_CPU_KVCACHE_SPACE; on CPU, when
  neither is given, it is `default_cpu_kv_cache_bytes()`.
- A model with no local folder (or no safetensors there) serves, but refuses weight updates
  with the reason (`served_weight_specs`).
- "lora" mode (`max_lora_rank` > 0) starts vLLM with LoRA enabled, takes adapters only, and
  never preloads (adapters are loaded by vLLM's `add_lora`: updates/adapters.py).
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from generator_service.updates.tensors import TensorSpec, expected_tensors
from jaxrlhf_wire import IN_FLIGHT_KV, LORA_RANKS, SWAP_MODES

logger = logging.getLogger(__name__)

# Reload that also repacks tied lm_heads (see worker_extension.py).
WORKER_EXTENSION = "generator_service.worker_extension.WeightReloadExtension"
GIB = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    # None: eager on CPU (no graph capture there), graphs elsewhere.
    enforce_eager: bool | None = None
    # vLLM's distributed_executor_backend ("mp", "uni"; None: vLLM's). "uni" on CPU also needs
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 (`python -m generator_service --engine-executor`).
    executor: str | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None  # None: vLLM's (128 on CPU: shorter prompts are never cached)
    # Where updates are preloaded before the engine loads them (RAM-backed if possible; see
    # updates/bytes_file.py). None: /dev/shm when writable, else the system temp folder.
    update_dir: str | None = None
    # The KV cache's size in bytes (it takes precedence over VLLM_CPU_KVCACHE_SPACE). None: on
    # CPU, `default_cpu_kv_cache_bytes()` (unless VLLM_CPU_KVCACHE_SPACE says otherwise); on
    # GPUs, gpu_memory_utilization decides.
    kv_cache_bytes: int | None = None
    # How a swap meets running requests (updates/swap.py).
    swap_mode: str = "drain"
    in_flight_kv: str = "keep"
    # Preloaded swaps (updates/worker_preload.py): the update is converted into the engine's layout
    # while generation goes on, and the pause only commits it. False: reload in the pause (one copy
    # of the weights instead of two). `preload_threads`: CPU threads of the preloading thread (on a
    # CPU backend it shares the cores with generation).
    preload: bool = True
    preload_threads: int = 1
    # "lora" mode (swap_mode "lora"): the largest adapter rank (one of LORA_RANKS; 0: off), how
    # many adapters may serve requests at once (requests of more versions queue: at least the
    # versions a learner's staleness window keeps in flight, plus one), and how many vLLM keeps
    # loaded in memory (None: max_loras + 2).
    max_lora_rank: int = 0
    max_loras: int = 4
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.swap_mode not in SWAP_MODES:
            raise ValueError(f"swap mode must be one of {SWAP_MODES}, got {self.swap_mode!r}")
        if self.in_flight_kv not in IN_FLIGHT_KV:
            raise ValueError(
                f"in-flight KV policy must be one of {IN_FLIGHT_KV}, got {self.in_flight_kv!r}"
            )
        if self.max_lora_rank not in (0, *LORA_RANKS):
            raise ValueError(f"max_lora_rank must be one of {LORA_RANKS}, got {self.max_lora_rank}")
        if (self.swap_mode == "lora") != (self.max_lora_rank > 0):
            raise ValueError('swap mode "lora" goes with a max_lora_rank > 0, and only it')
        if self.lora and self.preload:
            raise ValueError("adapters are never preloaded: preload must be False in lora mode")
        if self.max_loras < 1 or self.lora_cache_size < self.max_loras:
            raise ValueError(
                f"max_loras={self.max_loras} must be >= 1 and max_cpu_loras="
                f"{self.max_cpu_loras} >= it"
            )

    @property
    def lora(self) -> bool:
        return self.swap_mode == "lora"

    @property
    def lora_cache_size(self) -> int:
        """vLLM's max_cpu_loras."""
        return self.max_loras + 2 if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def in_flight(self) -> bool:
        return self.swap_mode == "in-flight"


def default_cpu_kv_cache_bytes() -> int:
    """A quarter of the memory free now, between 0.5 and 4 GiB.

    vLLM's CPU backend otherwise reserves `gpu_memory_utilization` (0.9) of the NUMA node's
    memory and refuses to start when that much is not free, which on a shared 24 GB machine
    (a ~9.6 GB node) it never is.
    """
    import psutil

    return int(min(4 * GIB, max(GIB // 2, psutil.virtual_memory().available // 4)))


def _kv_cache_bytes(config: EngineConfig, on_cpu: bool) -> int | None:
    """The KV cache's size to ask vLLM for (None: vLLM's own rule); see the module docstring."""
    kv_cache_bytes = config.kv_cache_bytes
    if kv_cache_bytes is None and on_cpu:
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_bytes = default_cpu_kv_cache_bytes()
    elif kv_cache_bytes is not None and os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None):
        # vLLM's CPU worker would take its variable over the size asked for here.
        logger.info("VLLM_CPU_KVCACHE_SPACE is ignored: the KV cache's size is given")
    if kv_cache_bytes is not None:
        logger.info("KV cache: %.2f GiB", kv_cache_bytes / GIB)
    return kv_cache_bytes


def open_llm(config: EngineConfig):
    """vLLM's AsyncLLM for `config`, started (its processes run from here on)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    on_cpu = current_platform.is_cpu()
    lora = {}
    if config.lora:
        lora = dict(enable_lora=True, max_lora_rank=config.max_lora_rank,
                    max_loras=config.max_loras, max_cpu_loras=config.lora_cache_size)  # fmt: skip
    args = AsyncEngineArgs(
        model=config.model,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        seed=config.seed,
        enforce_eager=on_cpu if config.enforce_eager is None else config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
        block_size=config.block_size,
        kv_cache_memory_bytes=_kv_cache_bytes(config, on_cpu),
        logprobs_mode="processed_logprobs",
        disable_log_stats=True,
        worker_extension_cls=WORKER_EXTENSION,
        distributed_executor_backend=config.executor,
        **lora,
    )
    return AsyncLLM.from_engine_args(args)


def served_weight_specs(model: str) -> tuple[dict[str, TensorSpec] | None, str]:
    """(the tensors a weight update must carry, "") from the served model's local folder, or
    (None, why weight updates are unavailable) when it has none or no safetensors there."""
    model_dir = _resolve_model_dir(model)
    try:
        if model_dir is None:
            raise FileNotFoundError(f"no local folder for {model}")
        return expected_tensors(model_dir), ""
    except FileNotFoundError as error:
        reason = f"weight updates are unavailable: {error}"
        logger.warning(reason)
        return None, reason


def _resolve_model_dir(model: str) -> Path | None:
    """The local folder of `model` (a path, or a hub name already in the local cache)."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means: no local folder to read headers from
        return None


def default_update_dir() -> str:
    """/dev/shm when writable (RAM-backed), else the system temp folder."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()

"""Adapter swaps ("lora" mode): each update is a LoRA adapter, loaded beside the base weights
and the adapters still in use, and served from then on with no pause.

- A swap writes the checked adapter into a folder of its own (adapter.py) and adds it to the
  engine (`AsyncLLM.add_lora`, which loads it now, so that the first request on it does not
  wait for the load). Only once the engine took it does it become the served adapter: the
  version and the update's id are recorded with it in the same step (`Served`). A refused or
  failed load deletes the folder and leaves the served adapter, and version, as they were.
  Nothing is paused: `pause_seconds` is 0, and `preload_seconds` is the folder's writing and the
  load.
- A Generate call takes the served adapter when it is admitted (`use`; version 0 is the base,
  no adapter) and holds it until its last request has ended, aborted or not; its requests run
  on it whatever is published meanwhile (vLLM keeps each request's adapter).
- An adapter that is no longer served is unloaded (`remove_lora`) and its folder deleted once
  no call holds it: never earlier, since vLLM would reload an evicted adapter that a request
  still uses from its folder.
- Each load gets a new engine id (a server-local counter, never the version: a rollback to an
  older version is a new adapter), named `policy-v{version}-{id}` (distinct prefix-cache keys).
- A swap cancelled once its folder is being written runs to its end
  (`finish_despite_cancellation`): the adapter then serves (unless refused), and the
  cancellation is raised after; no folder is left behind by a refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from generator_service.status import Served, SwapTimes
from generator_service.updates.adapter import LoraSettings, write_adapter_folder
from generator_service.updates.swap import check_newer, finish_despite_cancellation
from generator_service.updates.tensors import PreloadTensor, WeightUpdateError
from jaxrlhf_wire.files import pid_runs

logger = logging.getLogger(__name__)

# The folder of a server's adapters, under its update folder (with the server's PID).
ADAPTERS_PREFIX = "jaxrlhf-lora-"


@dataclass
class Adapter:
    """An adapter loaded in the engine: its version, vLLM's request for it, its folder, and the
    calls holding it."""

    version: int
    request: object  # vllm.lora.request.LoRARequest
    folder: str
    users: int = 0


class AdapterSwaps:
    """The adapters of one "lora" engine (module docstring); `root`: the folder their folders
    go in, `base_model`: the served model's name (written into each adapter's config)."""

    def __init__(self, llm, served: Served, root: str, base_model: str) -> None:
        self._llm = llm
        self._served = served
        self.root = root
        self._base_model = base_model
        self._next_id = 1
        self._loaded: dict[int, Adapter] = {}  # by engine id
        self.current: Adapter | None = None  # the served one; None: the base
        self._unloads: set[asyncio.Task] = set()

    @property
    def versions(self) -> list[int]:
        """The versions of the adapters loaded now (the served one and those still in use)."""
        return sorted(adapter.version for adapter in self._loaded.values())

    @property
    def loaded_ids(self) -> list[int]:
        return sorted(self._loaded)

    @contextlib.contextmanager
    def use(self) -> Iterator[object | None]:
        """Holds the served adapter while the block runs; yields vLLM's request for it (None:
        the base). Read together with `Served.policy_version`, with no await between."""
        adapter = self.current
        if adapter is not None:
            adapter.users += 1
        try:
            yield None if adapter is None else adapter.request
        finally:
            if adapter is not None:
                adapter.users -= 1
                self._unload_if_unused(adapter)

    async def swap(
        self,
        update_path: str,
        tensors: list[PreloadTensor],
        settings: LoraSettings,
        policy_version: int,
        allow_rollback: bool = False,
        update_id: str = "",
    ) -> SwapTimes:
        """Loads the checked, complete adapter in `update_path` and serves it as
        `policy_version` (module docstring)."""
        self._check_version(policy_version, allow_rollback)
        started = time.monotonic()
        engine_id, self._next_id = self._next_id, self._next_id + 1
        name = f"v{policy_version}-{engine_id}"

        async def load() -> None:
            folder = await asyncio.to_thread(write_adapter_folder, self.root, name, update_path,
                                             tensors, settings, self._base_model)  # fmt: skip
            adapter = Adapter(policy_version, self._request(name, engine_id, folder), folder)
            await self._load(adapter, allow_rollback, update_id)

        await finish_despite_cancellation(asyncio.ensure_future(load()))
        return SwapTimes(preload_seconds=time.monotonic() - started, pause_seconds=0.0)

    @staticmethod
    def _request(name: str, engine_id: int, folder: str):
        from vllm.lora.request import LoRARequest

        return LoRARequest(lora_name=f"policy-{name}", lora_int_id=engine_id, lora_path=folder)

    async def _load(self, adapter: Adapter, allow_rollback: bool, update_id: str) -> None:
        """Adds `adapter` to the engine and serves it; on a refusal deletes its folder."""
        version = adapter.version
        try:
            self._check_version(version, allow_rollback)
            loaded = await self._llm.add_lora(adapter.request)
        except WeightUpdateError:
            shutil.rmtree(adapter.folder, ignore_errors=True)
            raise
        except Exception:
            logger.exception("the engine failed to load the adapter of policy_version %d", version)
            loaded = False
        if not loaded:
            shutil.rmtree(adapter.folder, ignore_errors=True)
            raise WeightUpdateError(
                grpc.StatusCode.INTERNAL,
                f"the engine refused the adapter of policy_version {version} (see the "
                f"server's log); the served adapter (policy_version "
                f"{self._served.policy_version}) is unchanged",
            )
        previous, self.current = self.current, adapter
        self._loaded[adapter.request.lora_int_id] = adapter
        self._served.swapped_in(version, update_id)
        logger.info("adapter of policy_version %d served (engine id %d)", version,
                    adapter.request.lora_int_id)  # fmt: skip
        if previous is not None:
            self._unload_if_unused(previous)

    def _check_version(self, policy_version: int, allow_rollback: bool) -> None:
        check_newer(self._served, policy_version, allow_rollback)
        if policy_version == 0:
            raise WeightUpdateError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "policy_version 0 is the base model (no adapter); an adapter needs a version >= 1",
            )

    def _unload_if_unused(self, adapter: Adapter) -> None:
        """Unloads `adapter` in the background once it is neither served nor held."""
        if adapter.users == 0 and adapter is not self.current:
            if self._loaded.pop(adapter.request.lora_int_id, None) is None:
                return  # already going
            task = asyncio.ensure_future(self._unload(adapter))
            self._unloads.add(task)
            task.add_done_callback(self._unloads.discard)

    async def _unload(self, adapter: Adapter) -> None:
        try:
            await self._llm.remove_lora(adapter.request.lora_int_id)
        except Exception:  # noqa: BLE001 - the engine's log and ours have it; serving goes on
            logger.exception("unloading the adapter of policy_version %d failed", adapter.version)
        shutil.rmtree(adapter.folder, ignore_errors=True)
        logger.info("adapter of policy_version %d unloaded", adapter.version)

    def close(self) -> None:
        """Deletes every adapter folder (call once the engine has stopped)."""
        shutil.rmtree(self.root, ignore_errors=True)


def adapters_root(update_dir: str) -> str:
    """The folder of this server's adapters, under `update_dir`; the folders that servers no
    longer running left there (killed before their shutdown removed them) are deleted first."""
    remove_stale_adapter_folders(update_dir)
    return os.path.abspath(os.path.join(update_dir, f"{ADAPTERS_PREFIX}{os.getpid()}"))


def remove_stale_adapter_folders(update_dir: str) -> list[str]:
    """Deletes `update_dir`'s ADAPTERS_PREFIX<pid> folders whose process does not run (a PID
    reused by a running process keeps its folder: never one in use); returns them."""
    removed = []
    if not os.path.isdir(update_dir):
        return removed
    for name in os.listdir(update_dir):
        pid = name[len(ADAPTERS_PREFIX) :]
        if name.startswith(ADAPTERS_PREFIX) and pid.isdigit() and not pid_runs(pid):
            shutil.rmtree(os.path.join(update_dir, name), ignore_errors=True)
            removed.append(name)
    return removed

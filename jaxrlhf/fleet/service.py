"""Starting a generator service as a child process (`python -m generator_service`), as a user
would, when the config names no running one. Optional CPU affinity keeps it off the learner's
cores (on one machine, disjoint cores stand in for separate accelerators)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from jaxrlhf_wire import LORA_RANKS, READY_LINE  # READY_LINE: printed once serving

# The server reads this inherited pipe; it ends (EOF) when this process dies, however it dies,
# and the server then stops (no orphan servers). Unlike PR_SET_PDEATHSIG, which fires when the
# *thread* that started the child exits, a pipe follows the process: servers started from a
# short-lived thread (a restart) live on.
PARENT_FD_ENV = "JAXRLHF_PARENT_FD"


class ServerPopen(subprocess.Popen):
    """The server's process, owning our end of its lifeline pipe: the end is closed once the
    process is reaped (`wait` or `poll` saw it exit), however that came about, so that a
    replica killed and restarted (`process.kill(); process.wait()`) leaks no descriptor."""

    def __init__(self, *args, lifeline: int, **kwargs) -> None:
        self._lifeline, self._lifeline_lock = lifeline, threading.Lock()
        super().__init__(*args, **kwargs)

    def close_lifeline(self) -> None:
        """Closes our end (once, whichever thread comes first): the server then stops."""
        with self._lifeline_lock:
            fd, self._lifeline = self._lifeline, -1
        if fd >= 0:
            os.close(fd)

    def poll(self) -> int | None:
        code = super().poll()
        if code is not None:
            self.close_lifeline()
        return code

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        self.close_lifeline()
        return code


class StartCancelled(RuntimeError):
    """A generator start stopped half-way because its caller no longer needs it."""


@dataclasses.dataclass
class ServerProcess:
    process: ServerPopen
    address: str
    log_path: Path

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills it if it overstays)."""
        self.process.close_lifeline()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def engine_args(gen, lora_rank: int = 0) -> list[str]:
    """`python -m generator_service` options from a config's `generator` section, for a
    generator a run or an experiment starts itself. Swap mode "lora" (a LoRA run of
    `lora_rank`): `--max-lora-rank`, the smallest a server takes (`LORA_RANKS`) that holds it."""
    if gen.swap_mode == "lora":
        served = min(r for r in LORA_RANKS if r >= lora_rank)
        swaps = ["--max-lora-rank", str(served), "--no-preload"]
    else:
        swaps = ["--swap-mode", gen.swap_mode, "--in-flight-kv", gen.in_flight_kv,
                 "--preload" if gen.preload else "--no-preload"]  # fmt: skip
    return [
        "--dtype", gen.dtype, "--max-model-len", str(gen.max_model_len),
        "--seed", str(gen.seed), *swaps,
        *(["--max-num-seqs", str(gen.max_num_seqs)] if gen.max_num_seqs else []),
        *(["--cpu-reserved-cores", str(gen.cpu_reserved_cores)]
          if gen.cpu_reserved_cores >= 0 else []),
        *(["--engine-executor", gen.engine_executor] if gen.engine_executor else []),
    ]  # fmt: skip


def start_server(
    model_dir: str | Path,
    log_path: str | Path,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    cpus: Sequence[int] | None = None,
    timeout: float = 600.0,
    cancel: threading.Event | None = None,
) -> ServerProcess:
    """Starts the server on a free loopback port and waits until its engine serves. `cancel`
    set meanwhile (its caller failed): the server is stopped and StartCancelled raised."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "generator_service", "--model", str(model_dir), "--port", "0",
        *extra_args,
    ]  # fmt: skip
    if cpus:
        command = ["taskset", "-c", ",".join(str(c) for c in cpus), *command]
    repo_root = Path(__file__).resolve().parents[2]
    watched, lifeline = os.pipe()
    full_env = dict(os.environ, **(env or {}), **{PARENT_FD_ENV: str(watched)})
    try:
        with open(log_path, "w") as log:
            process = ServerPopen(
                command,
                lifeline=lifeline,
                cwd=repo_root,
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(watched,),
            )
    except BaseException:
        os.close(lifeline)
        raise
    finally:
        os.close(watched)
    server = ServerProcess(process, "", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(READY_LINE):
                server.address = line.split()[1]
                return server
        if process.poll() is not None:
            raise RuntimeError(
                f"generator server exited ({process.returncode}):\n{server.log_tail()}"
            )
        if cancel is not None and cancel.wait(0.5):
            server.terminate()
            raise StartCancelled("the generator's start was cancelled")
        if cancel is None:
            time.sleep(0.5)
    server.terminate()
    raise TimeoutError(f"generator server not ready in {timeout}s:\n{server.log_tail()}")

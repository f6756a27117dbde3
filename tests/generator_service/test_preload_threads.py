"""A preloaded swap on an engine whose worker runs more than one OpenMP thread (the default of runs
and experiments: `generator.cpu_reserved_cores` 0) serves exactly the weights it was sent.

The preload runs in a thread of its own with `--preload-threads` (1) threads, but processes each
module (on CPU: packs its weight into a oneDNN handler) under the worker's own thread count
(updates/worker_preload.py). A handler made under 1 thread and run under 2 gave outputs off by
~40 for a [192, 64] fp32 weight, every weight byte right: on the bed model (hidden 64, two
heads of 32: a qkv_proj of [192, 64]) the first run on a fresh generator trained on samples of
a broken policy (its sampler KL 8 after one update at lr 5e-6). The model here has those
shapes, and its engine 2 threads (`--engine-threads 2`: the suite's other engines compute on
one, JAXRLHF_ENGINE_THREADS, where the two counts agree); the reference is transformers on the
same weights. Before the fix, version 1's greedy tokens were wrong from the first.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import start_test_server, tiny_model
from tests.generator_service.test_update_weights import perturbed

PROMPTS = [[5, 6, 7, 8], [9, 10], [1, 20, 31, 17, 15, 3]]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_preloaded_swap_on_a_multithreaded_engine_serves_the_new_weights(tmp_path, own_generator):
    import torch
    import transformers
    from safetensors.numpy import load_file

    from jaxrlhf.fleet.rpc.client import GeneratorClient
    from tests.generator_service.conftest import Reference

    model = tiny_model(
        "llama", name="llama-qkv192", hidden_size=64, intermediate_size=256,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
    )  # fmt: skip
    served = load_file(str(model / "model.safetensors"))
    assert served["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)  # qkv: [192, 64]
    reference = Reference(
        transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    )
    server = start_test_server(
        model, tmp_path / "server.log", ["--engine-threads", "2", "--preload"]
    )
    try:
        with GeneratorClient(server.address) as client:
            assert client.status().preloaded_swaps
            # Generating first makes the engine run its oneDNN handlers (made at load, under
            # the worker's threads) before a preload makes new ones.
            for version, seed in ((0, None), (1, 3), (2, 4)):
                new = served if seed is None else perturbed(served, seed=seed)
                if version:
                    assert client.update_weights(new, version).policy_version == version
                completions = sorted(
                    client.generate(PROMPTS, max_tokens=12, temperature=0.0, ignore_eos=True),
                    key=lambda completion: completion.prompt_index,
                )
                got = [list(c.token_ids) for c in completions]
                want = [reference.greedy(new, prompt, 12) for prompt in PROMPTS]
                assert got == want, f"version {version} does not serve the weights it was sent"
                logprobs = [
                    reference.logprobs(new, prompt, list(c.token_ids), 1.0)
                    for prompt, c in zip(PROMPTS, completions, strict=True)
                ]
                served_logprobs = [np.asarray(c.logprobs) for c in completions]
                for mine, theirs in zip(served_logprobs, logprobs, strict=True):
                    np.testing.assert_allclose(mine, theirs, atol=1e-3)
        assert "preloaded in" in server.log_path.read_text()
    finally:
        server.terminate()

"""Parity on the real SmolLM2-135M-Instruct (30 layers, GQA 9/3, tied embeddings)."""

import numpy as np
import pytest
import torch
import transformers

from jaxrlhf.models import load_pretrained, token_logprobs
from tests.models.test_parity import hf_forward, hf_token_logprobs, padded_batch


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    model, params = load_pretrained(smollm2)
    assert (model.config.num_layers, model.config.num_kv_heads) == (30, 3)
    ids, mask = padded_batch(model.config.vocab_size, seed=4)
    ref32 = hf_forward(
        transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval(),
        ids,
        mask,
    )
    ref64 = hf_forward(
        transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float64).eval(),
        ids,
        mask,
    )
    ours = np.asarray(model.apply({"params": params}, ids, mask))
    real = mask.astype(bool)
    # Measured here: max |Δ logit| vs fp64 is ~1.5e-3 for us and ~4e-4 for torch fp32 (logits up
    # to ~35; SmolLM2's massive first-token activations amplify fp32 rounding over 30 layers).
    # The tiny-config tests hold the 1e-4 bar; here we bound the gap to the fp64 truth.
    assert np.abs(ours - ref64)[real].max() <= 3e-3
    assert np.abs(ours - ref64)[real].mean() <= 1e-4
    lp = np.asarray(token_logprobs(model, params, ids, mask))
    scored = real[:, 1:] & real[:, :-1]
    lp_err = np.abs(lp - hf_token_logprobs(ref64, ids))[scored]
    torch_err = np.abs(hf_token_logprobs(ref32, ids) - hf_token_logprobs(ref64, ids))[scored]
    assert lp_err.max() <= 2e-4
    assert lp_err.mean() <= 3 * torch_err.mean()

"""Flax models against transformers (fp32) on tiny random configs, on padded batches."""

import numpy as np
import pytest
import torch
import transformers

from jaxrlhf.models import load_pretrained, read_config, save_pretrained, token_logprobs
from tests.conftest import tiny_model

ARCHS = ["llama", "llama3", "qwen2", "gpt_neox", "gpt_neox_seq"]
TOL = 1e-4


def padded_batch(vocab_size: int, seed: int = 0):
    """Rows: full, left-padded (a prompt), right-padded (a response), both."""
    rng = np.random.default_rng(seed)
    batch, length = 4, 24
    ids = rng.integers(3, vocab_size, (batch, length))
    mask = np.ones((batch, length), np.int32)
    mask[1, :7] = 0
    mask[2, -5:] = 0
    mask[3, :3] = 0
    mask[3, -6:] = 0
    ids = np.where(mask == 1, ids, 0)
    return ids, mask


def hf_forward(model, ids, mask):
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.numpy()


def hf_token_logprobs(logits, ids):
    logp = torch.log_softmax(torch.tensor(logits[:, :-1], dtype=torch.float64), -1).numpy()
    return np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_logprobs_match_transformers(arch):
    path = tiny_model(arch)
    model, params = load_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask = padded_batch(model.config.vocab_size)
    ours = np.asarray(model.apply({"params": params}, ids, mask))
    ref = hf_forward(hf, ids, mask)
    real = mask.astype(bool)
    assert np.abs(ours - ref)[real].max() <= TOL
    # The comparison is meaningful: logits vary by far more than the tolerance.
    assert np.std(ref[real]) > 0.1
    lp = np.asarray(token_logprobs(model, params, ids, mask))
    ref_lp = hf_token_logprobs(ref, ids)
    scored = real[:, 1:] & real[:, :-1]
    assert lp.shape == (4, 23)
    assert np.abs(lp - ref_lp)[scored].max() <= TOL
    assert np.all(lp[~real[:, 1:]] == 0.0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_blocked_contraction_is_the_same_model(arch):
    """`contraction_block` changes only the summation order of every matmul (and the LM head)."""
    path = tiny_model(arch)
    model, params = load_pretrained(path)
    blocked, _ = load_pretrained(path, contraction_block=8)
    assert blocked.config.contraction_block == 8
    ids, mask = padded_batch(model.config.vocab_size)
    ours = np.asarray(blocked.apply({"params": params}, ids, mask))
    plain = np.asarray(model.apply({"params": params}, ids, mask))
    ref = hf_forward(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
        ids,
        mask,
    )
    real = mask.astype(bool)
    assert np.abs(ours - ref)[real].max() <= TOL
    assert 0 < np.abs(ours - plain)[real].max() <= 1e-5  # a different order, the same sums


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_padding_does_not_change_real_tokens(arch):
    model, params = load_pretrained(tiny_model(arch))
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, model.config.vocab_size, 9)
    unpadded = np.asarray(model.apply({"params": params}, prompt[None], np.ones((1, 9), np.int32)))
    ids = np.zeros((1, 16), np.int64)
    mask = np.zeros((1, 16), np.int32)
    ids[0, 4:13] = prompt  # 4 left pads, 3 right pads
    mask[0, 4:13] = 1
    padded = np.asarray(model.apply({"params": params}, ids, mask))
    np.testing.assert_allclose(padded[0, 4:13], unpadded[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_score_head_matches_sequence_classification(arch):
    path = tiny_model(arch, name=f"{arch}-score", sequence_classification=True)
    model, params = load_pretrained(path)
    assert model.config.head == "score"
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    rng = np.random.default_rng(2)
    ids = rng.integers(3, model.config.vocab_size, (3, 12))
    mask = np.ones_like(ids, dtype=np.int32)
    mask[1, -4:] = 0  # right padding: HF scores the last non-pad token
    ids = np.where(mask == 1, ids, hf.config.pad_token_id)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    scores = np.asarray(model.apply({"params": params}, ids, mask))
    last = mask.sum(-1) - 1
    ours = scores[np.arange(3), last]
    np.testing.assert_allclose(ours, ref[:, 0], atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama3", "gpt_neox"])
def test_export_reloads_in_transformers(arch, tmp_path):
    model, params = load_pretrained(tiny_model(arch))
    # Sharded export (several files + index) to cover that path too.
    out = save_pretrained(
        model, params, tmp_path / "export", tokenizer_from=tiny_model(arch), max_shard_bytes=64_000
    )
    assert (out / "model.safetensors.index.json").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, mask = padded_batch(model.config.vocab_size, seed=3)
    ours = np.asarray(model.apply({"params": params}, ids, mask))
    ref = hf_forward(hf, ids, mask)
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= TOL
    reloaded_model, reloaded = load_pretrained(out)
    assert reloaded_model.config == model.config
    np.testing.assert_array_equal(
        np.asarray(reloaded["layers"]["attn"]["o_proj"]["kernel"]),
        np.asarray(params["layers"]["attn"]["o_proj"]["kernel"]),
    )
    transformers.AutoTokenizer.from_pretrained(out)


def test_bfloat16_export_and_load(tmp_path):
    model, params = load_pretrained(tiny_model("llama"), dtype="bfloat16")
    assert params["embedding"].dtype == np.dtype("bfloat16")
    out = save_pretrained(model, params, tmp_path / "bf16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert hf.dtype == torch.bfloat16
    assert read_config(out).tie_word_embeddings


def test_bad_checkpoint_errors_name_the_problem(tmp_path):
    src = tiny_model("llama")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path)
    model, params = load_pretrained(src)
    params["layers"]["mlp"]["up_proj"]["kernel"] = params["layers"]["mlp"]["up_proj"]["kernel"][
        :, :, :100
    ]
    bad = save_pretrained(model, params, tmp_path / "bad")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape"):
        load_pretrained(bad)


@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_bfloat16_forward_matches_transformers_bfloat16(param_dtype):
    """bfloat16 compute (on bfloat16 or float32 master weights) against transformers' bfloat16
    model: within bfloat16's own tolerance, the gap between transformers bf16 and fp32."""
    path = tiny_model("llama")
    model, params = load_pretrained(path, dtype="bfloat16", param_dtype=param_dtype)
    ids, mask = padded_batch(model.config.vocab_size)
    ours = np.asarray(model.apply({"params": params}, ids, mask), np.float32)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref16 = _bf16_logits(hf16, ids, mask)
    ref32 = hf_forward(hf32, ids, mask)
    real = mask.astype(bool)
    bf16_noise = np.abs(ref16 - ref32)[real].max()  # transformers' own bf16 error
    assert bf16_noise > 1e-3  # bfloat16 rounding is visible at this scale
    assert np.abs(ours - ref16)[real].max() <= 2 * bf16_noise
    assert np.abs(ours - ref32)[real].mean() <= 2 * np.abs(ref16 - ref32)[real].mean()


def _bf16_logits(model, ids, mask):
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions))  # fmt: skip
    return out.logits.float().numpy()

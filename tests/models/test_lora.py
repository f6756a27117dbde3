"""LoRA adapters on the Flax models (`jaxrlhf.models.lora`) against transformers with `peft`,
fp32, on the tiny random Llama: a new adapter is the base model; an adapter with random
factors, saved in PEFT's layout, gives the logits of `peft.PeftModel` on the same base; an
adapter made by peft loads back to the same logits; the merged model equals both."""

import numpy as np
import pytest
import torch
import transformers

from jaxrlhf.models import load_pretrained, save_pretrained
from jaxrlhf.models import lora as lora_lib
from tests.conftest import tiny_model
from tests.models.test_parity import TOL, hf_forward, padded_batch

peft = pytest.importorskip("peft")


def _randomized(tree, rng):
    """`tree` with every array replaced by random values (B = 0 would hide an error in B's
    layout)."""
    if isinstance(tree, dict):
        return {k: _randomized(v, rng) for k, v in tree.items()}
    return (rng.standard_normal(tree.shape) * 0.1).astype(tree.dtype)


def peft_logits(path, adapter_folder, ids, mask):
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, str(adapter_folder)).eval()
    return hf_forward(model, ids, mask)


def test_a_new_adapter_is_the_base_model():
    base, params = load_pretrained(tiny_model("llama"))
    model = lora_lib.with_lora(base, rank=4, alpha=8.0)
    adapter = lora_lib.init_adapter(model, seed=0)
    ids, mask = padded_batch(base.config.vocab_size)
    ours = np.asarray(model.apply({"params": lora_lib.merge(adapter, params)}, ids, mask))
    plain = np.asarray(base.apply({"params": params}, ids, mask))
    assert np.array_equal(ours, plain)
    # A is really random (U(±1/√fan_in)) and B zero, as PEFT starts them.
    a = adapter["layers"]["attn"]["q_proj"]["lora_a"]
    bound = 1 / np.sqrt(base.config.hidden_size)
    assert a.std() > 0.3 * bound and np.abs(a).max() <= bound
    assert not np.any(adapter["layers"]["mlp"]["down_proj"]["lora_b"])


@pytest.mark.parametrize(
    ("targets", "rank", "alpha"),
    [(lora_lib.TARGETS, 4, 8.0), (("q_proj", "v_proj"), 2, 3.0), (("o_proj", "down_proj"), 3, 1.5)],
)
def test_a_saved_adapter_gives_peft_s_logits(tmp_path, targets, rank, alpha):
    path = tiny_model("llama")
    base, params = load_pretrained(path)
    model = lora_lib.with_lora(base, rank, alpha, targets)
    adapter = _randomized(lora_lib.init_adapter(model), np.random.default_rng(rank))
    folder = lora_lib.save_adapter(model, adapter, tmp_path / "adapter", base_name=str(path))
    ids, mask = padded_batch(base.config.vocab_size)
    ours = np.asarray(model.apply({"params": lora_lib.merge(adapter, params)}, ids, mask))
    ref = peft_logits(path, folder, ids, mask)
    plain = hf_forward(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
        ids, mask,
    )  # fmt: skip
    real = mask.astype(bool)
    assert np.abs(ours - ref)[real].max() <= TOL
    # The comparison is meaningful: the adapter moves the logits by far more than the tolerance.
    assert np.abs(ref - plain)[real].max() > 100 * TOL
    # Loaded back from the folder, the same model and adapter.
    loaded, again = lora_lib.load_adapter(base, folder)
    assert loaded.config == model.config
    again_logits = np.asarray(loaded.apply({"params": lora_lib.merge(again, params)}, ids, mask))
    assert np.array_equal(again_logits, ours)


def test_an_adapter_made_by_peft_loads_to_its_logits(tmp_path):
    path = tiny_model("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = peft.LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "k_proj", "up_proj"],
                             lora_dropout=0.0, init_lora_weights=False)  # fmt: skip
    made = peft.get_peft_model(hf, config).eval()  # random A and B
    made.save_pretrained(tmp_path / "made")
    ids, mask = padded_batch(hf.config.vocab_size, seed=1)
    ref = hf_forward(made, ids, mask)
    base, params = load_pretrained(path)
    model, adapter = lora_lib.load_adapter(base, tmp_path / "made")
    assert model.config.lora_targets == ("q_proj", "k_proj", "up_proj")
    ours = np.asarray(model.apply({"params": lora_lib.merge(adapter, params)}, ids, mask))
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= TOL


def test_the_merged_model_is_the_adapted_one(tmp_path):
    path = tiny_model("llama")
    base, params = load_pretrained(path)
    model = lora_lib.with_lora(base, 4, 8.0)
    adapter = _randomized(lora_lib.init_adapter(model), np.random.default_rng(7))
    full = lora_lib.merge(adapter, params)
    merged = lora_lib.merged(model.config, full)
    save_pretrained(base, merged, tmp_path / "merged")
    ids, mask = padded_batch(base.config.vocab_size, seed=2)
    ours = np.asarray(model.apply({"params": full}, ids, mask))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    ref = hf_forward(hf.eval(), ids, mask)
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= TOL


def test_bad_settings_and_adapters_are_refused_by_name(tmp_path):
    base, _ = load_pretrained(tiny_model("llama"))
    with pytest.raises(ValueError, match="rank 0"):
        lora_lib.with_lora(base, 0, 8.0)
    with pytest.raises(ValueError, match="qkv_proj is none"):
        lora_lib.with_lora(base, 4, 8.0, ("q_proj", "qkv_proj"))
    with pytest.raises(ValueError, match="not gpt_neox"):
        lora_lib.with_lora(load_pretrained(tiny_model("gpt_neox"))[0], 4, 8.0)
    model = lora_lib.with_lora(base, 4, 8.0, ("q_proj",))
    folder = lora_lib.save_adapter(model, lora_lib.init_adapter(model), tmp_path / "a")
    other, _ = load_pretrained(tiny_model("llama", name="llama-wide", hidden_size=96))
    with pytest.raises(ValueError, match="lora_A.weight has shape"):
        lora_lib.load_adapter(other, folder)


def test_vllm_s_own_adapter_loader_reads_a_saved_adapter(tmp_path):
    """The loader behind vLLM's `--lora-modules` and `LoRARequest(lora_path=...)`
    (`PEFTHelper.from_local_dir`, `LoRAModel.from_local_checkpoint`, as its worker calls them)
    takes the folder `save_adapter` writes (the `hf_export/adapter/` of a LoRA run): every
    factor, with PEFT's scaling alpha / r, and no module it does not expect."""
    lora_model = pytest.importorskip("vllm.lora.lora_model")
    from vllm.config.lora import LoRAConfig
    from vllm.lora.peft_helper import PEFTHelper

    path = tiny_model("llama")
    base, _ = load_pretrained(path)
    targets = ("q_proj", "v_proj", "down_proj")
    model = lora_lib.with_lora(base, 4, 6.0, targets)
    adapter = _randomized(lora_lib.init_adapter(model), np.random.default_rng(3))
    folder = lora_lib.save_adapter(model, adapter, tmp_path / "adapter", base_name=str(path))
    helper = PEFTHelper.from_local_dir(str(folder), max_position_embeddings=None)
    helper.validate_legal(LoRAConfig(max_lora_rank=8))
    loaded = lora_model.LoRAModel.from_local_checkpoint(
        str(folder), set(targets), helper, lora_model_id=1, device="cpu", dtype=torch.float32
    )
    ours = lora_lib.adapter_tensors(model.config, adapter)
    layers = base.config.num_layers
    assert len(loaded.loras) == layers * len(targets)
    for name, weights in loaded.loras.items():  # "model.layers.{i}.{block}.{target}"
        prefix = f"base_model.model.{name}"
        # vLLM stores A and B as PEFT does, the scaling kept apart: alpha / r.
        np.testing.assert_array_equal(weights.lora_a.numpy(), ours[f"{prefix}.lora_A.weight"])
        np.testing.assert_array_equal(weights.lora_b.numpy(), ours[f"{prefix}.lora_B.weight"])
        assert weights.scaling == pytest.approx(6.0 / 4)
    # A target the served model would not expect is refused by the same loader.
    with pytest.raises(ValueError, match="expected target modules"):
        lora_model.LoRAModel.from_local_checkpoint(
            str(folder), {"q_proj", "v_proj"}, helper, lora_model_id=2, device="cpu"
        )

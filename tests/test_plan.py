"""`python -m jaxrlhf.plan`: the memory plan of every recipe stage, from abstract shapes.

The paper's configs must fit the hardware their docstrings name (8 x 80 GB for No Robots'
Llama 3.1 8B, one 80 GB GPU for TL;DR's Pythia 1B and GSM8k's Rho-1B), and the plan must be
able to say no: the No Robots step without micro-batches and chunked log-probs (the whole
512 x 2048-token batch and its [rows, T, 128k] logits at once) does not fit.
"""

import json
import os
import subprocess
import sys

import pytest

from configs import gsm8k, nobots, tldr
from jaxrlhf.config import resolve, validate
from jaxrlhf.plan import GIB, plan
from tests.conftest import REPO

RECIPE_STAGES = [(module, stage) for module in (tldr, nobots) for stage in ("sft", "reward", "")]
RECIPE_STAGES += [(gsm8k, "sft"), (gsm8k, "")]


def run_plan(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    result = subprocess.run([sys.executable, "-m", "jaxrlhf.plan", *args], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


@pytest.mark.slow  # compiles every program of a recipe stage: over a minute on 2 cores
def test_cli_prints_the_plan_and_a_json_last_line():
    lines = run_plan("--config=configs/tiny.py")
    result = json.loads(lines[-1])
    assert result["devices"] == 1 and result["device_memory_bytes"] == 24 * GIB  # config.hardware
    sizes = result["per_device_bytes"]
    assert {"parameters", "optimizer_state", "train_step_temporaries", "total"} <= set(sizes)
    assert sizes["optimizer_state"] == pytest.approx(2 * sizes["parameters"], rel=0.01)  # Adam
    assert result["fits"] is True and set(result["programs"]) == {
        "train_step",
        "reference_logprobs",
    }
    assert any("peak (train_step)" in line for line in lines)
    tiny_memory = json.loads(run_plan("--config=configs/tiny.py", "--device_memory_gib=0.001",
                                      "--devices=2")[-1])  # fmt: skip
    assert tiny_memory["fits"] is False and tiny_memory["devices"] == 2


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "stage"),
    RECIPE_STAGES,
    ids=[f"{m.__name__.split('.')[-1]}:{s or 'rlhf'}" for m, s in RECIPE_STAGES],
)
def test_recipe_stage_fits_its_hardware(module, stage):
    config = module.get_config(stage)
    validate(resolve(config))
    hardware = config.hardware
    result = plan(config, hardware.devices, int(hardware.device_memory_gib * GIB))
    assert result["fits"], result["per_device_bytes"]
    # The optimizer state is Adam's two float32 moments of float32 master weights.
    sizes = result["per_device_bytes"]
    assert sizes["optimizer_state"] == pytest.approx(2 * sizes["parameters"], rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("module", [tldr, nobots])
def test_rlhf_with_the_whole_batch_in_one_step_does_not_fit(module):
    whole = 2 * module.get_config().rollout.prompts_per_batch  # pairs: 2 sequences each
    name = module.__name__.split(".")[-1]
    result = json.loads(run_plan(f"--config=configs/{name}.py",
                                 f"--config.train.micro_batch_size={whole}")[-1])  # fmt: skip
    assert result["micro_batches"] == 1 and not result["fits"]
    if module is not nobots:
        return
    config = nobots.get_config()
    config.train.micro_batch_size = 0
    config.model.logprob_chunk = 0  # and the full [rows, T, vocab] logits too: ~3x over
    assert plan(config, 8, 80 * GIB)["per_device_bytes"]["total"] > 2 * 80 * GIB


@pytest.mark.slow  # compiles the tiny stage's programs twice: a minute on 2 cores
def test_a_lora_plan_holds_the_adapters_and_their_optimizer_alone():
    """`model.lora.rank` > 0: the plan's parameters are the adapters' (rank x (in + out) for
    each target of each layer, counted here from the model's shape), the optimizer state their
    two moments, the frozen models the base once in the compute dtype (it is the reference
    too); the train step takes the base as an argument. Every figure falls below full
    fine-tuning's."""
    from configs import tiny

    full_config = tiny.get_config()
    validate(resolve(full_config))
    lora_config = tiny.get_config()
    lora_config.model.lora.rank = 8
    validate(resolve(lora_config))
    full = plan(full_config, 1, 24 * GIB)["per_device_bytes"]
    lora = plan(lora_config, 1, 24 * GIB)
    sizes = lora["per_device_bytes"]
    shape = lora_shape(full_config)
    adapter = 8 * shape["layers"] * sum(shape["sides"].values())
    assert sizes["parameters"] == adapter * 4  # float32 master weights
    assert sizes["optimizer_state"] == pytest.approx(2 * adapter * 4, rel=0.01)
    assert sizes["frozen_models"] == full["frozen_models"]  # the base, as the reference was
    assert set(lora["programs"]) == {"train_step", "reference_logprobs"}
    for key in ("parameters", "optimizer_state", "train_step_temporaries", "total"):
        assert sizes[key] < full[key], key


def lora_shape(config) -> dict:
    """The policy's layers and, per LoRA target, in + out features (its known architecture)."""
    from jaxrlhf.models.known import architecture_of

    model = architecture_of(config.model.path, "lm")
    heads, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    hidden, inter = model.hidden_size, model.intermediate_size
    sides = {"q_proj": hidden + heads, "k_proj": hidden + kv, "v_proj": hidden + kv,
             "o_proj": heads + hidden, "gate_proj": hidden + inter, "up_proj": hidden + inter,
             "down_proj": inter + hidden}  # fmt: skip
    return {"layers": model.num_layers, "sides": sides}

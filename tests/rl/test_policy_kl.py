"""The KL of the served policy from the reference on its own samples of held-out prompts
(`eval.kl_prompts`: metrics.jsonl policy_kl, summary.json policy_kl_end), on the real loop with
the in-process `JaxGenerator` (its log-probs are the sampled distribution's, as vLLM's)."""

from __future__ import annotations

import json
import math

import pytest
import transformers

from jaxrlhf.rl.trainer import run_rlhf
from tests.rl.jax_generator import JaxGenerator
from tests.rl.test_learning import learning_config, target_task


def run(model_dir, output_dir, learning_rate: float):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    generator = JaxGenerator(model_dir, tokenizer.eos_token_id, tokenizer.pad_token_id)
    config = learning_config(output_dir, "online_dpo", 4, learning_rate, beta=0.1)
    config.eval.every, config.eval.kl_prompts, config.eval.at_end = 2, 8, True
    config.eval.test = False
    run_rlhf(config, model_dir, target_task(tokenizer), generator, lambda message: None)
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").open()]
    summary = json.loads((output_dir / "summary.json").read_text())
    return [r["policy_kl"] for r in records if "policy_kl" in r], summary["policy_kl_end"]


@pytest.mark.slow  # two runs of the loop end to end: about a minute on 2 cores
def test_policy_kl_is_zero_while_the_policy_is_the_reference_and_grows_as_it_learns(
    tiny_llama, tmp_path
):
    # Learning rate 0: the served policy is the reference, so every sample's Σ_t log π − log
    # π_ref is 0 up to float error (a misaligned token, a wrong temperature would not be).
    during, end = run(tiny_llama, tmp_path / "still", 0.0)
    assert len(during) == 1 and all(abs(kl) < 1e-3 for kl in [*during, end]), (during, end)
    # A real learning rate moves the policy away: a positive KL, larger at the end.
    during, end = run(tiny_llama, tmp_path / "moving", 3e-3)
    assert math.isfinite(end) and end > max(0.01, during[0]), (during, end)

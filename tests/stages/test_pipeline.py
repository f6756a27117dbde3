"""The whole recipe on the toy fixture: SFT -> reward model -> Online DPO -> evaluate.

Tiny Llama, toy No Robots-layout data (tests/fixtures/data/toy_pref: "What is a + b?" with a
polite right answer chosen over a rude wrong one), the suite's shared vLLM generator service.
Each stage starts from the previous stage's output dir, as a user chains them.
"""

import json
import math

import pytest

from configs.tiny import get_config as tiny_config
from jaxrlhf.evaluate import evaluate, find_step_dir
from jaxrlhf.models.paths import resolve_model
from jaxrlhf.stages import reward, rlhf, sft
from tests.conftest import REPO

TOY = str(REPO / "tests" / "fixtures" / "data" / "toy_pref")


def toy_config(stage, out, model):
    config = tiny_config()
    config.stage, config.output_dir, config.model.path = stage, str(out), str(model)
    config.task.name = "nobots"
    config.task.source = config.task.preference_source = TOY
    # Validation: a quarter of the 64 train rows, carved by hash (No Robots has no validation
    # split); the fixture's test split is for evaluate.
    config.task.num_train = config.task.num_eval = 0
    config.task.validation_fraction = 0.25
    config.train.max_length = 40
    config.train.batch_size = 16
    config.checkpoint.every = 1000
    return config


@pytest.fixture(scope="module")
def chain(tiny_llama, generator_address, tmp_path_factory):
    root = tmp_path_factory.mktemp("chain")
    log = lambda message: None  # noqa: E731

    config = toy_config("sft", root / "sft", tiny_llama)
    config.total_steps, config.train.learning_rate = 24, 3e-3
    sft_summary = sft.run(config, resolve_model(config.model.path), log)

    config = toy_config("reward", root / "rm", root / "sft")
    config.total_steps, config.train.learning_rate, config.train.batch_size = 24, 1e-3, 8
    rm_summary = reward.run(config, resolve_model(config.model.path), log)

    config = toy_config("rlhf", root / "dpo", root / "sft")
    config.task.reward_model = str(root / "rm")
    config.generator.addresses = generator_address
    config.total_steps = 3
    config.rollout.max_prompt_tokens, config.rollout.max_response_tokens = 32, 12
    rl_summary = rlhf.run(config, resolve_model(config.model.path), log)

    config.eval.gold_reward_model = str(root / "rm")
    config.eval.sft_model = str(root / "sft")
    report = evaluate(config, find_step_dir(root / "dpo"), root / "eval", log)
    return root, sft_summary, rm_summary, rl_summary, report


def test_sft_stage_learns_and_exports(chain):
    root, sft_summary, *_ = chain
    assert sft_summary["eval_nll_end"] < 0.5 * sft_summary["eval_nll_start"]
    assert (root / "sft" / "hf_export" / "model.safetensors").exists()
    assert find_step_dir(root / "sft").name == "24"  # an Orbax checkpoint of the last step


def test_reward_model_beats_chance_on_held_out_pairs(chain):
    root, _, rm_summary, *_ = chain
    # 14 validation pairs; chance is 0.5.
    assert rm_summary["eval_accuracy_end"] >= 0.9, rm_summary
    assert rm_summary["eval_loss_end"] < rm_summary["eval_loss_start"]
    config = json.loads((root / "rm" / "hf_export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]


def test_online_dpo_runs_on_the_reward_model(chain):
    root, *_, rl_summary, _ = chain
    assert rl_summary["steps"] == 3
    assert math.isfinite(rl_summary["eval_reward_start"])
    assert math.isfinite(rl_summary["eval_reward_end"])
    metrics = [json.loads(x) for x in (root / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(math.isfinite(m["reward_mean"]) for m in metrics)
    assert (root / "dpo" / "training.png").stat().st_size > 0


def test_evaluation_report_of_the_dpo_checkpoint(chain):
    root, *_, report = chain
    assert report["num_prompts"] == 32 and report["split"] == "test"  # the fixture's test rows
    assert 0.0 <= report["win_rate"] <= 1.0
    assert math.isfinite(report["sft_perplexity"]) and report["sft_perplexity"] >= 1.0
    assert 1 <= report["response_length_mean"] <= 12
    samples = [json.loads(x) for x in (root / "eval" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 32 and {"response", "reference", "policy_score"} <= set(samples[0])
    assert json.loads((root / "eval" / "report.json").read_text()) == report

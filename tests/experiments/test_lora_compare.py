"""Claims lora-compare and lora-smollm2-compare (LoRA at its own learning rate against full
fine-tuning, on test, on the bed and on SmolLM2's default task): their rates are their tunings'
recorded choices; their plans run both arms at them on their own seeds; the rule is (a)'s
equivalence rule for one comparison, by hand on hand-written runs."""

from __future__ import annotations

import json

import pytest

from jaxrlhf.experiments.claims import lora_smollm2_compare as smollm2
from jaxrlhf.experiments.claims.claim_registry import claim
from jaxrlhf.experiments.claims.lora_compare import CHOSEN, COMPARISON, RULE
from jaxrlhf.experiments.claims.lora_tuning import ARMS
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.claims.verdicts import analyse
from tests.conftest import REPO
from tests.experiments.test_claims import write_run


def test_the_rates_are_lora_tuning_s_recorded_choices():
    record = json.loads((REPO / "results/claims/lora-tuning/claim.json").read_text())
    assert record["verdict"]["word"] == "tuned"
    assert {k: c["learning_rate"] for k, c in record["chosen"].items()} == CHOSEN


def test_the_plan_runs_both_arms_at_their_rates_with_the_test_split(tmp_path):
    spec = claim("lora-compare")
    assert spec.defaults == {"seeds": "510-519"} and spec.registration == RULE
    runs = spec.plan(Settings(seeds=(510, 511)), tmp_path)
    assert [run.labels["arm"] for run in runs] == ["full", "lora"] * 2
    for run in runs:
        kind = run.labels["kind"]
        assert run.overrides["train.learning_rate"] == CHOSEN[kind]
        assert run.overrides["eval.test"] is True
        assert all(run.overrides[k] == v for k, v in ARMS[kind].items())


@pytest.mark.parametrize(
    ("offsets", "word"),
    [((-0.5, 0.5, 0.0), "supported"),  # mean 0, interval well inside ±2
     ((-4.0, -5.0, -4.5), "contradicted"),  # wholly below −2, beyond noise
     ((-1.0, -3.0, 1.0), "unresolved at this power")],  # wide, crosses −2
)  # fmt: skip
def test_lora_is_judged_against_the_2_point_margin(tmp_path, offsets, word):
    settings = Settings(seeds=(0, 1, 2), steps=4, eval_every=2)
    runs = claim("lora-compare").plan(settings, tmp_path)
    for run in runs:
        seed = run.labels["seed"]
        full = 0.6 + 0.05 * seed
        offset = offsets[seed] / 100 if run.labels["kind"] == "lora" else 0.0
        write_run(run.folder, full + offset)
    record = analyse("lora-compare", runs, settings)
    (comparison,) = record["comparisons"]
    assert comparison["name"] == COMPARISON == RULE["families"]["LoRA against full fine-tuning"][0]
    assert comparison["mean"] == pytest.approx(sum(offsets) / 3)
    assert record["verdict"]["word"] == word


def test_configs_bed_lora_is_the_compared_lora_arm():
    """configs/bed_lora.py (the README's LoRA line) runs the bed as lora-compare's LoRA arm."""
    from jaxrlhf.config import validate
    from jaxrlhf.experiments import load_config
    from jaxrlhf.experiments.claims.lora_tuning import RANK

    bed = load_config(REPO / "configs" / "bed.py", {})
    config = load_config(REPO / "configs" / "bed_lora.py", {})
    validate(config)
    assert config.model.lora.rank == RANK and config.generator.swap_mode == "lora"
    assert config.train.learning_rate == CHOSEN["lora"]
    differs = {k for k in config.to_dict() if config[k] != bed[k]}
    assert differs == {"model", "train", "generator", "output_dir"}


def test_the_smollm2_rates_are_lora_smollm2_tuning_s_recorded_choices():
    record = json.loads((REPO / "results/claims/lora-smollm2-tuning/claim.json").read_text())
    assert record["verdict"]["word"] == "tuned"
    assert {k: c["learning_rate"] for k, c in record["chosen"].items()} == smollm2.CHOSEN


def test_the_smollm2_comparison_runs_the_default_task_on_its_whole_test_split(tmp_path):
    spec = claim("lora-smollm2-compare")
    assert spec.config == "default.py" and spec.registration == smollm2.RULE
    assert spec.rule is claim("lora-compare").rule
    assert spec.defaults == {"seeds": "720-729", "steps": 8, "eval_every": 8}
    runs = spec.plan(Settings(seeds=(720, 721), steps=8, eval_every=8), tmp_path)
    assert [run.labels["arm"] for run in runs] == ["full", "lora"] * 2
    for run in runs:
        kind = run.labels["kind"]
        assert run.overrides["train.learning_rate"] == smollm2.CHOSEN[kind]
        assert run.overrides["eval.test"] is True and run.overrides["task.num_test"] == 0
        assert run.overrides["model.path"] == "smollm2" and run.overrides["total_steps"] == 8
        assert all(run.overrides[k] == v for k, v in ARMS[kind].items())

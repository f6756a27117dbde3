"""Claim lora-tuning (the learning rates of LoRA and of full fine-tuning, on validation): its
plan runs each arm's grid with the test split off, LoRA's runs publishing adapters to a LoRA
generator; its record chooses per arm by the registered rule on hand-written runs."""

from __future__ import annotations

import pytest

from jaxrlhf.experiments.claims.claim_registry import claim
from jaxrlhf.experiments.claims.lora_tuning import GRID, RANK
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.claims.verdicts import analyse
from tests.experiments.test_claims import write_run

SETTINGS = Settings(seeds=(500, 501), steps=64, eval_every=16)


def test_the_plan_runs_each_arm_s_grid_on_validation_alone(tmp_path):
    from jaxrlhf.experiments.claims.lora_tuning import SEEDS

    assert claim("lora-tuning").defaults["seeds"] == SEEDS == "500-501"  # apart from the others
    runs = claim("lora-tuning").plan(SETTINGS, tmp_path)
    assert len(runs) == 2 * (len(GRID["full"]) + len(GRID["lora"]))
    for run in runs:
        assert run.overrides["eval.test"] is False and run.overrides["eval.test_every"] == 0
        lora = run.labels["kind"] == "lora"
        assert run.overrides["train.learning_rate"] in GRID[run.labels["kind"]]
        settings = (run.overrides.get("model.lora.rank"), run.overrides.get("generator.swap_mode"))
        assert settings == ((RANK, "lora") if lora else (None, None))


def test_each_arm_chooses_its_best_rate_on_validation_and_names_an_edge(tmp_path):
    """By hand: full's middle rate wins (70 against 60 and 65); LoRA's top rate ties with
    the middle one on the mean (72): the tie goes to the smaller, which is not an edge."""
    runs = claim("lora-tuning").plan(SETTINGS, tmp_path)
    validation = {
        "full/lr5e-06": (60, 60), "full/lr1.5e-05": (69, 71), "full/lr4.5e-05": (65, 65),
        "lora/lr5e-05": (50, 52), "lora/lr0.00015": (71, 73), "lora/lr0.00045": (72, 72),
    }  # fmt: skip
    for run in runs:
        value = validation[run.labels["arm"]][run.labels["seed"] - 500]
        write_run(run.folder, test=0.0, validation=value / 100)
    record = analyse("lora-tuning", runs, SETTINGS)
    chosen = record["chosen"]
    assert chosen["full"]["learning_rate"] == 1.5e-5 and not chosen["full"]["grid_edge"]
    assert chosen["full"]["validation"] == pytest.approx(70.0)
    assert chosen["lora"]["learning_rate"] == 1.5e-4 and not chosen["lora"]["grid_edge"]
    assert record["verdict"]["word"] == "tuned"
    # With LoRA's top rate alone best, the choice says it sits at the edge of its grid.
    for run in runs:
        if run.labels["arm"] == "lora/lr0.00045":
            write_run(run.folder, test=0.0, validation=0.8)
    record = analyse("lora-tuning", runs, SETTINGS)
    assert record["chosen"]["lora"]["grid_edge"]
    assert "edge of its grid" in record["verdict"]["detail"]


def test_the_smollm2_tuning_runs_its_own_grid_on_the_default_task(tmp_path):
    """lora-smollm2-tuning: lora-tuning's arms and rule on configs/default.py, its own grid
    (LoRA at 10x, 30x and 100x the default's 1e-5), seeds and 8 updates, the whole validation
    split; its choice by hand."""
    from jaxrlhf.experiments.claims import lora_smollm2

    spec = claim("lora-smollm2-tuning")
    assert spec.config == "default.py" and spec.defaults["steps"] == 8
    assert spec.defaults["seeds"] == "710-711"
    assert spec.registration["params"]["grid"] == {"full": [3e-6, 1e-5, 3e-5],
                                                   "lora": [1e-4, 3e-4, 1e-3]}  # fmt: skip
    settings = Settings(seeds=(710, 711), steps=8, eval_every=8)
    runs = spec.plan(settings, tmp_path)
    assert len(runs) == 12 and {r.folder.relative_to(tmp_path).parts[0] for r in runs} == {
        "lora-smollm2-tuning"
    }
    for run in runs:
        assert run.overrides["train.learning_rate"] in lora_smollm2.GRID[run.labels["kind"]]
        assert run.overrides["eval.test"] is False and run.overrides["total_steps"] == 8
        assert run.overrides["task.num_eval"] == 0  # the whole validation split
        assert run.overrides["model.path"] == "smollm2"  # its start, as the report labels it
        value = {"full/lr1e-05": 0.40, "lora/lr0.001": 0.42}.get(run.labels["arm"], 0.30)
        write_run(run.folder, test=0.0, validation=value)
    from jaxrlhf.experiments.claims.start_models import model_of, other_start

    # No committed build of SmolLM2 to differ from (--rerun-other-starts leaves its runs).
    assert model_of(runs[0].overrides) == "smollm2" and not other_start(runs[0].folder, "smollm2")
    chosen = analyse("lora-smollm2-tuning", runs, settings)["chosen"]
    assert chosen["full"]["learning_rate"] == 1e-5 and not chosen["full"]["grid_edge"]
    assert chosen["lora"]["learning_rate"] == 1e-3 and chosen["lora"]["grid_edge"]

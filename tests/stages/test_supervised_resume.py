"""Exact resume of the supervised stages: an SFT run and a reward-model run interrupted after a
checkpoint and resumed end with the weights (and optimizer state) of an uninterrupted run, bit
for bit, and log each step once with the same figures.

Tiny Llama on the toy No Robots-layout fixture (as tests/stages/test_pipeline.py), real Orbax
checkpoints on the 8-device CPU mesh. The run is interrupted in its log callback at step 3:
after the checkpoint of step 2, with step 3 trained and logged but not saved, as a run killed
between two checkpoints.
"""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs.tiny import get_config as tiny_config
from jaxrlhf.models.paths import resolve_model
from jaxrlhf.stages import reward, sft
from jaxrlhf.stages.supervised import keep_logged_steps
from tests.conftest import REPO

TOY = str(REPO / "tests" / "fixtures" / "data" / "toy_pref")
STEPS, EVERY, INTERRUPT_AT = 4, 2, 3


class Interrupted(Exception):
    """Raised by the log callback to stop a run between two checkpoints."""


def stage_config(stage: str, out, model) -> object:
    config = tiny_config()
    config.stage, config.output_dir, config.model.path = stage, str(out), str(model)
    config.task.name = "nobots"
    config.task.source = config.task.preference_source = TOY
    config.task.num_train = config.task.num_eval = 0
    config.task.validation_fraction = 0.25
    config.train.max_length, config.train.batch_size = 40, 8
    config.train.learning_rate, config.train.log_every = 1e-3, 1
    config.total_steps, config.checkpoint.every = STEPS, EVERY
    config.export = False
    return config


def run(module, config, interrupt_at: int | None = None) -> None:
    def log(message: str) -> None:
        if interrupt_at is not None and message.startswith(f"step {interrupt_at}/"):
            raise Interrupted(message)

    module.run(config, resolve_model(config.model.path), log)


def final_state(out) -> list[np.ndarray]:
    """Every array of the last checkpoint's train state (params, optimizer state, step)."""
    restored = ocp.StandardCheckpointer().restore(
        (out / "checkpoints" / str(STEPS) / "state").resolve()
    )
    return [np.asarray(leaf) for leaf in jax.tree.leaves(restored)]


def logged(out) -> list[dict]:
    """metrics.jsonl without the timings."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k != "step_seconds"} for line in lines]


@pytest.mark.slow  # compiles and trains two whole runs: left out of `make test-fast`
@pytest.mark.parametrize("module", [sft, reward], ids=["sft", "reward"])
def test_interrupted_stage_resumes_bit_exactly(module, tiny_llama, tmp_path):
    stage = "sft" if module is sft else "reward"
    full = tmp_path / "full"
    run(module, stage_config(stage, full, tiny_llama))

    cut = tmp_path / "cut"
    with pytest.raises(Interrupted):
        run(module, stage_config(stage, cut, tiny_llama), interrupt_at=INTERRUPT_AT)
    saved = sorted(int(p.name) for p in (cut / "checkpoints").iterdir() if p.name.isdigit())
    assert max(saved) == EVERY  # step 3 was trained but not saved: the resumed run redoes it
    config = stage_config(stage, cut, tiny_llama)
    config.resume = True
    run(module, config)

    for got, want in zip(final_state(cut), final_state(full), strict=True):
        np.testing.assert_array_equal(got, want)
    assert logged(cut) == logged(full)
    assert [line["step"] for line in logged(cut)] == list(range(1, STEPS + 1))
    summaries = [json.loads((out / "summary.json").read_text()) for out in (cut, full)]
    for summary in summaries:
        summary.pop("wall_seconds")
    assert summaries[0] == summaries[1]


def test_resume_drops_the_steps_logged_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in range(1, 5)]
    path.write_text("".join(lines) + '{"step": 5, "lo')  # killed while writing step 5
    keep_logged_steps(path, 2)
    assert path.read_text() == "".join(lines[:2])

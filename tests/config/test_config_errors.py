"""A mistyped `--config.KEY` gets one line naming the key and the closest known keys, exit 2,
from every entry point that takes `--config` (not ml_collections' 55-line traceback)."""

import os
import subprocess
import sys

import pytest

from jaxrlhf.config import base_config, closest_keys, config_keys
from tests.conftest import REPO

ENTRY_POINTS = ("jaxrlhf.main", "jaxrlhf.evaluate", "jaxrlhf.plan")


@pytest.mark.parametrize("module", ENTRY_POINTS)
@pytest.mark.parametrize(
    "override, key, suggestion",
    [
        ("--config.train.learning_rte=1e-3", "config.train.learning_rte",
         "config.train.learning_rate"),
        ("--config.seeed=3", "config.seeed", "config.seed"),  # a top-level key
        # A key in the wrong section:
        ("--config.learning_rate=1e-3", "config.learning_rate", "config.train.learning_rate"),
    ],
)  # fmt: skip
def test_unknown_key_is_one_line_and_exit_2(module, override, key, suggestion, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", module, "--config=configs/tiny.py", override,
         f"--config.output_dir={tmp_path / 'out'}", f"--checkpoint={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(f"config error: unknown key {key};")
    assert suggestion in lines[0].split(";", 1)[1]
    assert not (tmp_path / "out").exists()


def test_closest_keys_are_the_likely_ones():
    known = list(config_keys(base_config()))
    assert "train.learning_rate" in known and "model.dtype" in known
    assert closest_keys("train.learning_rte", known) == ["train.learning_rate"]
    assert closest_keys("trian.batch_size", known)[0] == "train.batch_size"
    assert closest_keys("zzzzqqq", known) == []

"""Kill-and-resume: a run SIGKILLed after a checkpoint and resumed logs the same metrics for the
following steps as an uninterrupted run with the same seed, with the same version numbering."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO

COMPARED = ("loss", "reward_mean", "score_mean", "kl", "staleness_mean", "staleness_max",
            "eos_rate", "response_length_mean")  # fmt: skip


def command(output_dir, address, *extra):
    return [
        sys.executable, "-m", "jaxrlhf.main", "--config=configs/tiny.py",
        "--config.loss=rloo", "--config.max_staleness=1", "--config.total_steps=6",
        "--config.checkpoint.every=2", "--config.eval.at_start=false",
        "--config.eval.at_end=false", f"--config.generator.addresses={address}",
        f"--config.output_dir={output_dir}", *extra,
    ]  # fmt: skip


def metrics(output_dir):
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def env():
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_run_resumes_exactly(generator_address, tmp_path):
    full = tmp_path / "full"
    subprocess.run(command(full, generator_address), cwd=REPO, env=env(), check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed, generator_address), cwd=REPO, env=env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if (killed / "metrics.jsonl").exists() and len(metrics(killed)) >= 3:
            break
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics(killed)) < 6
    resumed = subprocess.run(
        command(killed, generator_address, "--config.resume=true"), cwd=REPO, env=env(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step" in resumed.stdout
    want, got = metrics(full), metrics(killed)
    assert [r["step"] for r in got] == list(range(1, 7))
    # Same numbering within each run: versions continue where the checkpoint left them.
    base_want, base_got = want[0]["policy_version"] - 1, got[0]["policy_version"] - 1
    assert [r["policy_version"] - base_got for r in got] == list(range(1, 7))
    assert [r["policy_version"] - base_want for r in want] == list(range(1, 7))
    for a, b in zip(want, got, strict=True):
        for key in COMPARED:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=key)

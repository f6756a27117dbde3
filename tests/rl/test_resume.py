"""Kill-and-resume: a run SIGKILLed after a checkpoint and resumed ends with the same train state
as an uninterrupted run with the same seed, bit for bit (the generator swaps in drain mode), and
logs the same metrics, with the same version numbering. Also between two publishes (N = 4
mini-batches per publish, a checkpoint every 2 updates: issue 18's hang)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO
from tests.rl.exact import assert_same_state, records

STEPS = 6
MODES = {
    "one_step_off": ["--config.max_staleness=1"],  # publishes after every update
    # Publishes after updates 4 and 6: every checkpoint before 4 falls between two publishes.
    "mini_batches": ["--config.num_mini_batches=4"],
}


def command(output_dir, address, *extra):
    return [
        sys.executable, "-m", "jaxrlhf.main", "--config=configs/tiny.py",
        "--config.loss=rloo", f"--config.total_steps={STEPS}",
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
@pytest.mark.parametrize("mode", sorted(MODES))
def test_killed_run_resumes_exactly(mode, generator_address, tmp_path):
    full = tmp_path / "full"
    subprocess.run(command(full, generator_address, *MODES[mode]), cwd=REPO, env=env(),
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    killed = tmp_path / "killed"
    proc = subprocess.Popen(command(killed, generator_address, *MODES[mode]), cwd=REPO,
                            env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if (killed / "metrics.jsonl").exists() and len(metrics(killed)) >= 3:
            break
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics(killed)) < STEPS
    resumed = subprocess.run(
        command(killed, generator_address, *MODES[mode], "--config.resume=true"), cwd=REPO,
        env=env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_from = int(re.search(r"resumed from step (\d+)", resumed.stdout).group(1))
    if mode == "mini_batches":
        assert resumed_from < 4, "killed after the publish: nothing between two publishes"
    want, got = metrics(full), metrics(killed)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    # Same numbering within each run: versions continue where the checkpoint left them.
    base_want, base_got = want[0]["policy_version"] - 1, got[0]["policy_version"] - 1
    assert [r["policy_version"] - base_got for r in got] == list(range(1, STEPS + 1))
    assert [r["policy_version"] - base_want for r in want] == list(range(1, STEPS + 1))
    assert_same_state(full, killed, STEPS)
    assert records(killed) == records(full)

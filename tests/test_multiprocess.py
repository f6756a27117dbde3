"""The learner over 2 `jax.distributed` processes (2 fake CPU devices each, gloo, one mesh over
all 4 devices) against the suite's generator: the async RLHF loop, its checkpoints and export.

Both processes are SIGKILLed after a checkpoint and resumed; the per-step metrics and the
exported weights of that run then equal those of one uninterrupted process with 4 devices. (A
run over 2 processes that differed from one process, or a resume that was not exact, fails
the comparison: one 2-process run checks both, and saves the suite a third whole run.)
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxrlhf.models.safetensors_io import SafetensorsFile
from tests.conftest import REPO

COMPARED = ("loss", "reward_mean", "kl", "staleness_max", "response_length_mean")
STEPS = 6


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(output_dir, address, *extra):
    return [
        sys.executable, "-m", "jaxrlhf.main", "--config=configs/tiny.py",
        "--config.loss=online_dpo", "--config.max_staleness=1",
        f"--config.total_steps={STEPS}", "--config.checkpoint.every=2",
        "--config.eval.at_start=false", "--config.eval.at_end=false",
        f"--config.generator.addresses={address}", f"--config.output_dir={output_dir}", *extra,
    ]  # fmt: skip


def env(devices: int):
    return dict(os.environ, JAX_PLATFORMS="cpu",
                XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")  # fmt: skip


def start_two(output_dir, address, *extra):
    """Both processes of a 2-process run, on a fresh coordinator port."""
    port = free_port()
    distributed = ["--config.distributed.enabled=true", "--config.distributed.num_processes=2",
                   f"--config.distributed.coordinator_address=127.0.0.1:{port}"]  # fmt: skip
    return [
        subprocess.Popen(
            command(
                output_dir, address, *distributed, f"--config.distributed.process_id={i}", *extra
            ),
            cwd=REPO,
            env=env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]


def finish(procs, timeout=600):
    outputs = [p.communicate(timeout=timeout) for p in procs]
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return outputs


def metrics(output_dir):
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def exported(output_dir):
    file = SafetensorsFile(output_dir / "hf_export" / "model.safetensors")
    return {name: np.array(file.get(name)) for name in file.names()}


def assert_same_metrics(want, got):
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(want, got, strict=True):
        for key in COMPARED:
            np.testing.assert_allclose(b[key], a[key], rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_processes_equal_one_and_resume_exactly(generator_address, tmp_path):
    one = tmp_path / "one"
    subprocess.run(command(one, generator_address), cwd=REPO, env=env(4), check=True,
                   capture_output=True, timeout=600)  # fmt: skip

    killed = tmp_path / "killed"
    procs = start_two(killed, generator_address)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if (killed / "metrics.jsonl").exists() and len(metrics(killed)) >= 3:
            break
        assert all(p.poll() is None for p in procs), "the run ended before it could be killed"
        time.sleep(0.05)
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(metrics(killed)) < STEPS
    outputs = finish(start_two(killed, generator_address, "--config.resume=true"))
    assert "resumed from step" in outputs[0][0]
    assert "summary" in outputs[0][0] and "[jaxrlhf]" not in outputs[1][0]  # one speaks
    assert "learner mesh {'data': 1, 'fsdp': 4, 'tensor': 1} over 2 process(es)" in outputs[0][0]
    assert_same_metrics(metrics(one), metrics(killed))
    want, got = exported(one), exported(killed)
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_lora_run_over_two_processes_equals_one(lora_generator, tmp_path):
    """LoRA (rank 4) over 2 processes publishing adapters alone to a "lora" generator: each
    factor is gathered whole to the host (`to_host`) and the driver streams the adapter; the
    run equals one process with 4 devices, step for step, and exports the same adapter."""
    lora = ["--config.model.lora.rank=4", "--config.generator.swap_mode=lora",
            "--config.generator.weight_transport=stream"]  # fmt: skip
    one = tmp_path / "one"
    subprocess.run(command(one, lora_generator, *lora), cwd=REPO, env=env(4), check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    two = tmp_path / "two"
    outputs = finish(start_two(two, lora_generator, *lora))
    assert "over 2 process(es)" in outputs[0][0]
    assert_same_metrics(metrics(one), metrics(two))
    # Each publish the same adapter's bytes (which step logs the first is a matter of timing).
    one_sent, sent = ([r["weight_sync_bytes"] for r in metrics(run)] for run in (one, two))
    adapter = max(one_sent)
    assert adapter > 0 and set(sent) <= {0, adapter} and sent.count(adapter) >= STEPS - 1
    for name in ("adapter_model.safetensors",):
        want = SafetensorsFile(one / "hf_export" / "adapter" / name)
        got = SafetensorsFile(two / "hf_export" / "adapter" / name)
        assert set(got.names()) == set(want.names()) and want.names()
        for tensor in want.names():
            np.testing.assert_allclose(np.array(got.get(tensor)), np.array(want.get(tensor)),
                                       rtol=1e-4, atol=1e-5, err_msg=tensor)  # fmt: skip

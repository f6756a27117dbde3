"""The standalone server's life: it starts with its documented defaults on this 2-core CPU
machine (no flag, no environment variable), and when it is SIGKILLed its engine processes
(vLLM's engine core and workers) die with it: the reaper leaves no orphan. When its engine dies
under it (a worker killed, as the OOM killer does), it exits 1 with one line that says so,
instead of answering every call with an error: whoever started it can restart it."""

import os
import signal
import time

import pytest

from generator_service.reaper import descendants
from jaxrlhf.rl.service import start_server


@pytest.mark.slow
def test_default_start_and_no_orphans_after_sigkill(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the documented command
    server = start_server(tiny_llama, tmp_path / "server.log")  # --model PATH --port 0 only
    try:
        log = server.log_path.read_text()
        assert "KV cache:" in log  # sized from the free memory, not 0.9 of the node
        below = descendants(server.process.pid)
        commands = [_command(pid) for pid, _ in below]
        assert any("generator_service.reaper" in c for c in commands)
        assert len(below) >= 2, commands  # the reaper and vLLM's engine process(es)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in below):
            time.sleep(0.2)
        left = [(_command(pid), pid) for pid, started in below if _alive((pid, started))]
        assert not left, f"orphans after the server's death: {left}"
    finally:
        if server.process.poll() is None:
            server.process.kill()


@pytest.mark.slow
def test_a_server_whose_engine_dies_exits(tiny_llama, tmp_path):
    server = start_server(tiny_llama, tmp_path / "server.log",
                          ["--dtype", "float32", "--max-model-len", "256"],
                          env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    try:
        below = descendants(server.process.pid)
        engine = [p for p in below if "generator_service.reaper" not in _command(p[0])]
        assert engine, [_command(pid) for pid, _ in below]
        newest = max(engine, key=lambda p: p[1])  # the engine's worker
        os.kill(newest[0], signal.SIGKILL)
        returncode = server.process.wait(timeout=60)
        assert returncode == 1
        log = server.log_path.read_text()
        assert "the vLLM engine died while serving" in log, log[-2000:]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in below):
            time.sleep(0.2)
        assert not [p for p in below if _alive(p)], "engine processes outlived the server"
    finally:
        if server.process.poll() is None:
            server.process.kill()


def _alive(process: tuple[int, int]) -> bool:
    pid, started = process
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return int(fields[19]) == started and fields[0] != "Z"


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

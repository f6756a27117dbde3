"""The standalone server's life: it starts with its documented defaults on this 2-core CPU
machine (no flag, no environment variable), and when it is SIGKILLed its engine processes
(vLLM's engine core and workers) die with it: the reaper leaves no orphan."""

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

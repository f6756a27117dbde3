"""The standalone server's life: it starts with its documented defaults on this 2-core CPU
machine (no flag, no environment variable), and when it is SIGKILLed its engine processes
(vLLM's engine core and workers) die with it: the reaper leaves no orphan. When its engine dies
under it (a worker killed, as the OOM killer does), it exits 1 with one line that says so,
instead of answering every call with an error: whoever started it can restart it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from generator_service.reaper import descendants
from jaxrlhf.fleet.service import start_server

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_default_start_and_no_orphans_after_sigkill(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the documented command
    monkeypatch.delenv("JAXRLHF_KV_CACHE_GIB", raising=False)
    monkeypatch.delenv("JAXRLHF_ENGINE_EXECUTOR", raising=False)
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
def test_a_server_whose_engine_dies_exits(tiny_llama, tmp_path, monkeypatch):
    # With no core reserved, the engine's worker computes on every core this process may run
    # on (vLLM's default executor: a worker process of its own).
    monkeypatch.delenv("JAXRLHF_ENGINE_EXECUTOR", raising=False)
    server = start_server(tiny_llama, tmp_path / "server.log",
                          ["--dtype", "float32", "--max-model-len", "256",
                           "--cpu-reserved-cores", "0"],
                          env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    try:
        started = server.log_path.read_text()
        assert f"core ids={sorted(os.sched_getaffinity(0))}" in started, started[-3000:]
        assert "reserved_cpus=[]" in started
        # The size the suite asks for (tests/conftest.py) wins over vLLM's own variable.
        assert "VLLM_CPU_KVCACHE_SPACE is ignored" in started
        assert f"Explicitly set ({os.environ['JAXRLHF_KV_CACHE_GIB']}/" in started
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


@pytest.mark.slow
def test_the_suites_servers_run_the_model_in_the_engine_core(generator_server):
    """`--engine-executor uni` (tests/conftest.py): below the server, one vLLM process, the
    engine core, which loads and runs the model itself (beside it: the reaper and Python's
    multiprocessing resource tracker)."""
    assert os.environ["JAXRLHF_ENGINE_EXECUTOR"] == "uni"
    below = [_command(pid) for pid, _ in descendants(generator_server.process.pid)]
    engine = [c for c in below if c.startswith("VLLM::")]
    assert len(engine) == 1 and engine[0].startswith("VLLM::EngineCore"), below
    log = generator_server.log_path.read_text(errors="replace")
    assert "VllmWorker" not in log and "EngineCore pid=" in log
    assert "Starting to load model" in log.split("EngineCore pid=", 1)[1]


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


@pytest.mark.slow
def test_an_engine_spawned_just_before_the_server_dies_dies_too(tiny_llama, tmp_path):
    """The server is SIGKILLed the moment its first engine process exists, before the reaper's
    next scan could have seen it: every process it started (all carry a marker in their
    environment, orphans included) is gone within a bounded time."""
    marker = f"JAXRLHF_TEST_MARK=lifecycle-{os.getpid()}-{time.monotonic_ns()}"
    key, value = marker.split("=", 1)
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "generator_service", "--model", str(tiny_llama), "--port", "0",
             "--dtype", "float32", "--max-model-len", "256"],
            cwd=REPO, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", key: value},
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not any(_is_engine(pid) for pid, _ in descendants(server.pid)):
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "no engine process started"
        server.kill()
        server.wait()
        deadline = time.monotonic() + 30
        while (left := _marked(marker)) and time.monotonic() < deadline:
            time.sleep(0.1)
        log = (tmp_path / "server.log").read_text()[-3000:]
        assert not left, f"outlived the server: {[_command(pid) for pid in left]}\n{log}"
    finally:
        if server.poll() is None:
            server.kill()
        for pid in _marked(marker):  # never leave an orphan behind, even when the test fails
            os.kill(pid, signal.SIGKILL)


def _is_engine(pid: int) -> bool:
    """Whether `pid` is one of vLLM's processes (multiprocessing spawns them), not the reaper."""
    return "multiprocessing" in _command(pid)


def _marked(marker: str) -> list[int]:
    """Live (not zombie) processes whose environment holds `marker`, this one excepted."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


# Stands in for `python -m generator_service` (it ignores its arguments): says it serves, then
# stops once the lifeline pipe ends, as the real server does.
FAKE_SERVER = """#!{python}
import os
print("{ready} 127.0.0.1:1", flush=True)
while os.read(int(os.environ["JAXRLHF_PARENT_FD"]), 1):
    pass
"""


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """`start_server` starts FAKE_SERVER instead of the real one (no engine: the descriptors
    the learner holds do not depend on what the server does)."""
    from jaxrlhf_wire import READY_LINE

    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_SERVER.format(python=sys.executable, ready=READY_LINE))
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    return tmp_path


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_restarts_leak_no_descriptor(fake_server):
    """A replica killed and restarted, as `jaxrlhf.stages.rlhf` restarts one
    (`process.kill(); process.wait()`, then `start_server`): the learner's open descriptors
    stay flat, and so after `terminate`."""

    def kill_and_restart(index: int) -> None:
        server = start_server("model", fake_server / f"restart{index}.log")
        server.process.kill()
        server.process.wait()

    kill_and_restart(0)  # anything opened once (imports, caches) is opened now
    before = _open_fds()
    for index in range(1, 6):
        kill_and_restart(index)
    start_server("model", fake_server / "terminated.log").terminate()
    assert _open_fds() == before

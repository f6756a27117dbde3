"""The processes of a soak (`bench/soak.py`): generator replicas the faults act on, learner runs
that are killed and resumed, a sampler of their memory, threads and descriptors, and a scan for
processes left behind.

Every process the soak starts carries one environment variable, `MARKER_ENV`, with a value of
its own (children inherit it: vLLM's engine processes, the servers' reapers). Whatever still
carries it once the soak stopped everything is an orphan, however it escaped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from generator_service.reaper import descendants
from jaxrlhf.fleet.rpc import GeneratorClient
from jaxrlhf.fleet.service import ServerProcess, start_server

REPO = Path(__file__).resolve().parents[1]
MARKER_ENV = "JAXRLHF_SOAK_ID"
ENGINE_ARGS = ("--dtype", "float32", "--max-model-len", "256", "--seed", "0")
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


class Replica:
    """One replica address, served by one standalone server at a time (a replacement binds the
    same port). Its failpoint file (`generator_service.failpoints`) is read by every server
    started here."""

    def __init__(self, name: str, model: Path, folder: Path, marker: str):
        self.name, self.model, self.folder = name, model, folder
        self.failpoints = folder / f"{name}.failpoints"
        self.env = {**ENGINE_ENV, MARKER_ENV: marker, "JAXRLHF_FAILPOINTS": str(self.failpoints)}
        self.port = 0
        self.starts = 0
        self.server: ServerProcess | None = None
        self.ready_at = 0.0  # time.monotonic() when the current server began serving

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServerProcess:
        """Starts a server at this address (a free port the first time) and waits until it
        serves."""
        log = self.folder / f"{self.name}-{self.starts}.log"
        self.starts += 1
        server = start_server(self.model, log, [*ENGINE_ARGS, "--port", str(self.port)],
                              env=self.env)  # fmt: skip
        self.port = int(server.address.rsplit(":", 1)[1])
        self.server, self.ready_at = server, time.monotonic()
        return server

    def signal(self, signum: int) -> None:
        if self.server is not None and self.server.process.poll() is None:
            self.server.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would; the server's reaper takes its engine."""
        self.signal(signal.SIGKILL)
        if self.server is not None:
            self.server.process.wait()
            self.server.terminate()  # closes the lifeline pipe

    def stop(self) -> None:
        """SIGTERM (a stopped server is continued first so that it can drain and exit)."""
        self.signal(signal.SIGCONT)
        if self.server is not None:
            self.server.terminate()

    def arm(self, line: str) -> None:
        self.failpoints.write_text(line + "\n")

    def armed(self) -> bool:
        """Whether a failpoint waits to fire (a point deletes the file when it fires)."""
        return self.failpoints.exists()

    def status(self, timeout: float = 3.0):
        """GetStatus of the server at this address, or None when nothing answers."""
        with GeneratorClient(self.address) as client:
            try:
                return client.status(timeout=timeout)
            except grpc.RpcError:
                return None


class LearnerRun:
    """`python -m jaxrlhf.main` in `output_dir`, started, killed and resumed by the soak; its
    output goes to `learner-N.log` there."""

    def __init__(self, output_dir: Path, args: list[str], marker: str):
        self.output_dir, self.args = output_dir, args
        self.env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        self.env.update(JAX_PLATFORMS="cpu", **ENGINE_ENV, **{MARKER_ENV: marker})
        self.process: subprocess.Popen | None = None
        self.logs: list[Path] = []

    def start(self, resume: bool = False, steps: int | None = None) -> subprocess.Popen:
        """Starts (or, with `resume`, resumes) the run; `steps`: its total_steps from now on."""
        if steps is not None:
            self.args = [a for a in self.args if not a.startswith("--config.total_steps=")]
            self.args.append(f"--config.total_steps={steps}")
        self.output_dir.mkdir(parents=True, exist_ok=True)
        log = self.output_dir / f"learner-{len(self.logs)}.log"
        self.logs.append(log)
        # absl wants --config=FILE before any --config.KEY=VALUE
        command = [sys.executable, "-m", "jaxrlhf.main", *self.args,
                   f"--config.output_dir={self.output_dir}",
                   *(["--config.resume=true"] if resume else [])]  # fmt: skip
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=out,
                                            stderr=subprocess.STDOUT)  # fmt: skip
        return self.process

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def records(self) -> list[dict]:
        """metrics.jsonl as it is now (a line being written is left out)."""
        path = self.output_dir / "metrics.jsonl"
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return out

    def last_step(self) -> int:
        records = self.records()
        return records[-1]["step"] if records else 0

    def log_tail(self, lines: int = 40) -> str:
        if not self.logs:
            return ""
        text = self.logs[-1].read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


@dataclasses.dataclass(frozen=True)
class Usage:
    """One look at a process: seconds since the soak began, resident memory (kB) of the process
    and of it with all its descendants, its threads and open descriptors."""

    t: float
    rss_kb: int
    tree_rss_kb: int
    threads: int
    fds: int


def read_usage(pid: int, t: float) -> Usage | None:
    """A process's Usage from /proc, or None once it is gone."""
    try:
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        rss = int(fields["VmRSS"].split()[0])
        threads = int(fields["Threads"])
    except (OSError, KeyError, ValueError):
        return None
    tree = rss + sum(_rss_kb(child) for child, _ in descendants(pid))
    return Usage(t, rss, tree, threads, fds)


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Sampler:
    """Samples every tracked process every `interval` seconds in a thread; `series[label]` is
    one process's Usage over its life (a label names the role and the pid). With `progress`
    (the learner's last logged step), `steps` holds (soak time, step) at each sample too."""

    def __init__(self, interval: float):
        self.interval = interval
        self.started = time.monotonic()
        self.series: dict[str, list[Usage]] = {}
        self.ready: dict[str, float] = {}  # label -> soak time the process began its work
        self.progress: Callable[[], int] | None = None
        self.steps: list[tuple[float, int]] = []
        self._tracked: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def now(self) -> float:
        return time.monotonic() - self.started

    def track(self, role: str, pid: int) -> None:
        label = f"{role} (pid {pid})"
        with self._lock:
            self._tracked[label] = pid
            self.series.setdefault(label, [])
            self.ready[label] = self.now()

    def untrack(self, pid: int) -> None:
        """No more samples of process `pid` (its series so far are kept)."""
        with self._lock:
            self._tracked = {label: p for label, p in self._tracked.items() if p != pid}

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def step_at(self, t: float) -> int:
        """The learner's last logged step at soak time `t`, as last sampled (0: none yet)."""
        before = [step for when, step in self.steps if when <= t]
        return before[-1] if before else 0

    def time_of_step(self, step: int, after: float) -> float | None:
        """The first sample time from `after` on at which the learner had logged `step`."""
        return next((when for when, s in self.steps if when >= after and s >= step), None)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                tracked = dict(self._tracked)
            if self.progress is not None:
                self.steps.append((self.now(), self.progress()))
            for label, pid in tracked.items():
                usage = read_usage(pid, self.now())
                with self._lock:
                    if usage is None:
                        self._tracked.pop(label, None)
                    else:
                        self.series[label].append(usage)


def marked_processes(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment carries the soak's marker."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":
            found.append((int(entry.name), command.strip()))
    return found


def orphans_after(marker: str, grace_s: float) -> list[tuple[int, str]]:
    """The marked processes still alive `grace_s` seconds from now at the latest (a reaper
    needs a moment after its server died); polled, so a clean soak waits no longer than needed."""
    deadline = time.monotonic() + grace_s
    while True:
        left = marked_processes(marker)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)

"""Chaos: the async RLHF loop survives its generator replicas dying, hanging and coming back.

Two standalone replicas (`python -m generator_service`, the tiny model) serve one run of the
async loop (`python -m jaxrlhf.main`, configs/tiny.py). A failpoint file armed in a replica
(`generator_service.failpoints`) makes it SIGKILL itself in the middle of a Generate call
(replica A), or SIGSTOP itself (it hangs) in a Generate call (replica B). A
warm replacement already listens at A's address (both bind it with SO_REUSEPORT) and takes it
over when A dies; a stopped B is continued after a while, as an operator would. Each run must
then:

- exit 0, every step having trained exactly the prompts of its schedule, each with its k
  samples, each once (`samples_returned` per step in metrics.jsonl: what came back from the
  generators, as (prompt id, sample index));
- keep every version tag within the staleness bound;
- see the replica fail, its work fail over to the other, and it (back at its address) rejoin:
  it ends at the run's final version;
- leave no engine process of a killed replica behind.

A run on one replica whose swap fails half-way (it then reports NOT_SERVING) must see it rejoin
with the full weights and finish. Last, one replica started by `jaxrlhf.main` itself is killed in
the middle of a weight update: the run restarts it, sends it the weights whole, and finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from generator_service.reaper import descendants
from jaxrlhf.fleet.rpc import GeneratorClient
from jaxrlhf.fleet.service import start_server
from jaxrlhf.rl.trainer import prompts_for_batch_fn
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 60
PROMPTS, SAMPLES = 4, 2  # configs/tiny.py
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--seed", "0"]
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
DEADLINE = 15  # seconds of a Generate call (a fresh engine's first calls are slow)


class Address:
    """A replica address served by up to two standalone servers at once (gRPC binds its ports
    with SO_REUSEPORT): the one the learner is connected to, and a warm standby that takes over
    the address when the first dies, as a replacement would. Both read one failpoint file; a
    point fires once (the file is deleted), in whichever server gets the traffic."""

    def __init__(self, model, folder, name: str):
        self.model, self.folder, self.name = model, folder, name
        self.failpoints = folder / f"{name}.failpoints"
        self.port = 0
        self.servers: list = []
        self._standby: threading.Thread | None = None
        self.start()

    def start(self) -> None:
        env = {**ENV, "JAXRLHF_FAILPOINTS": str(self.failpoints)}
        log = self.folder / f"{self.name}-{len(self.servers)}.log"
        server = start_server(self.model, log, [*ENGINE_ARGS, "--port", str(self.port)],
                              env=env)  # fmt: skip
        self.port = int(server.address.rsplit(":", 1)[1])
        server.engine = descendants(server.process.pid)
        self.servers.append(server)

    def add_standby(self) -> None:
        """Starts a second server at this address in the background (`wait_standby`)."""
        self._standby = threading.Thread(target=self.start)
        self._standby.start()

    def wait_standby(self) -> None:
        if self._standby is not None:
            self._standby.join()
            self._standby = None

    def only_one(self) -> None:
        """Leaves one server at this address: the test then reads back the version of the one
        the learner used (SO_REUSEPORT would spread connections over two)."""
        self.wait_standby()
        for server in self.alive()[1:]:
            server.terminate()

    def alive(self) -> list:
        return [s for s in self.servers if s.process.poll() is None]

    def dead(self) -> list:
        return [s for s in self.servers if s.process.poll() is not None]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def arm(self, line: str) -> None:
        self.failpoints.write_text(line + "\n")

    def version(self) -> int:
        with GeneratorClient(self.address) as client:
            return client.status(timeout=10).policy_version

    def stop(self) -> None:
        self.wait_standby()
        for server in self.alive():
            server.process.send_signal(signal.SIGCONT)
            server.terminate()


@pytest.fixture(scope="module")
def replicas(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fleet")
    a, b = Address(tiny_llama, folder, "A"), Address(tiny_llama, folder, "B")
    a.add_standby()  # for the first kill
    yield a, b
    for address in (a, b):
        address.stop()


def run_loop(output_dir, addresses, *extra, env=None, steps=STEPS) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "jaxrlhf.main", "--config=configs/tiny.py",
        f"--config.output_dir={output_dir}", f"--config.total_steps={steps}",
        "--config.max_staleness=1", "--config.eval.at_start=false", "--config.eval.at_end=false",
        "--config.checkpoint.every=1000", "--config.export=false",
        "--config.generator.probe_interval_s=0.5", "--config.generator.update_timeout_s=20",
        f"--config.generator.generate_timeout_s={DEADLINE}",
        *([f"--config.generator.addresses={addresses}"] if addresses else []), *extra,
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", **ENV, **(env or {}))
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def metrics(output_dir) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def check_run(output_dir, output: str, steps: int = STEPS) -> list[dict]:
    """The run's records, after the checks every chaos run must pass."""
    records = metrics(output_dir)
    assert [r["step"] for r in records] == list(range(1, steps + 1)), output[-3000:]
    schedule = prompts_for_batch_fn(_tiny_task(), PROMPTS, 0)
    for r in records:
        assert (r["prompts"], r["samples"]) == (PROMPTS, PROMPTS * SAMPLES), r
        ids = [p.id for p in schedule(r["step"] - 1)]
        assert r["prompt_ids"] == ids, r["step"]
        # What came back: each prompt of the schedule with each of its samples, once.
        expected = sorted([prompt_id, k] for prompt_id in ids for k in range(SAMPLES))
        assert sorted(r["samples_returned"]) == expected, r["step"]
        assert 0 <= r["staleness_max"] <= 1, r
    return records


def _tiny_task():
    """The tiny config's task as the run builds it (for its prompt schedule)."""
    import transformers

    from configs.tiny import get_config
    from jaxrlhf.models.paths import resolve_model
    from jaxrlhf.rl.tasks import build_task

    config = get_config()
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(config.model.path))
    return build_task(config, tokenizer, test=False)


def totals(records, key: str) -> int:
    return sum(r[key] for r in records)


def gone(processes) -> bool:
    for pid, started in processes:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[19]) == started and fields[0] != "Z":
            return False
    return True


@pytest.mark.parametrize(
    ("failpoint", "kind"),
    [
        ("generate_completion 2 kill", "killed in Generate"),
        ("generate_completion 2 stop", "hung in Generate"),
    ],
)
def test_the_loop_survives_a_replica(replicas, tmp_path, failpoint, kind):
    # A kill takes A (whose address has a warm standby); a hang takes B (one server: the
    # version the test reads back is that server's).
    a, b = replicas if "killed" in kind else replicas[::-1]
    a.wait_standby()
    if "killed" in kind and len(a.alive()) < 2:
        a.start()  # the warm standby that takes the address over
    b.only_one()
    if "hung" in kind:
        a.only_one()
    dead_before = len(a.dead())
    a.arm(failpoint)
    run = run_loop(tmp_path, f"{a.address},{b.address}", f"--config.model.path={a.model}")
    fired = threading.Event()

    def operator() -> None:  # continues a stopped replica, as the one watching the fleet would
        while run.poll() is None:
            if len(a.dead()) > dead_before:  # killed itself: the standby has the address now
                fired.set()
                return
            stopped = [s for s in a.alive() if _state(s.process.pid) == "T"]
            if stopped:
                time.sleep(DEADLINE + 4)  # past the Generate deadline: its prompts failed over
                stopped[0].process.send_signal(signal.SIGCONT)
                fired.set()
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=operator, daemon=True)
    watcher.start()
    output, _ = run.communicate(timeout=800)
    watcher.join(timeout=120)
    assert run.returncode == 0, output[-4000:]
    assert fired.is_set(), f"{kind}: the failpoint never fired"
    records = check_run(tmp_path, output)
    assert totals(records, "generator_failures") >= 1, kind
    assert totals(records, "generator_rejoins") >= 1, (kind, output[-3000:])
    assert totals(records, "generator_failovers") >= 1, kind
    assert records[-1]["generators_live"] == 2
    final = records[-1]["policy_version"]
    assert a.version() == b.version() == final  # A: the replica back (or continued) there
    if "killed" in kind:
        engine = a.dead()[-1].engine
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not gone(engine):
            time.sleep(0.2)
        assert gone(engine), f"{kind}: the killed replica's engine processes remain"


def test_a_replica_left_not_serving_by_a_failed_swap_rejoins(replicas, tmp_path):
    # B alone: its swap of the run's 2nd update (the 3rd since armed, after the run's initial
    # weights and the 1st update) fails half-way, which leaves it NOT_SERVING. The run must not
    # stop (the replica answers), and it must rejoin with the full weights, well before
    # no_replica_timeout_s.
    _, b = replicas
    b.only_one()
    b.arm("reload_weights 3 fail")
    run = run_loop(tmp_path, b.address, f"--config.model.path={b.model}",
                   "--config.generator.no_replica_timeout_s=60", steps=8)  # fmt: skip
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output[-4000:]
    assert not b.failpoints.exists(), "the failpoint never fired"
    records = check_run(tmp_path, output, steps=8)
    assert totals(records, "generator_failures") >= 1
    assert totals(records, "generator_rejoins") >= 1, output[-3000:]
    assert "not serving: its weights are unknown" in output
    assert records[-1]["generators_live"] == 1
    assert b.version() == records[-1]["policy_version"]
    with GeneratorClient(b.address) as client:
        assert client.status(timeout=10).serving


def test_a_replica_started_by_the_run_is_restarted(tmp_path, tiny_llama):
    # Killed in the middle of a weight update (the 3rd since armed: the run's initial weights,
    # then its 1st and 2nd updates): the publish finds the replica gone, the run restarts it
    # and sends the replacement the weights whole. The run's own server (and its replacement)
    # read the failpoint file from the run's environment; a few steps show it works.
    failpoints = tmp_path / "run.failpoints"
    failpoints.write_text("update_weights 3 kill\n")
    run = run_loop(tmp_path / "run", "", f"--config.model.path={tiny_llama}",
                   env={"JAXRLHF_FAILPOINTS": str(failpoints)}, steps=10)  # fmt: skip
    output, _ = run.communicate(timeout=800)
    assert run.returncode == 0, output[-4000:]
    assert not failpoints.exists(), "the failpoint never fired"
    records = check_run(tmp_path / "run", output, steps=10)
    assert totals(records, "generator_restarts") == 1
    assert totals(records, "generator_rejoins") >= 1
    assert "restarting generator" in output
    assert records[-1]["generators_live"] == 1


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"

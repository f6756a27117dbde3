"""A soak with faults: the async loop on the tiny model against 2 generator replicas for about
`--minutes`, while replicas are killed, hung and restarted, the learner is killed and resumed,
and one weight update fails half-way. Exits 1 if any check fails.

    python bench/soak.py                        # ~30 min of faults (and a few minutes around)
    python bench/soak.py --minutes 60 --seed 3  # longer, another fault schedule

1. Two standalone replicas (`python -m generator_service`, the model of `--model`, default the
   tiny Llama of configs/tiny.py) start on loopback ports.
2. A reference run: `--reference-steps` steps of `python -m jaxrlhf.main --config=configs/
   tiny.py` against them, undisturbed. Its step time sizes the soak run (`--minutes`).
3. The soak run: the same command. Faults, from `--seed`, one at a time (each waits until the
   previous one has recovered, at most `--recovery-timeout` s), `--fault-interval` s apart
   (default 60-180): a random replica is SIGKILLed (and a replacement started at its address),
   hung (SIGSTOP for `--hang` s, then SIGCONT; or left hung until it is killed and replaced),
   restarted (SIGTERM, replacement), or its next weight swap fails half-way (failpoint
   `reload_weights 1 fail`, once); the learner is SIGKILLed and resumed
   (`--config.resume=true`) twice, the first time before any replica fault, the second time
   closing the first cycle of faults. Every kind of `--faults` (default: all) happens at least
   once; one replica (drawn
   from the seed) is never killed or restarted, so that one server process lives through the
   whole soak for the resource trend. With `--minutes 0` (one cycle: the smoke test) the
   second resume also ends the run `--tail-steps` steps after the kill, instead of at the
   length sized for the slowest recoveries.
   A replica fault has recovered when the replica serves again and took a weight update
   published after the fault; the learner, when its resumed run logs a step beyond the kill.
4. At the end (`bench/soak_checks.py` says what each check compares, and why):
   - the run exits 0 with every step logged once; every step trained its scheduled prompts,
     each prompt's k samples exactly once (`samples_returned` against `prompt_ids` and the
     schedule), and no sample older than `max_staleness`;
   - in drain mode, its metrics equal the reference run's on the steps before the first
     replica fault (they include steps after the first learner resume);
   - every fault recovered, both replicas serve the final version;
   - no process started by the soak (a marker in the environment) outlives it;
   - each server process's resident memory (alone, and with its engine processes) grew at most
     10% after `--warmup` s of serving, and its thread and descriptor counts are flat
     (`/proc/PID/status`, `/proc/PID/fd`, sampled every `--sample-every` s);
   - each learner process's resident memory grew at most 10% from the end of its warm-up to its
     last training step: `--learner-warmup` s after its start and `--learner-warmup-steps`
     steps past the step it started at, whichever is later (imports, compiles, the first
     checkpoints and evaluation fill its memory; on a loaded machine seconds alone ended the
     warm-up before the first compile did). Its threads are not checked: the pool's call
     threads come and go with the load. The learners' samples go to `{out}/soak.json`.

Prints a table (Markdown, for BENCHMARKS.md) and one JSON line; writes `{out}/soak.json`.
Extra `--config.KEY=VALUE` arguments go to both runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import soak_checks as checks  # noqa: E402
from bench.soak_fleet import LearnerRun, Replica, Sampler, orphans_after  # noqa: E402

REPLICA_FAULTS = ("kill", "hang", "hang-replace", "restart", "fail-update")
ENDING = frozenset({"kill", "hang-replace", "restart"})  # the server process ends
LEARNER_KILL = "learner-kill"
GENERATE_DEADLINE_S = 15  # a replica hung longer than this fails its Generate calls
FAULT_SLOWDOWN = 1.2  # steps are slower while a replica is down or the learner restarts


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="of the soak run")
    parser.add_argument("--steps", type=int, default=0,
                        help="steps of the soak run (0: as many as --minutes allow)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="of the fault schedule")
    parser.add_argument("--model", default="tiny", help="config.model.path of both runs")
    parser.add_argument("--out", default="runs/soak", help="deleted first")
    parser.add_argument("--fault-interval", default="60,180", help="seconds, min,max")
    parser.add_argument("--hang", default="5,45", help="seconds a replica stays stopped")
    parser.add_argument("--recovery-timeout", type=float, default=300.0)
    parser.add_argument("--reference-steps", type=int, default=30)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--faults", default=",".join(REPLICA_FAULTS),
                        help="the replica fault kinds injected (default: every kind)")  # fmt: skip
    parser.add_argument("--tail-steps", type=int, default=3,
                        help="--minutes 0: steps after the second learner kill")  # fmt: skip
    parser.add_argument(
        "--mini-batches",
        type=int,
        default=0,
        help="config.num_mini_batches (0: one step off-policy, sync_every 1)",
    )
    parser.add_argument(
        "--transport",
        default="stream",
        choices=("stream", "shared", "auto"),
        help="config.generator.weight_transport (stream: as remote replicas)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=120.0,
        help="seconds a server serves before its resource trend starts",
    )
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--learner-warmup", type=float, default=60.0,
                        help="seconds a learner process runs (imports, compiles, first steps) "
                             "before its memory trend starts")  # fmt: skip
    parser.add_argument("--learner-warmup-steps", type=int, default=20,
                        help="steps a learner process trains past the step it started at before "
                             "its memory trend starts (also)")  # fmt: skip
    parser.add_argument("--max-rss-growth", type=float, default=0.10)
    parser.add_argument("--thread-slack", type=int, default=2)
    parser.add_argument("--fd-slack", type=int, default=4)
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if not a.startswith("--config.")]
    if unknown:
        parser.error(f"unknown arguments {unknown} (only --config.KEY=VALUE pass through)")
    args.faults = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    if not args.faults or set(args.faults) - set(REPLICA_FAULTS):
        parser.error(f"--faults {args.faults}: choose from {', '.join(REPLICA_FAULTS)}")
    args.fault_interval = _pair(parser, "--fault-interval", args.fault_interval)
    args.hang = _pair(parser, "--hang", args.hang)
    if args.reference_steps < args.checkpoint_every + 3:
        parser.error(
            f"--reference-steps {args.reference_steps} must be >= --checkpoint-every + 3 "
            f"({args.checkpoint_every + 3}): the first learner kill falls after the first "
            "checkpoint and the reference run must cover the steps resumed after it"
        )
    return args, extra


def _pair(parser, flag: str, text: str) -> tuple[float, float]:
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        parser.error(f"{flag} {text!r}: expected two numbers, min,max")
    if not 0 <= low <= high:
        parser.error(f"{flag} {text!r}: need 0 <= min <= max")
    return low, high


def say(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_args(args, addresses: str, model: Path, steps: int, extra: list[str]) -> list[str]:
    """The config of both runs (configs/tiny.py, the replicas, short deadlines)."""
    staleness = ([f"--config.num_mini_batches={args.mini_batches}"] if args.mini_batches
                 else ["--config.max_staleness=1"])  # fmt: skip
    return [
        "--config=configs/tiny.py", f"--config.model.path={model}",
        f"--config.total_steps={steps}", *staleness, "--config.eval.at_start=false",
        "--config.eval.at_end=false", f"--config.checkpoint.every={args.checkpoint_every}",
        "--config.export=false", f"--config.generator.addresses={addresses}",
        "--config.generator.probe_interval_s=0.5", "--config.generator.update_timeout_s=20",
        f"--config.generator.generate_timeout_s={GENERATE_DEADLINE_S}",
        f"--config.generator.weight_transport={args.transport}", *extra,
    ]  # fmt: skip


def wait_until(
    condition: Callable[[], bool], timeout: float, alive: Callable[[], bool], poll: float = 0.5
) -> bool:
    """Polls `condition` until it holds (True), `timeout` passes or `alive()` turns False."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        if condition():
            return True
        time.sleep(poll)
    return condition()


class Soak:
    """The fault schedule against one soak run, and what each fault took to recover."""

    def __init__(self, args, run: LearnerRun, replicas: list[Replica], sampler: Sampler,
                 rng: random.Random, steps: int, margin_s: float):  # fmt: skip
        self.args, self.run, self.replicas = args, run, replicas
        self.sampler, self.rng, self.steps = sampler, rng, steps
        self.margin_s = margin_s  # no fault with fewer seconds of steps left
        self.resident = rng.choice(replicas)  # never killed nor restarted
        self.events: list[dict] = []
        self.first_replica_fault_step: int | None = None
        self.first_resume_step = 0
        # With --minutes 0 the run ends `--tail-steps` after the last fault (`kill_learner`).
        self.end_early = args.minutes <= 0

    def learner_alive(self) -> bool:
        return self.run.poll() is None

    def version(self) -> int:
        records = self.run.records()
        return records[-1]["policy_version"] if records else -1

    def drive(self, step_s: float, planned_seconds: float) -> None:
        """Kills and resumes the learner once, then injects faults until the schedule is spent:
        the first cycle (every kind) done and `planned_seconds` gone, or too few steps left
        for a fault to recover before the run ends."""
        started = time.monotonic()
        kill_at = self.rng.randint(self.args.checkpoint_every + 1,
                                   min(2 * self.args.checkpoint_every,
                                       self.args.reference_steps - 2))  # fmt: skip
        if not wait_until(lambda: self.run.last_step() >= kill_at, 3600, self.learner_alive,
                          poll=0.05):  # fmt: skip
            return
        self.first_resume_step = self.kill_learner()
        cycle = len(self.args.faults) + 1

        def near_end() -> bool:
            left = (self.steps - self.run.last_step()) * step_s
            return left < max(self.margin_s, 0.1 * self.steps * step_s)

        for count, action in enumerate(self.plan(), start=1):
            delay = self.rng.uniform(*self.args.fault_interval)
            spent = time.monotonic() - started > planned_seconds and count > cycle
            if spent or near_end():
                return
            if wait_until(near_end, delay, self.learner_alive) or not self.learner_alive():
                return
            if action == LEARNER_KILL:
                self.kill_learner(end=self.end_early and count == cycle)
            else:
                self.replica_fault(action)

    def plan(self) -> Iterator[str]:
        """A first cycle of every replica fault kind of `--faults`, shuffled, closed by the
        second learner kill, then random replica faults (the failing update only once)."""
        first = list(self.args.faults)
        self.rng.shuffle(first)
        yield from first
        yield LEARNER_KILL
        again = [k for k in self.args.faults if k != "fail-update"]
        while again:
            yield self.rng.choice(again)

    def kill_learner(self, end: bool = False) -> int:
        """SIGKILLs the learner and resumes it (with `end`, for `--tail-steps` more steps:
        the run's new length); returns the step it resumed from (its checkpoint's): the steps
        after it are trained again by the resumed process."""
        step = self.run.last_step()
        say(f"fault: learner killed after step {step}")
        t0 = time.monotonic()
        self.run.kill()
        if end and step + self.args.tail_steps < self.steps:
            self.steps = step + self.args.tail_steps
            say(f"the resumed run ends at step {self.steps}")
        process = self.run.start(resume=True, steps=self.steps)
        self.sampler.track("learner", process.pid)
        recovered = wait_until(lambda: self.run.last_step() > step, self.args.recovery_timeout,
                               self.learner_alive)  # fmt: skip
        self.record(LEARNER_KILL, "learner", step, t0, recovered)
        found = re.search(r"resumed from step (\d+)", self.run.logs[-1].read_text())
        return int(found.group(1)) if found else step

    def replica_fault(self, kind: str) -> None:
        choices = [r for r in self.replicas if kind not in ENDING or r is not self.resident]
        replica = self.rng.choice(choices)
        step, version = self.run.last_step(), self.version()
        if self.first_replica_fault_step is None:
            self.first_replica_fault_step = step + 1
        say(f"fault: {kind} replica {replica.name} after step {step} (version {version})")
        t0 = time.monotonic()
        try:
            getattr(self, "_" + kind.replace("-", "_"))(replica)
        except (RuntimeError, TimeoutError) as error:  # a replacement that did not start
            say(f"{kind} replica {replica.name}: {error}")

        def back() -> bool:
            status = None if replica.armed() else replica.status()
            return status is not None and status.serving and status.policy_version > version

        recovered = wait_until(back, self.args.recovery_timeout, self.learner_alive)
        self.record(kind, replica.name, step, t0, recovered)
        if not recovered and self.learner_alive():
            say(f"replica {replica.name} did not recover from {kind}: restarting it to go on")
            replica.stop()
            try:
                self.replace(replica)
            except (RuntimeError, TimeoutError) as error:
                say(f"replica {replica.name} could not be restarted: {error}")

    def record(self, kind: str, target: str, step: int, t0: float, recovered: bool) -> None:
        seconds = time.monotonic() - t0
        self.events.append(dict(kind=kind, target=target, after_step=step,
                                recovered=recovered, recovery_s=round(seconds, 1)))  # fmt: skip
        say(f"{kind} {target}: {'recovered' if recovered else 'NOT recovered'} in {seconds:.0f} s")

    def replace(self, replica: Replica) -> None:
        server = replica.start()
        self.sampler.track(f"server {replica.name}", server.process.pid)

    def _kill(self, replica: Replica) -> None:
        replica.kill()
        self.replace(replica)

    def _hang(self, replica: Replica) -> None:
        replica.signal(signal.SIGSTOP)
        time.sleep(self.rng.uniform(*self.args.hang))
        replica.signal(signal.SIGCONT)

    def _hang_replace(self, replica: Replica) -> None:
        """Left hung: nobody continues it; after a while it is killed and replaced."""
        replica.signal(signal.SIGSTOP)
        time.sleep(self.rng.uniform(*self.args.hang))
        self._kill(replica)

    def _restart(self, replica: Replica) -> None:
        replica.stop()
        self.replace(replica)

    def _fail_update(self, replica: Replica) -> None:
        replica.arm("reload_weights 1 fail")


def schedule_ids(model: Path, extra: list[str]) -> Callable[[int], list[str]]:
    """batch index -> the prompt ids the runs must train on, built as the learner builds them
    (configs/tiny.py, the tokenizer of `model`)."""
    from configs.tiny import get_config
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.rl.tasks import build_task
    from jaxrlhf.rl.trainer import prompts_for_batch_fn

    config = get_config()
    for item in extra:  # the task's own keys may be overridden too
        key = item[len("--config.") :].partition("=")[0]
        if key.startswith(("task.", "rollout.prompts_per_batch", "seed")):
            raise SystemExit(f"--config.{key}: the soak checks the schedule of configs/tiny.py")
    tokenizer = load_tokenizer(model)
    schedule = prompts_for_batch_fn(build_task(config, tokenizer, test=False),
                                    config.rollout.prompts_per_batch, config.seed)  # fmt: skip
    return lambda index: [p.id for p in schedule(index)]


def start_replicas(model: Path, folder: Path, marker: str, sampler: Sampler) -> list[Replica]:
    """Replicas A and B, started side by side."""
    replicas = [Replica(name, model, folder, marker) for name in ("A", "B")]
    errors: list[BaseException] = []

    def start(replica: Replica) -> None:
        try:
            server = replica.start()
            sampler.track(f"server {replica.name}", server.process.pid)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=start, args=(r,)) for r in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for replica in replicas:
            replica.stop()
        raise errors[0]
    return replicas


def reference_run(
    args, out: Path, base: Callable[[int], list[str]], marker: str
) -> tuple[list[dict], float]:
    """The undisturbed run's records, and the seconds its process spent outside its steps
    (start-up, compilation, shutdown): what a learner resume costs."""
    run = LearnerRun(out / "reference", base(args.reference_steps), marker)
    say(f"reference run: {args.reference_steps} undisturbed steps")
    t0 = time.monotonic()
    run.start()
    if run.wait() != 0:
        raise SystemExit(f"the reference run failed:\n{run.log_tail()}")
    records = run.records()
    return records, time.monotonic() - t0 - sum(r["step_s"] for r in records)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Measured seconds the faults cost on this machine, that size the soak run."""

    replica_start_s: float  # the slower of the first two replicas' starts (side by side)
    learner_start_s: float  # the reference run's time outside its steps

    def cycle_s(self, args) -> float:
        """One cycle of faults, each recovering before the next: a replacement server per
        fault that ends one (kill, hang-replace, restart), two learner resumes, the hangs and
        the intervals."""
        hangs = sum(kind.startswith("hang") for kind in args.faults)
        waits = (len(args.faults) + 1) * args.fault_interval[1] + hangs * args.hang[1]
        starts = sum(kind in ENDING for kind in args.faults)
        return starts * self.replica_start_s + 2 * self.learner_start_s + waits

    def margin_s(self) -> float:
        """No fault is injected with fewer seconds of steps left: the slower recovery, with
        room for the rejoin."""
        return 1.5 * max(self.replica_start_s, self.learner_start_s)


def soak_steps(args, reference: list[dict], costs: Costs) -> tuple[int, float]:
    """(steps of the soak run, the reference's median seconds per step after its first 2).
    Enough steps for `--minutes` of faults, at least one whole cycle of them, and the recovery
    of the last one, with room for the steps that faults slow down."""
    step_s = statistics.median(r["step_s"] for r in reference[2:] or reference)
    seconds = args.minutes * 60 + costs.cycle_s(args) + costs.margin_s()
    wanted = seconds * FAULT_SLOWDOWN / step_s
    return (args.steps or max(args.reference_steps, math.ceil(wanted))), step_s


def final_checks(
    args, soak: Soak, run: LearnerRun, reference: list[dict], schedule, sampler: Sampler,
    final_versions: dict, left,
) -> list[checks.Check]:  # fmt: skip
    records = run.records()
    bound = args.mini_batches - 1 if args.mini_batches else 1
    k = 2  # configs/tiny.py's samples per prompt
    out = [
        checks.steps_complete(records, soak.steps, run.poll()),
        checks.exactly_once(records, schedule, k),
        checks.versions_within_bound(records, bound),
    ]
    upto = checks.undisturbed_steps(records, soak.first_replica_fault_step)
    out.append(checks.equals_reference(records, reference, upto, soak.first_resume_step + 1))
    done = {e["kind"] for e in soak.events}
    missing = [k for k in (*args.faults, LEARNER_KILL) if k not in done]
    kills = sum(e["kind"] == LEARNER_KILL for e in soak.events)
    out.append(checks.Check("every fault kind happened", not missing and kills >= 2,
                            f"{len(soak.events)} faults, {kills} learner kills"
                            + (f"; never: {missing}" if missing else "")))  # fmt: skip
    lost = [f"{e['kind']} {e['target']} after step {e['after_step']}" for e in soak.events
            if not e["recovered"]]  # fmt: skip
    out.append(checks.Check("every fault recovered", not lost, "; ".join(lost) or "all"))
    final = records[-1]["policy_version"] if records else None
    behind = {name: v for name, v in final_versions.items() if v != final}
    out.append(checks.Check("replicas end at the final version", not behind,
                            f"final {final}, replicas {final_versions}"))  # fmt: skip
    out.append(checks.no_orphans(left))
    out.append(checks.resources_flat(server_trends(args, sampler), args.max_rss_growth,
                                     args.thread_slack, args.fd_slack))  # fmt: skip
    out.append(checks.learner_memory_flat(learner_trends(args, sampler), args.max_rss_growth))
    return out


def server_trends(args, sampler: Sampler) -> list[checks.Trend]:
    trends = []
    for label, series in sampler.series.items():
        if label.startswith("server"):
            found = checks.trend(label, series, sampler.ready[label] + args.warmup)
            if found is not None:
                trends.append(found)
    return trends


def learner_trends(args, sampler: Sampler) -> list[checks.Trend]:
    """The trends of the learner processes (one per start: killed and resumed) that ran past
    their warm-up (module docstring)."""
    found = []
    for label, series in sampler.series.items():
        if label.startswith("learner"):
            ready = sampler.ready[label]
            step = sampler.time_of_step(sampler.step_at(ready) + args.learner_warmup_steps, ready)
            if step is not None:
                found.append(checks.trend(label, series, max(ready + args.learner_warmup, step)))
    return [t for t in found if t is not None]


def learner_series(sampler: Sampler) -> dict:
    """Each learner process's samples (soak s, RSS MB) and the learner's step at each sample."""
    return {
        "steps": [[round(t, 1), step] for t, step in sampler.steps],
        **{label: [[round(u.t, 1), round(u.rss_kb / 1024)] for u in series]
           for label, series in sampler.series.items() if label.startswith("learner")},
    }  # fmt: skip


def report(args, soak: Soak, results: list[checks.Check], sampler: Sampler, steps: int,
           step_s: float, wall_s: float) -> dict:  # fmt: skip
    rows = [
        ("date, machine", f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores"),
        ("commit", _commit()),
        ("command", "`python bench/soak.py " + " ".join(sys.argv[1:]) + "`"),
        ("soak run", f"{steps} steps in {wall_s / 60:.1f} min (undisturbed: {step_s:.2f} s "
                     "per step)"),
    ]  # fmt: skip
    for kind in (*REPLICA_FAULTS, LEARNER_KILL):
        times = [e["recovery_s"] for e in soak.events if e["kind"] == kind and e["recovered"]]
        count = sum(e["kind"] == kind for e in soak.events)
        if count:
            rows.append((f"fault: {kind}", f"{count}x, recovered in {_spread(times)} s"))
    for check in results:
        rows.append((("PASS " if check.ok else "FAIL ") + check.name, check.detail))
    trends = [*server_trends(args, sampler), *learner_trends(args, sampler)]
    for t in trends:
        rows.append((t.label, f"over {t.seconds / 60:.1f} min: RSS {t.rss_mb[0]:.0f} -> "
                     f"{t.rss_mb[1]:.0f} MB ({100 * t.growth(t.rss_mb):+.1f}%), with engine "
                     f"{t.tree_rss_mb[0]:.0f} -> {t.tree_rss_mb[1]:.0f} MB "
                     f"({100 * t.growth(t.tree_rss_mb):+.1f}%), threads {t.threads[0]} -> "
                     f"{t.threads[1]}, fds {t.fds[0]} -> {t.fds[1]}"))  # fmt: skip
    print(checks.markdown_table(rows))
    return {
        "ok": all(c.ok for c in results),
        "steps": steps,
        "wall_s": round(wall_s, 1),
        "undisturbed_step_s": step_s,
        "checks": {c.name: {"ok": c.ok, "detail": c.detail} for c in results},
        "faults": soak.events,
        "trends": [t.__dict__ for t in trends],
        "learner_samples": learner_series(sampler),
    }


def _spread(times: list[float]) -> str:
    if not times:
        return "-"
    return f"{statistics.median(times):.0f} (max {max(times):.0f})"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    from jaxrlhf.models.paths import resolve_model

    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model = resolve_model(args.model)
    schedule = schedule_ids(model, extra)
    marker, rng = uuid.uuid4().hex, random.Random(args.seed)
    sampler = Sampler(args.sample_every)
    sampler.start()
    say(f"starting 2 replicas of {model}")
    t0 = time.monotonic()
    replicas = start_replicas(model, out, marker, sampler)
    replica_start_s = time.monotonic() - t0
    addresses = ",".join(r.address for r in replicas)
    run = None
    try:
        reference, learner_start_s = reference_run(
            args, out, lambda n: run_args(args, addresses, model, n, extra), marker
        )
        costs = Costs(replica_start_s, learner_start_s)
        steps, step_s = soak_steps(args, reference, costs)
        run = LearnerRun(out / "soak", run_args(args, addresses, model, steps, extra), marker)
        soak = Soak(args, run, replicas, sampler, rng, steps, costs.margin_s())
        say(f"soak run: {steps} steps (~{steps * step_s / 60:.1f} min undisturbed; replica "
            f"start {replica_start_s:.0f} s, learner start {learner_start_s:.0f} s); "
            f"replica {soak.resident.name} is never killed")  # fmt: skip
        t0 = time.monotonic()
        sampler.progress = run.last_step
        sampler.track("learner", run.start().pid)
        soak.drive(step_s, args.minutes * 60)
        say("faults done; waiting for the run to end")
        # The learner's memory trend ends with its training: what the end of a run does (the
        # last evaluation, the plot, the export) is not a leak.
        wait_until(lambda: run.last_step() >= soak.steps, math.inf, lambda: run.poll() is None)
        sampler.untrack(run.process.pid)
        run.wait()
        # The last samples must be of servers at work: stopping them would read as shrinking
        # (threads, descriptors, the engine's memory) and hide a leak.
        sampler.stop()
        wall_s = time.monotonic() - t0
        final_versions = {}
        for replica in replicas:
            status = replica.status()
            final_versions[replica.name] = status.policy_version if status else None
    finally:
        if run is not None:
            run.kill()
        stopping = [threading.Thread(target=replica.stop) for replica in replicas]
        for thread in stopping:  # at once: each waits seconds for its engine to exit
            thread.start()
        for thread in stopping:
            thread.join()
        sampler.stop()
    left = orphans_after(marker, grace_s=30)
    for pid, _ in left:  # the soak started them: end them after reporting
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    results = final_checks(args, soak, run, reference, schedule, sampler, final_versions,
                           left)  # fmt: skip
    summary = report(args, soak, results, sampler, soak.steps, step_s, wall_s)
    (out / "soak.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    if not summary["ok"]:
        say("FAILED: " + ", ".join(c.name for c in results if not c.ok))
        say(f"learner log: {run.logs[-1]}\n{run.log_tail(20)}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

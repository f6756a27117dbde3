"""The soak with faults (`bench/soak.py`): its checks on hand-built records (each must fail on the
defect it exists for), its orphan scan on real processes, and a short soak run for real with
every fault kind, whose checks must all pass."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import soak
from bench import soak_checks as checks
from bench.soak_fleet import MARKER_ENV, Sampler, Usage, marked_processes, orphans_after
from tests.conftest import REPO

SCHEDULE = {0: ["p3", "p1"], 1: ["p0", "p2"], 2: ["p1", "p3"]}
K = 2


def record(step: int, **overrides) -> dict:
    """A clean step of a run at base version 10, as metrics.jsonl logs it."""
    ids = SCHEDULE[step - 1]
    out = {
        **{key: 0.5 + step for key in checks.RESUME_METRICS},
        "step": step, "policy_version": 10 + step, "prompt_ids": ids, "prompts": 2, "samples": 4,
        "samples_returned": [[p, s] for p in ids for s in range(K)],
        "staleness_max": 1, "token_staleness_max": 1, "generators_live": 2,
        "generator_failures": 0, "generator_failovers": 0, "generator_rejoins": 0,
        "generator_restarts": 0,
    }  # fmt: skip
    out.update(overrides)
    return out


def clean_run() -> list[dict]:
    return [record(step) for step in (1, 2, 3)]


def test_exactly_once_passes_a_clean_run():
    assert checks.exactly_once(clean_run(), SCHEDULE.__getitem__, K).ok


@pytest.mark.parametrize(
    "returned",
    [
        [["p0", 0], ["p0", 1], ["p2", 0], ["p2", 1], ["p2", 1]],  # a sample twice
        [["p0", 0], ["p0", 1], ["p2", 0]],  # a sample lost
        [["p0", 0], ["p0", 1], ["p2", 0], ["p1", 1]],  # another prompt's sample
    ],
)
def test_exactly_once_fails_a_duplicate_or_lost_sample(returned):
    records = clean_run()
    records[1]["samples_returned"] = returned
    check = checks.exactly_once(records, SCHEDULE.__getitem__, K)
    assert not check.ok and "step 2" in check.detail


def test_exactly_once_fails_prompts_off_schedule_or_no_samples_returned():
    records = clean_run()
    records[2]["prompt_ids"] = ["p3", "p1"]
    assert "schedule" in checks.exactly_once(records, SCHEDULE.__getitem__, K).detail
    records = clean_run()
    del records[0]["samples_returned"]
    assert "no samples_returned" in checks.exactly_once(records, SCHEDULE.__getitem__, K).detail


def test_versions_within_bound():
    assert checks.versions_within_bound(clean_run(), 1).ok
    stale = clean_run()
    stale[2]["staleness_max"] = stale[2]["token_staleness_max"] = 2
    assert not checks.versions_within_bound(stale, 1).ok
    skipped = clean_run()
    skipped[2]["policy_version"] += 1  # a version published twice, or a step lost
    assert "version" in checks.versions_within_bound(skipped, 1).detail


def test_steps_complete():
    assert checks.steps_complete(clean_run(), 3, 0).ok
    assert not checks.steps_complete(clean_run(), 3, -9).ok
    assert not checks.steps_complete(clean_run()[:2], 3, 0).ok


def test_undisturbed_steps_stop_before_the_first_fault_or_fleet_event():
    assert checks.undisturbed_steps(clean_run(), None) == 3
    assert checks.undisturbed_steps(clean_run(), 3) == 2
    records = clean_run()
    records[1]["generator_failures"] = 1
    assert checks.undisturbed_steps(records, None) == 1
    records = clean_run()
    records[2]["generators_live"] = 1
    assert checks.undisturbed_steps(records, None) == 2


def test_equals_reference():
    # The reference ran at other versions: only the numbering from its base must agree.
    reference = [dict(r, policy_version=r["step"]) for r in clean_run()]
    assert checks.equals_reference(clean_run(), reference, upto=3, must_cover=3).ok
    drifted = clean_run()
    drifted[2]["loss"] *= 1 + 1e-3
    check = checks.equals_reference(drifted, reference, upto=3, must_cover=3)
    assert not check.ok and "step 3: loss" in check.detail
    # Steps past `upto` (touched by a replica fault) are not compared.
    assert checks.equals_reference(drifted, reference, upto=2, must_cover=2).ok
    # Comparing less than the steps after the learner's resume proves nothing: a failure.
    assert not checks.equals_reference(clean_run(), reference, upto=2, must_cover=3).ok


def test_soak_steps_cover_a_measured_cycle_of_faults():
    # Hand-computed: a cycle of 3 replica starts of 40 s, 2 learner starts of 30 s, 6 waits of
    # at most 3 s and 2 hangs of at most 8 s = 214 s; the margin 1.5 x 40 = 60 s; 1.2 x 274 s
    # at 2 s per step = 164.4 -> 165 steps (the reference's first 2 steps are left out).
    args, _ = soak.parse_args(["--minutes", "0", "--fault-interval", "1,3", "--hang", "2,8",
                               "--reference-steps", "5", "--checkpoint-every", "2"])  # fmt: skip
    costs = soak.Costs(replica_start_s=40.0, learner_start_s=30.0)
    assert costs.cycle_s(args) == 214.0 and costs.margin_s() == 60.0
    reference = [{"step_s": 9.0}, {"step_s": 9.0}, *[{"step_s": 2.0}] * 3]
    assert soak.soak_steps(args, reference, costs) == (165, 2.0)
    args.minutes = 1.0  # a minute more of faults: 72 s more of steps at 1.2 x
    assert soak.soak_steps(args, reference, costs) == (201, 2.0)


def usage_series(rss_end: int, threads_end: int, fds_end: int, count: int = 10) -> list[Usage]:
    """From 100 MB, 20 threads, 30 fds to the given ends, linearly over `count` samples."""

    def at(i: int, start: int, end: int) -> int:
        return round(start + (end - start) * i / (count - 1))

    return [
        Usage(float(i), at(i, 100 << 10, rss_end << 10), at(i, 300 << 10, (rss_end + 200) << 10),
              at(i, 20, threads_end), at(i, 30, fds_end))
        for i in range(count)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("rss_end", "threads_end", "fds_end", "ok"),
    [(105, 21, 32, True), (120, 20, 30, False), (100, 24, 30, False), (100, 20, 40, False)],
)
def test_resources_flat(rss_end, threads_end, fds_end, ok):
    trend = checks.trend("server A", usage_series(rss_end, threads_end, fds_end), after=0.0)
    assert checks.resources_flat([trend], 0.10, thread_slack=2, fd_slack=4).ok is ok


def test_resources_flat_needs_a_measured_server():
    assert checks.trend("server A", usage_series(100, 20, 30, count=4), after=0.0) is None
    assert not checks.resources_flat([], 0.10, 2, 4).ok


@pytest.mark.parametrize(("rss_end", "ok"), [(109, True), (115, False)])
def test_learner_memory_flat(rss_end, ok):
    """A learner whose memory grew ~11% after its warm-up fails (the records it kept grew it
    16% over the soak's 11,900 steps); its threads are not judged."""
    trend = checks.trend("learner (pid 7)", usage_series(rss_end, 40, 30), after=0.0)
    assert checks.learner_memory_flat([trend], 0.10).ok is ok
    assert not checks.learner_memory_flat([], 0.10).ok


def test_orphan_scan_finds_marked_processes_only(tmp_path):
    marker = os.urandom(8).hex()
    marked = subprocess.Popen(["sleep", "60"], env=dict(os.environ, **{MARKER_ENV: marker}))
    unmarked = subprocess.Popen(["sleep", "60"])
    try:
        assert [pid for pid, _ in marked_processes(marker)] == [marked.pid]
        assert "sleep 60" in marked_processes(marker)[0][1]
    finally:
        marked.kill()
        marked.wait()
        unmarked.kill()
        unmarked.wait()
    assert orphans_after(marker, grace_s=5) == []


def test_learner_command_names_the_config_file_first(tmp_path, monkeypatch):
    # absl exits with "Found --config.output_dir=... before a value for --config was
    # specified" when any --config.KEY=VALUE comes before --config=FILE.
    from bench import soak_fleet

    started = []
    monkeypatch.setattr(
        soak_fleet.subprocess, "Popen", lambda command, **_: started.append(command)
    )
    args = soak.run_args(soak.parse_args([])[0], "127.0.0.1:1", Path("m"), 3, [])
    soak_fleet.LearnerRun(tmp_path, args, "marker").start(resume=True)
    flags = [a for a in started[0] if a.startswith("--config")]
    assert flags[0] == "--config=configs/tiny.py"
    assert f"--config.output_dir={tmp_path}" in flags and "--config.resume=true" in flags
    assert "--config.total_steps=3" in flags
    # A resume that ends the run sooner (the smoke's last fault) gives its new length, once.
    run = soak_fleet.LearnerRun(tmp_path, args, "marker")
    run.start(resume=True, steps=7)
    steps = [a for a in started[1] if a.startswith("--config.total_steps=")]
    assert steps == ["--config.total_steps=7"]


def test_the_second_learner_kill_closes_the_first_cycle():
    args, _ = soak.parse_args(["--minutes", "0"])
    for seed in range(5):
        first = list(itertools.islice(
            soak.Soak(args, None, ["A", "B"], None, random.Random(seed), 10, 1.0).plan(),
            len(soak.REPLICA_FAULTS) + 1,
        ))  # fmt: skip
        assert sorted(first[:-1]) == sorted(soak.REPLICA_FAULTS)
        assert first[-1] == soak.LEARNER_KILL
    # --faults: only those kinds, and after the first cycle no second failing update.
    args, _ = soak.parse_args(["--minutes", "0", "--faults", "hang,fail-update"])
    plan = soak.Soak(args, None, ["A", "B"], None, random.Random(0), 10, 1.0).plan()
    first = list(itertools.islice(plan, 6))
    assert sorted(first[:2]) == ["fail-update", "hang"] and first[2] == soak.LEARNER_KILL
    assert first[3:] == ["hang"] * 3
    with pytest.raises(SystemExit):
        soak.parse_args(["--faults", "hang,explode"])


def test_sampler_reads_proc_and_stops_at_exit():
    # A child with one more thread than a plain interpreter and a known number of descriptors.
    code = (
        "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
        "print('ready', flush=True)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    sampler = Sampler(interval=0.05)
    sampler.track("child", child.pid)
    sampler.start()
    label = f"child (pid {child.pid})"
    try:
        deadline = time.monotonic() + 30
        while len(sampler.series[label]) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        usage = sampler.series[label][-1]
        assert usage.threads == 2
        assert usage.fds == len(os.listdir(f"/proc/{child.pid}/fd"))
        assert 0 < usage.rss_kb <= usage.tree_rss_kb
        child.kill()
        child.wait()
        count = len(sampler.series[label])
        deadline = time.monotonic() + 30
        while child.pid in sampler._tracked.values() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.pid not in sampler._tracked.values()
        assert len(sampler.series[label]) <= count + 1  # no samples of a process gone
    finally:
        sampler.stop()
        child.kill()
        child.wait()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_short_soak_passes_its_checks(tiny_llama, tmp_path, own_generator):
    # One cycle of the schedule (--minutes 0), faults 1-3 s apart: a hang of up to 8 s, an
    # update failing half-way, two learner kills (the first one resumes from step 2). The
    # faults that end a server (kill, hang-replace, restart) each cost an engine start (~30 s
    # here); tests/fleet/test_fleet.py has each of them against real servers mid-run. The last
    # learner process trains 150 more steps (about 25-50 s of the tiny model's); its memory is
    # measured from 50 steps past its start (a warm-up of 15 s alone, under a loaded suite,
    # ended before its compiles and first checkpoints did: 14-18% "growth").
    out = tmp_path / "soak"
    command = [
        sys.executable, "bench/soak.py", "--model", str(tiny_llama), "--out", str(out),
        "--minutes", "0", "--faults", "hang,fail-update", "--fault-interval", "1,3",
        "--hang", "2,4",
        "--recovery-timeout", "150",
        "--reference-steps", "5", "--checkpoint-every", "2", "--warmup", "5",
        "--learner-warmup", "15", "--learner-warmup-steps", "50", "--tail-steps", "150",
        "--sample-every", "1", "--seed", "0",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1400)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    failed = {name: c["detail"] for name, c in summary["checks"].items() if not c["ok"]}
    assert result.returncode == 0 and not failed, (failed, result.stderr[-4000:])
    kinds = {event["kind"] for event in summary["faults"]}
    assert kinds == {"hang", "fail-update", "learner-kill"}
    assert (out / "soak.json").exists()

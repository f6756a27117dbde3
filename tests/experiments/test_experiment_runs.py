"""Every experiment and the async speedup bench, run for real on the tiny model (smoke tests).

Each drives real `python -m jaxrlhf.main` runs against the suite's shared generator service,
for a step or two, and reads back what it wrote: so that none of them can break silently
(their pure parts are tested by hand in tests/experiments/test_experiments.py).
"""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, start_test_server

# Small held-out splits and no evaluation before training: the runs only need to finish.
QUICK = ["--config.task.num_eval=4", "--config.task.num_test=4", "--config.eval.at_start=false"]


def run(args, timeout=600, env=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", **(env or {}))
    result = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def in_flight_server(tiny_llama, tmp_path_factory):
    """A service swapping in flight with its KV kept, for this module's bench smokes (the runs
    of their drain modes use the suite's shared service)."""
    log = tmp_path_factory.mktemp("in-flight") / "server.log"
    server = start_test_server(tiny_llama, log, ["--swap-mode", "in-flight", "--in-flight-kv",
                                                 "keep"])  # fmt: skip
    yield server
    server.terminate()


@pytest.mark.slow
def test_offpolicy_experiment_runs(generator_address, tmp_path):
    # On the suite's shared service (what a run does when its service dies, by hand:
    # tests/experiments/test_experiments.py::test_a_run_whose_service_died_runs_again_on_a_new_one).
    out = run(["-m", "jaxrlhf.experiments.offpolicy", "--model", "tiny", "--losses", "rloo",
               "--mini-batches", "1,2", "--steps", "2", "--seeds", "0", "--out",
               str(tmp_path / "x"), "--generator-addresses", generator_address,
               *QUICK])  # fmt: skip
    assert "starting a generator service" not in out
    results = json.loads((tmp_path / "x" / "results.json").read_text())
    assert [(c["num_mini_batches"], c["seeds"], c["failed"]) for c in results["cells"]] == [
        (1, 1, 0), (2, 1, 0)]  # fmt: skip
    assert all(math.isfinite(c["test_accuracy_end"]) for c in results["cells"])
    assert [r["staleness_max"] for r in results["runs"]] == [0, 1]
    assert "| rloo | 2 | 1 |" in out and (tmp_path / "x" / "offpolicy.png").exists()


@pytest.mark.slow
def test_offpolicy_experiment_runs_with_continuous_generation(in_flight_server, tmp_path):
    """--generation continuous --lag 1: its runs on the in-flight service, in
    {out}/continuous/lag1/, one version more of staleness allowed than N - 1."""
    out = run(["-m", "jaxrlhf.experiments.offpolicy", "--model", "tiny", "--losses", "grpo",
               "--corrections", "mask", "--mini-batches", "2", "--steps", "2", "--seeds", "0",
               "--out", str(tmp_path), "--generation", "continuous", "--lag", "1",
               "--generator-addresses", f"in-flight-keep={in_flight_server.address}",
               *QUICK])  # fmt: skip
    folder = tmp_path / "continuous" / "lag1"
    results = json.loads((folder / "results.json").read_text())
    assert results["settings"]["generation"] == "continuous" and results["settings"]["lag"] == 1
    assert [(c["loss"], c["seeds"], c["failed"]) for c in results["cells"]] == [("grpo+mask", 1, 0)]
    assert "| grpo+mask | 2 | 1 |" in out and (folder / "offpolicy.png").exists()
    assert "lag 1: sync_every = N, max_staleness = N - 1 + 1" in out
    log = (folder / "grpo+mask" / "N2" / "seed0" / "run.log").read_text()
    assert "swaps: in-flight, KV keep" in log
    assert "--config.sync_every=2 --config.max_staleness=2" in log
    metrics = (folder / "grpo+mask" / "N2" / "seed0" / "metrics.jsonl").read_text()
    records = [json.loads(line) for line in metrics.splitlines()]
    # By hand: no publish before update 2 (sync_every 2), so both batches ran on version 0 and
    # no sample spans a swap; batch 0 is trained from version 0, batch 1 from version 1.
    assert [(r["staleness_max"], r["token_staleness_max"]) for r in records] == [(0, 0), (1, 1)]
    assert [r["mixed_version_fraction"] for r in records] == [0, 0]
    # On-policy at step 1: the learner's log-probs of its own weights' samples match the
    # sampler's up to rounding, so the mask keeps every token.
    assert records[0]["is_kept_fraction"] == 1.0
    assert not (tmp_path / "results.json").exists()
    assert not (tmp_path / "continuous" / "results.json").exists()


@pytest.mark.slow
def test_async_vs_sync_experiment_runs(generator_address, in_flight_server, tmp_path):
    """Continuous async against sync: each mode's runs on the service of its swap setting."""
    generators = f"drain={generator_address},in-flight-keep={in_flight_server.address}"
    out = run(["-m", "jaxrlhf.experiments.async_vs_sync", "--model", "tiny", "--steps", "2",
               "--eval-every", "1", "--seeds", "0", "--out", str(tmp_path), "--async-mode",
               "continuous", "--generator-addresses", generators, *QUICK])  # fmt: skip
    results = json.loads((tmp_path / "results-continuous.json").read_text())
    rows = {(r["split"], r["step"]): r for r in results["comparisons"]}
    assert set(rows) == {(s, n) for s in ("test", "validation") for n in (1, 2)}
    assert all(math.isfinite(r["sync"]) and math.isfinite(r["async"]) for r in rows.values())
    assert results["chosen"] == "default" and "chosen on validation: default" in out
    assert "async: continuous (max_staleness=1)" in out
    assert (tmp_path / "continuous_vs_sync.png").exists()
    assert "swaps: drain" in (tmp_path / "default" / "sync" / "seed0" / "run.log").read_text()
    continuous = tmp_path / "default" / "continuous" / "seed0"
    assert "swaps: in-flight, KV keep" in (continuous / "run.log").read_text()
    records = [json.loads(line) for line in (continuous / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["token_staleness_max"] <= 1 for r in records)


@pytest.mark.slow
def test_compute_experiment_runs(generator_address, tmp_path):
    """K = 2 vs 4 samples per prompt, each run evaluated after every update: the curves, the
    time to the target and the figure come from the runs' own files."""
    out = run(["-m", "jaxrlhf.experiments.compute", "--model", "tiny", "--vary",
               "rollout.samples_per_prompt=2,4", "--steps", "2", "--eval-every", "1", "--seeds",
               "0", "--out", str(tmp_path), "--generator-addresses", generator_address,
               *QUICK])  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["curves"]) == ["rollout.samples_per_prompt=2",
                                       "rollout.samples_per_prompt=4"]  # fmt: skip
    for variant, rows in results["curves"].items():
        assert [r["step"] for r in rows] == [1, 2]
        assert all(0 <= r["test"] <= 1 and r["seconds"] > 0 and r["seeds"] == 1 for r in rows)
        assert rows[1]["seconds"] > rows[0]["seconds"]
        run_folder = tmp_path / variant / "seed0"
        records = [json.loads(line) for line in (run_folder / "metrics.jsonl").open()]
        assert [r["samples"] for r in records] == [4 * int(variant[-1])] * 2
    assert results["time_to_target"]["target"] is not None
    assert "workload: default, one step off-policy" in out and "learner idle fraction" in out
    assert (tmp_path / "compute.png").exists()


@pytest.mark.slow
def test_async_speedup_bench_runs(generator_address, tmp_path):
    out = run(["bench/async_speedup.py", "--model", "tiny", "--steps", "3", "--warmup", "1",
               "--out", str(tmp_path), f"--config.generator.addresses={generator_address}",
               *QUICK])  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["ideal_speedup"] >= 1.0 and result["achieved_speedup"] > 0
    assert result["sync"]["window"] == result["async"]["window"] == [2, 3]
    assert "ideal speedup" in out


@pytest.mark.slow
def test_swap_modes_bench_runs_each_mode_end_to_end(generator_address, in_flight_server, tmp_path):
    """Each variant against a service in its swap mode (`generator.swap_mode`): in drain mode no
    sample spans a swap, in in-flight mode a sample may, and every token stays within
    max_staleness (its sample's oldest token bounds it)."""
    generators = f"drain={generator_address},in-flight-keep={in_flight_server.address}"
    out = run(["bench/swap_modes.py", "--steps", "3", "--warmup", "1", "--max-response-tokens",
               "48", "--prompts-per-batch", "4", "--variants", "drain,in-flight-keep",
               "--generators", generators, "--out", str(tmp_path)])  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert "time per update (s)" in out and "in-flight-keep / drain: time per update" in out
    for mode, log in (("drain", "swaps: drain"), ("in-flight-keep", "swaps: in-flight, KV keep")):
        assert log in (tmp_path / f"{mode}-0" / "run.log").read_text()
        assert result[mode]["step_s"]["mean"] > 0 and result[mode]["generate_s"]["mean"] > 0
        lines = (tmp_path / f"{mode}-0" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        # One step off (the schedule, by hand): batch 0 is trained from the weights that sampled
        # it, every later one from the next version (it was admitted before that publish).
        assert [r["staleness_max"] for r in records] == [0, 1, 1]
        for record in records:
            assert record["token_staleness_mean"] <= record["staleness_mean"]
            # Two integrals over the replica's own clock: whenever it was not idle, at least
            # one request and at most its capacity were generating.
            window, idle = record["generator_window_s"], record["generator_idle_s"]
            busy = window - idle
            assert record["generator_requests_mean"] * window >= busy - 1e-6
            assert record["generator_occupancy"] * window <= busy + 1e-6
            if mode == "drain":
                assert record["mixed_version_fraction"] == 0
                assert record["token_staleness_mean"] == record["staleness_mean"]


@pytest.mark.slow
def test_pipeline_modes_bench_runs_each_mode_end_to_end(
    generator_address, in_flight_server, tmp_path
):
    """Three modes on a shortened long-tail workload, against the running services it is
    given: sync and one-step-off share the draining one, continuous-grouped (2 prompts a call)
    runs on the in-flight one
    (each run publishes its own weights first; how the runner starts and replaces services is
    tested by hand in tests/experiments/test_experiments.py); every token within the bound, every
    response within its budget."""
    generators = f"drain={generator_address},in-flight-keep={in_flight_server.address}"
    out = run(["bench/pipeline_modes.py", "--workload", "long-tail", "--steps", "3",
               "--warmup", "1", "--out", str(tmp_path), "--generators", generators,
               "--config.rollout.max_response_tokens=24",
               "--config.rollout.length_law=pareto:1.2:4",
               "--config.rollout.prompts_per_batch=4", "--prompts-per-call", "2",
               "--modes", "sync,one-step-off,continuous-grouped"])  # fmt: skip
    result = json.loads((tmp_path / "results.json").read_text())
    assert "update rate / sync" in out and "continuous / one-step-off" not in out
    # `--prompts-per-call` reaches the grouped mode's runs alone.
    commands = {m: (tmp_path / f"{m}-0" / "run.log").read_text().splitlines()[0]
                for m in ("sync", "continuous-grouped")}  # the log's first line  # fmt: skip
    assert "--config.rollout.prompts_per_call=2" in commands["continuous-grouped"].split()
    assert "prompts_per_call" not in commands["sync"]
    assert "starting a generator service" not in out
    assert result["ideal_speedup"] >= 1 and result["sync"]["rate_vs_sync"] == 1
    for mode in ("sync", "one-step-off", "continuous-grouped"):
        figures = result[mode]
        assert figures["step_s"] > 0 and 0 <= figures["generator_occupancy"] <= 1
        assert 0 <= figures["learner_idle_fraction"] < 1
        assert figures["token_staleness_max"] <= (0 if mode == "sync" else 1)
    assert "swaps: in-flight" in (tmp_path / "continuous-grouped-0" / "run.log").read_text()
    lengths = [
        json.loads(line)["response_length_mean"]
        for line in (tmp_path / "continuous-grouped-0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(0 < length <= 24 for length in lengths)


# An arm of each claim (`--arms`), so that every claim's plan, runs and report are exercised.
CLAIM_ARMS = {"pilot": "sync", "a": "continuous", "b": "grpo+mask/N16", "c": "bed/N1", "d": "K2",
              "e": "U2", "f": "grpo+mask", "b-tuning": "ppo/lr5e-06/kl_coef0.02",
              "a-steps": "lr0.0001/one-step-off", "f-replicated": "grpo+mask",
              "e-parts": "U2", "lora-tuning": "full/lr5e-06", "b-rounds": "grpo/N4",
              "d-pilot": "bed/K4", "d-bound": "K4", "lora-compare": "full",
              "lora-smollm2-tuning": "full/lr3e-06", "lora-smollm2-compare": "full"}  # fmt: skip


@pytest.mark.slow
def test_every_claim_runs(generator_address, in_flight_server, tiny_llama, tmp_path,
                          monkeypatch, capsys):  # fmt: skip
    """One seed, two updates, one arm of each claim on the tiny model (its own sizes and
    context), then the claims table from the records alone. The claims command runs in this
    process (its runs are `jaxrlhf.main` subprocesses, as ever), which saves seven start-ups:
    its command line is tested once as typed, by the report below."""
    from jaxrlhf.experiments.claims import claim_registry
    from jaxrlhf.experiments.claims.__main__ import main as claims_main

    assert set(CLAIM_ARMS) == set(claim_registry.names())  # no claim goes without its smoke run

    monkeypatch.setenv("XLA_FLAGS", "")  # the runs' environment, as `run` gives it
    generators = f"drain={generator_address},in-flight-keep={in_flight_server.address}"
    tiny = [f"--config.model.path={tiny_llama}", "--config.rollout.prompts_per_batch=2",
            "--config.rollout.max_prompt_tokens=48", "--config.generator.max_model_len=256",
            *QUICK]  # fmt: skip
    for claim, arms in CLAIM_ARMS.items():
        command = ["--claim", claim, "--arms", arms, "--seeds", "0", "--steps", "2",
                   "--eval-every", "1", "--out", str(tmp_path), "--generator-addresses",
                   generators, *tiny]  # fmt: skip
        if claim_registry.claim(claim).registration:  # pre-registered: its plan first
            claims_main([*command, "--write-plan"])
        claims_main(command)
        assert f"records: {tmp_path / claim}" in capsys.readouterr().out
        record = json.loads((tmp_path / claim / "claim.json").read_text())
        assert record["settings"]["seeds"] == [0] and (tmp_path / claim / "claim.png").exists()
    # The pilot's runs are claim (a)'s first arms: (a) ran continuous alone and pairs both.
    folders = sorted(p.parent.parent.name for p in (tmp_path / "a").glob("*/seed0/summary.json"))
    assert folders == ["continuous", "sync"]
    smollm2 = tmp_path / "lora-smollm2-tuning" / CLAIM_ARMS["lora-smollm2-tuning"] / "seed0"
    assert "/configs/default.py " in (smollm2 / "run.log").read_text().splitlines()[0]
    bed = (tmp_path / "b" / "grpo+mask" / "N16" / "seed0" / "run.log").read_text()
    assert "/configs/bed.py " in bed.splitlines()[0]  # each claim's runs from its own config
    log = (tmp_path / "a" / "continuous" / "seed0" / "run.log").read_text()
    assert "swaps: in-flight, KV keep" in log
    for claim, arm in (("b", "grpo+mask/N16"), ("c", "bed/N1"), ("d", "K2"), ("e", "U2"),
                       ("f", "grpo+mask")):  # fmt: skip
        assert (tmp_path / claim / arm / "seed0" / "summary.json").exists(), (claim, arm)
    tuned = json.loads((tmp_path / "b-tuning" / CLAIM_ARMS["b-tuning"] / "seed0" /
                        "summary.json").read_text())  # fmt: skip
    assert "eval_accuracy_end" in tuned and "test_accuracy_end" not in tuned  # test split off
    metrics = (tmp_path / "e" / "U2" / "seed0" / "metrics.jsonl").read_text()
    assert [json.loads(line)["step"] for line in metrics.splitlines()] == [1, 2]
    # The evaluation after update 1 measured the weights served: with N = 16 (publishes after
    # updates 16 and 2, the last) the start model's, with N = 1 those of update 1.
    for claim, arm, updates in (("b", "grpo+mask/N16", 0), ("c", "bed/N1", 1)):
        lines = (tmp_path / claim / arm / "seed0" / "metrics.jsonl").read_text().splitlines()
        first = json.loads(lines[0])
        assert "test_accuracy" in first and first["evaluated_updates"] == updates, (claim, arm)
    table = run(["-m", "jaxrlhf.experiments.claims", "--report-only", "--out", str(tmp_path)])
    assert table == (tmp_path / "claims.md").read_text()
    assert all(f"| ({claim}) " in table for claim in "abcdef")  # a row each, run or not

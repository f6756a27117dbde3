"""The pure parts of the experiment drivers, on hand-made run outputs (no engine, no training):
bench/async_speedup.py's figures and jaxrlhf.experiments.offpolicy's aggregation and plot."""

import importlib.util
import json
import math
import sys

import pytest

from jaxrlhf.experiments import format_override, load_config, main_command, offpolicy
from tests.conftest import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("async_speedup", REPO / "bench/async_speedup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROWS = 8  # prompts_per_batch x samples_per_prompt of the hand-made runs


def record(step, wait, prepare, train, sync, other, gen_tokens_per_s, length=10.0, **extra):
    return {
        "step": step,
        "wait_for_generation_s": wait,
        "prepare_s": prepare,
        "train_s": train,
        "weight_sync_s": sync,
        "step_s": wait + prepare + train + sync + other,
        "generation_tokens_per_s": gen_tokens_per_s,
        "response_length_mean": length,
        "reward_mean": 0.1 * step,
        "kl": 0.01 * step,
        "staleness_mean": extra.pop("staleness", 0.0),
        "staleness_max": extra.pop("staleness_max", 0),
        **extra,
    }


def sync_records():
    # Step 1 compiles (left out). Steady steps: 80 tokens at 40 tok/s = g 2.0 s; the learner
    # 3 + 4 + 1 + 0.5 = 8.5 s; waits 2.1 s (0.1 s hand-off) -> step 10.6 s.
    return [
        record(1, 2.0, 30.0, 40.0, 2.0, 1.0, 40.0),
        record(2, 2.1, 3.0, 4.0, 1.0, 0.5, 40.0),
        record(3, 2.1, 3.0, 4.0, 1.0, 0.5, 40.0),
        record(4, 2.1, 3.0, 4.0, 1.0, 0.5, 40.0),
    ]


def async_records():
    # No waiting; the learner is 0.5 s slower beside generation (train 4.0 -> 4.5): step 9.0 s.
    # Generation: 80 tokens at 32 tok/s = 2.5 s.
    return [
        record(1, 2.0, 30.0, 40.0, 2.0, 1.0, 40.0, staleness=1.0, staleness_max=1),
        record(2, 0.0, 3.0, 4.5, 1.0, 0.5, 32.0, staleness=1.0, staleness_max=1),
        record(3, 0.0, 3.0, 4.5, 1.0, 0.5, 32.0, staleness=1.0, staleness_max=1),
        record(4, 0.0, 3.0, 4.5, 1.0, 0.5, 32.0, staleness=1.0, staleness_max=1),
    ]


def test_speedup_figures_by_hand(bench):
    figures = bench.speedup_figures(sync_records(), async_records(), ROWS, warmup=1)
    g, t = 2.0, 8.5
    assert figures["generation_s"] == pytest.approx(g)
    assert figures["learner_s"] == pytest.approx(t)
    assert figures["ideal_speedup"] == pytest.approx((g + t) / t)  # 1.2353
    assert figures["achieved_speedup"] == pytest.approx(10.6 / 9.0)
    assert figures["efficiency"] == pytest.approx((10.6 / 9.0) / ((g + t) / t))  # 0.953
    assert figures["ideal_async_step_s"] == pytest.approx(t)
    assert figures["learner_slowdown_s"] == pytest.approx(0.5)
    assert figures["extra_wait_s"] == pytest.approx(0.0)
    assert figures["generation_slowdown_s"] == pytest.approx(0.5)
    sync, asyn = figures["sync"], figures["async"]
    assert sync["window"] == asyn["window"] == [2, 4]
    assert sync["handoff_s"] == pytest.approx(0.1)
    assert sync["weight_sync_share"] == pytest.approx(1.0 / 10.6)
    assert asyn["weight_sync_share"] == pytest.approx(1.0 / 9.0)
    assert sync["other_s"] == pytest.approx(0.5)
    assert asyn["train_s"] == pytest.approx(4.5)


def test_generation_bound_workload_and_recorded_generate_seconds(bench):
    # g = 6 s > t = 4 s: ideal 10 / 6; async waits 6 - 4 = 2 s by design, none extra.
    sync = [record(s, 6.0, 1.0, 2.0, 1.0, 0.0, 1.0, generate_s=6.0) for s in (1, 2, 3)]
    asyn = [record(s, 2.0, 1.0, 2.0, 1.0, 0.0, 1.0, generate_s=6.0) for s in (1, 2, 3)]
    figures = bench.speedup_figures(sync, asyn, ROWS, warmup=1)
    assert figures["generation_s"] == pytest.approx(6.0)  # generate_s wins over the tokens/s
    assert figures["ideal_speedup"] == pytest.approx(10.0 / 6.0)
    assert figures["achieved_speedup"] == pytest.approx(10.0 / 6.0)
    assert figures["efficiency"] == pytest.approx(1.0)
    assert figures["extra_wait_s"] == pytest.approx(0.0)


def test_window_errors(bench):
    with pytest.raises(ValueError, match="warmup"):
        bench.speedup_figures(sync_records(), async_records(), ROWS, warmup=3)
    with pytest.raises(ValueError, match="different steps"):
        bench.speedup_figures(sync_records(), async_records()[:3], ROWS, warmup=1)


def test_quality_and_noise(bench):
    assert bench.accuracy_noise(0.2, 0.25, 64) == pytest.approx(
        1.96 * math.sqrt(2 * 0.225 * 0.775 / 64)
    )
    runs = {
        "sync": (sync_records(), {"eval_accuracy_start": 0.1, "eval_accuracy_end": 0.2}),
        "async": (async_records(), {"eval_accuracy_start": 0.1, "eval_accuracy_end": 0.25}),
    }
    quality = bench.quality_figures(runs, num_eval=64, last=2)
    assert quality["sync"]["reward_last"] == pytest.approx(0.35)  # steps 3, 4
    assert quality["accuracy_difference"] == pytest.approx(0.05)
    assert quality["within_noise"]
    runs["async"][1]["eval_accuracy_end"] = 0.5
    assert not bench.quality_figures(runs, num_eval=64, last=2)["within_noise"]


def test_table_says_where_the_time_went_below_target(bench):
    slow = async_records()
    for r in slow[1:]:  # the learner twice as slow beside generation
        r["train_s"] += 8.5
        r["step_s"] += 8.5
    figures = bench.speedup_figures(sync_records(), slow, ROWS, warmup=1)
    assert figures["efficiency"] < 0.9
    quality = {
        m: {"reward_last": 0.1, "eval_accuracy_start": None, "eval_accuracy_end": None}
        for m in ("sync", "async")
    }
    text = bench.table(figures, quality)
    assert "NOT met" in text and "where the time went" in text
    assert "learner slower beside generation: +9.00 s" in text
    assert "train: 4.00 -> 13.00 s (+9.00)" in text


def write_run(folder, records, summary):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "summary.json").write_text(json.dumps(summary))


def test_bench_analyze_only_writes_results(bench, tmp_path, monkeypatch, capsys):
    for mode, records in (("sync", sync_records()), ("async", async_records())):
        summary = {
            "wall_seconds": sum(r["step_s"] for r in records),
            "eval_accuracy_start": 0.1,
            "eval_accuracy_end": 0.2,
        }
        write_run(tmp_path / mode, records, summary)
    argv = [
        "async_speedup.py",
        "--analyze-only",
        "--out",
        str(tmp_path),
        "--warmup",
        "1",
        "--prompts-per-batch",
        "2",
        "--samples-per-prompt",
        "4",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["rows_per_batch"] == ROWS
    assert result["efficiency"] == pytest.approx((10.6 / 9.0) / (10.5 / 8.5))
    assert result["target_met"] is True
    printed = capsys.readouterr().out
    assert json.loads(printed.splitlines()[0])["ideal_speedup"] == pytest.approx(10.5 / 8.5)
    assert "efficiency 0.953 (target >= 0.9: met)" in printed


def test_config_overrides_as_the_command_line_gives_them():
    config = load_config(
        REPO / "configs/default.py",
        {
            "num_mini_batches": "4",
            "rollout.prompts_per_batch": "3",
            "export": "false",
            "mesh.shape": "(1,1,1)",
            "train.learning_rate": "1e-5",
            "output_dir": REPO / "x",
        },
    )
    assert (config.sync_every, config.max_staleness) == (4, 3)
    assert config.rollout.prompts_per_batch == 3 and config.export is False
    assert tuple(config.mesh.shape) == (1, 1, 1) and config.train.learning_rate == 1e-5
    assert config.output_dir == str(REPO / "x")
    command = main_command("configs/tiny.py", {"export": False, "mesh.shape": (1, 2, 1)})
    assert command[-2:] == ["--config.export=false", "--config.mesh.shape=(1,2,1)"]
    assert format_override(0.5) == "0.5"


def offpolicy_records(n, steps, reward_end):
    return [
        record(
            s,
            0.0,
            1.0,
            1.0,
            0.0,
            0.0,
            1.0,
            reward_mean=reward_end * s / steps,
            kl=0.1 * s,
            staleness=(s - 1) % n,
            staleness_max=(s - 1) % n,
        )
        for s in range(1, steps + 1)
    ]


def test_offpolicy_steps():
    assert offpolicy.default_steps([1, 2, 4, 8, 16, 64]) == 64
    assert offpolicy.default_steps([2, 3]) == 6
    offpolicy.check_steps(64, [1, 2, 64])
    with pytest.raises(ValueError, match=r"not a multiple of N=\[3\]"):
        offpolicy.check_steps(8, [1, 2, 3])


def test_offpolicy_summarize_run():
    records = offpolicy_records(4, 8, 0.8)
    summary = {"eval_accuracy_start": 0.1, "eval_accuracy_end": 0.3, "wall_seconds": 12.0}
    figures = offpolicy.summarize_run(records, summary, last=2)
    assert figures["final_reward"] == pytest.approx((0.7 + 0.8) / 2)  # steps 7, 8
    assert figures["final_kl"] == pytest.approx((0.7 + 0.8) / 2)
    assert figures["staleness_mean"] == pytest.approx(1.5)  # 0,1,2,3 twice
    assert figures["staleness_max"] == 3
    assert (figures["eval_accuracy_end"], figures["steps_done"]) == (0.3, 8)


def test_offpolicy_report_from_run_folders(tmp_path, capsys):
    for loss, reward in (("online_dpo", 0.6), ("rloo", 0.4)):
        for n in (1, 2, 4):
            summary = {
                "eval_accuracy_start": 0.1,
                "eval_accuracy_end": reward / n,
                "wall_seconds": 60.0,
                "total_seconds": 90.0,
            }
            write_run(
                offpolicy.run_dir(tmp_path, loss, n), offpolicy_records(n, 4, reward), summary
            )
    offpolicy.main(
        [
            "--report-only",
            "--out",
            str(tmp_path),
            "--losses",
            "online_dpo,rloo,ppo",
            "--mini-batches",
            "1,2,4",
            "--last",
            "2",
        ]
    )
    results = json.loads((tmp_path / "results.json").read_text())
    runs = {(r["loss"], r["num_mini_batches"]): r for r in results["runs"]}
    assert results["settings"]["steps"] == 4
    assert runs["online_dpo", 2]["final_reward"] == pytest.approx((0.45 + 0.6) / 2)
    assert runs["rloo", 4]["eval_accuracy_end"] == pytest.approx(0.1)
    assert runs["ppo", 1]["status"] == "missing"
    assert (tmp_path / "offpolicy.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "| online_dpo | 2 | 0.525 | 0.100 → 0.300 | 0.350 | 0.50 / 1 | 1.5 |" in table
    assert "| ppo | 1 | missing |" in table


def test_offpolicy_reuses_only_runs_with_the_same_settings(tmp_path):
    folder = tmp_path / "run"
    overrides = {"loss": "ppo", "num_mini_batches": 2, "export": False}
    write_run(folder, offpolicy_records(2, 2, 0.1), {})
    assert not offpolicy.finished_with(folder, overrides)  # no settings file: a failed run
    (folder / offpolicy.SETTINGS_FILE).write_text(json.dumps(overrides))
    assert offpolicy.finished_with(folder, overrides)
    assert not offpolicy.finished_with(folder, {**overrides, "num_mini_batches": 4})


def test_offpolicy_plot_needs_a_finished_run(tmp_path):
    with pytest.raises(ValueError, match="no finished run"):
        offpolicy.plot_results([{"status": "missing"}], tmp_path / "x.png", last=5)

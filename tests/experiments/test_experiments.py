"""The pure parts of the experiment drivers, on hand-made run outputs (no engine, no training):
bench/async_speedup.py's figures, the seed statistics, and the offpolicy and async_vs_sync
experiments' aggregation, choice and plots (their real runs:
tests/experiments/test_experiment_runs.py)."""

import importlib.util
import json
import math
import sys

import numpy as np
import pytest

from jaxrlhf.experiments import (
    async_vs_sync,
    format_override,
    load_config,
    main_command,
    offpolicy,
    run_code,
    run_main,
)
from jaxrlhf.experiments.runner import (
    SETTINGS_FILE,
    PlannedRun,
    Runner,
    code_summary,
    finished_with,
    given_generators,
    run_figures,
)
from jaxrlhf.experiments.services import SWAP_SETTINGS, SharedServices, parse_generators
from jaxrlhf.experiments.stats import format_mean_stderr, mean_stderr, paired_difference, within
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
    summary = {"test_accuracy_start": 0.1, "test_prompts": 64}
    runs = {
        "sync": (sync_records(), {**summary, "test_accuracy_end": 0.2}),
        "async": (async_records(), {**summary, "test_accuracy_end": 0.25}),
    }
    quality = bench.quality_figures(runs, last=2)
    assert quality["sync"]["reward_last"] == pytest.approx(0.35)  # steps 3, 4
    assert quality["accuracy_difference"] == pytest.approx(0.05)
    assert quality["within_noise"]
    runs["async"][1]["test_accuracy_end"] = 0.5
    assert not bench.quality_figures(runs, last=2)["within_noise"]


def test_table_says_where_the_time_went_below_target(bench):
    slow = async_records()
    for r in slow[1:]:  # the learner twice as slow beside generation
        r["train_s"] += 8.5
        r["step_s"] += 8.5
    figures = bench.speedup_figures(sync_records(), slow, ROWS, warmup=1)
    assert figures["efficiency"] < 0.9
    quality = {
        m: {"reward_last": 0.1, "test_accuracy_start": None, "test_accuracy_end": None}
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
            "test_accuracy_start": 0.1,
            "test_accuracy_end": 0.2,
            "test_prompts": 64,
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


def test_offpolicy_corrections_axis(tmp_path):
    """--corrections: each loss with an importance ratio once per correction, on the learner's
    recompute; Online DPO (no ratio) once; the validated settings reach the run's overrides."""
    args = offpolicy._parse_args(["--losses", "online_dpo,rloo,grpo", "--corrections",
                                  "none,truncate,sequence_mask", "--mini-batches", "1,4",
                                  "--seeds", "0", "--out", str(tmp_path)])  # fmt: skip
    assert args.losses == ["online_dpo", "rloo", "rloo+truncate", "rloo+sequence_mask", "grpo",
                           "grpo+truncate", "grpo+sequence_mask"]  # fmt: skip
    runs = {
        (r.labels["loss"], r.labels["num_mini_batches"]): r for r in offpolicy.plan(args, tmp_path)
    }
    assert len(runs) == 14
    overrides = runs["rloo+sequence_mask", 4].overrides
    assert overrides["loss"] == "rloo" and overrides["loss_params.old_logprobs"] == "learner"
    assert overrides["loss_params.is_correction"] == "sequence_mask"
    assert runs["grpo+truncate", 1].overrides["loss_params.truncated_is_cap"] == 2.0
    assert "loss_params.is_correction" not in runs["rloo", 1].overrides
    assert runs["rloo+sequence_mask", 4].folder == tmp_path / "rloo+sequence_mask" / "N4" / "seed0"
    for run in runs.values():  # each is a config the run accepts
        planned_config(run.overrides)
    with pytest.raises(SystemExit):
        offpolicy._parse_args(["--corrections", "clip"])


def planned_config(overrides):
    """The base config with a planned run's overrides, resolved and validated as the run does."""
    from jaxrlhf.config import base_config, resolve, validate

    config = base_config()
    for key, value in overrides.items():
        *sections, name = key.split(".")
        section = config
        for part in sections:
            section = section[part]
        section[name] = value
    validate(resolve(config))
    return config


def test_offpolicy_continuous_generation_plans_beside_the_batch_runs(tmp_path):
    """--generation continuous: the same rows, seeds and N with continuous generation and
    in-flight swaps, in {out}/continuous/; a config the run accepts."""
    argv = ["--losses", "online_dpo,grpo", "--corrections", "none,mask", "--mini-batches",
            "1,4", "--seeds", "0,1"]  # fmt: skip
    batch = offpolicy.plan(offpolicy._parse_args(argv), tmp_path)
    continuous = offpolicy.plan(offpolicy._parse_args([*argv, "--generation", "continuous"]),
                                tmp_path)  # fmt: skip
    assert [r.labels for r in continuous] == [r.labels for r in batch] and len(batch) == 12
    for one, other in zip(batch, continuous, strict=True):
        assert other.folder == tmp_path / "continuous" / one.folder.relative_to(tmp_path)
        extra = {k: v for k, v in other.overrides.items() if one.overrides.get(k) != v}
        assert extra == {"output_dir": str(other.folder), "rollout.continuous": True,
                         "generator.swap_mode": "in-flight",
                         "generator.in_flight_kv": "keep"}  # fmt: skip
    for run in continuous:  # each is a config the run accepts
        planned_config(run.overrides)


def test_offpolicy_lag_plans_more_staleness_than_n_in_its_own_folder(tmp_path):
    """--lag K: N updates per publish as at --lag 0, K more versions of staleness allowed, so
    that continuous generation overlaps training; its runs in {out}[/continuous]/lag{K}/."""
    argv = ["--losses", "online_dpo,rloo", "--corrections", "none,mask", "--mini-batches",
            "1,4", "--seeds", "0"]  # fmt: skip
    plain = offpolicy.plan(offpolicy._parse_args(argv), tmp_path)
    for generation, folder in (("batch", tmp_path / "lag3"),
                               ("continuous", tmp_path / "continuous" / "lag3")):  # fmt: skip
        lagged = offpolicy.plan(
            offpolicy._parse_args([*argv, "--lag", "3", "--generation", generation]), tmp_path
        )
        assert [r.labels for r in lagged] == [r.labels for r in plain] and len(plain) == 6
        for one, other in zip(plain, lagged, strict=True):
            assert other.folder == folder / one.folder.relative_to(tmp_path)
            config = planned_config(other.overrides)
            n = one.labels["num_mini_batches"]
            assert (config.sync_every, config.max_staleness) == (n, n - 1 + 3)
            assert config.rollout.continuous == (generation == "continuous")
    with pytest.raises(SystemExit):
        offpolicy._parse_args([*argv, "--lag", "-1"])


def test_run_figures():
    records = offpolicy_records(4, 8, 0.8)
    records[3]["test_accuracy"], records[3]["eval_accuracy"] = 0.25, 0.2
    summary = {
        "eval_accuracy_start": 0.1,
        "eval_accuracy_end": 0.3,
        "wall_seconds": 12.0,
        "test_accuracy_end": 0.35,
        "test_accuracy_end_stderr": 0.02,
        "kl_last5": 9.0,
    }
    figures = run_figures(records, summary, last=2)
    assert figures["final_reward"] == pytest.approx((0.7 + 0.8) / 2)  # steps 7, 8
    assert figures["final_kl"] == pytest.approx((0.7 + 0.8) / 2)
    assert figures["staleness_mean"] == pytest.approx(1.5)  # 0,1,2,3 twice
    assert figures["staleness_max"] == 3
    assert (figures["eval_accuracy_end"], figures["steps_done"]) == (0.3, 8)
    assert figures["test_accuracy_end_stderr"] == 0.02 and "kl_last5" not in figures
    assert figures["evals"] == {"4": {"test_accuracy": 0.25, "eval_accuracy": 0.2}}


def test_mean_stderr_and_paired_difference_by_hand():
    mean, stderr = mean_stderr([0.2, 0.4, 0.9])
    assert mean == pytest.approx(0.5)
    # s² = (0.09 + 0.01 + 0.16) / 2 = 0.13; s.e. = sqrt(0.13 / 3)
    assert stderr == pytest.approx(math.sqrt(0.13 / 3))
    assert math.isnan(mean_stderr([0.3])[1])
    diff, stderr, n = paired_difference({0: 0.5, 1: 0.4, 2: 0.3, 7: 1.0}, {0: 0.6, 1: 0.2, 2: 0.3})
    assert (n, diff) == (3, pytest.approx((0.1 - 0.2 + 0.0) / 3))
    assert stderr == pytest.approx(mean_stderr([0.1, -0.2, 0.0])[1])
    assert within(0.01, 0.01) and not within(0.03, 0.01) and not within(0.0, math.nan)
    assert format_mean_stderr(0.4321, 0.012, 100) == "43.2 ± 1.2"


def test_offpolicy_report_from_run_folders(tmp_path, capsys):
    # Two seeds per cell: test accuracy = reward / n + 0.01·seed.
    for loss, reward in (("online_dpo", 0.6), ("rloo", 0.4)):
        for n in (1, 2, 4):
            for seed in (0, 1):
                summary = {
                    "test_accuracy_start": 0.1,
                    "test_accuracy_end": reward / n + 0.01 * seed,
                    "eval_accuracy_end": 0.5,
                    "wall_seconds": 60.0,
                    "total_seconds": 90.0,
                }
                folder = offpolicy.run_dir(tmp_path, loss, n, seed)
                write_run(folder, offpolicy_records(n, 4, reward), summary)
    offpolicy.main(["--report-only", "--out", str(tmp_path), "--losses", "online_dpo,rloo,ppo",
                    "--mini-batches", "1,2,4", "--last", "2", "--seeds", "0,1"])  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())
    cells = {(c["loss"], c["num_mini_batches"]): c for c in results["cells"]}
    assert results["settings"]["steps"] == 4 and len(results["runs"]) == 18
    cell = cells["online_dpo", 2]
    assert cell["seeds"] == 2 and cell["final_reward"] == pytest.approx((0.45 + 0.6) / 2)
    assert cell["test_accuracy_end"] == pytest.approx(0.305)  # 0.30 and 0.31
    assert cell["test_accuracy_end_stderr"] == pytest.approx(0.005)  # s = 0.00707, /sqrt 2
    ppo = cells["ppo", 1]  # never run: missing, not failed
    assert (ppo["seeds"], ppo["failed"], ppo["missing"]) == (0, 0, 2)
    assert (tmp_path / "offpolicy.png").stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "| online_dpo | 2 | 2 | 30.5 ± 0.5 | 50.0 ± 0.0 | 0.525 ± 0.000 |" in table
    assert "| ppo | 1 | 0 (2 missing) | - |" in table


def test_runs_are_reused_only_with_the_same_settings(tmp_path):
    folder = tmp_path / "run"
    overrides = {"loss": "ppo", "num_mini_batches": 2, "export": False}
    write_run(folder, offpolicy_records(2, 2, 0.1), {})
    assert not finished_with(folder, overrides)  # no settings file: a failed run
    (folder / SETTINGS_FILE).write_text(json.dumps(overrides))
    assert finished_with(folder, overrides)
    assert not finished_with(folder, {**overrides, "num_mini_batches": 4})


def test_a_run_is_reused_from_another_clone(tmp_path):
    """Records committed in one clone resume in another: the folder is where the run is, so the
    `output_dir` it was written with does not count; every other setting does."""
    folder = tmp_path / "here" / "run"
    overrides = {"loss": "ppo", "seed": 3, "output_dir": str(folder)}
    write_run(folder, offpolicy_records(2, 2, 0.1), {})
    elsewhere = {**overrides, "output_dir": "/another/clone/results/run"}
    (folder / SETTINGS_FILE).write_text(json.dumps(elsewhere))
    assert finished_with(folder, overrides)
    assert not finished_with(folder, {**overrides, "seed": 4})
    (folder / SETTINGS_FILE).write_text(json.dumps({"loss": "ppo", "seed": 3}))
    assert not finished_with(folder, {**overrides, "export": False})  # a setting it lacks


def test_code_version_ignores_records_and_documents(tmp_path):
    """ "+changes" marks an edit of code, not of results/ or a Markdown document."""
    import subprocess

    from jaxrlhf.experiments import code_version

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                       check=True, capture_output=True)  # fmt: skip

    files = {"code.py": "x = 1\n", "README.md": "a\n", "docs/NOTES.md": "a\n",
             "results/run/summary.json": "{}\n"}  # fmt: skip
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "first")
    assert len(code_version(tmp_path)) == 7
    for name in ("README.md", "docs/NOTES.md", "results/run/summary.json"):
        (tmp_path / name).write_text("b\n")
    assert not code_version(tmp_path).endswith("+changes")
    (tmp_path / "code.py").write_text("x = 2\n")
    assert code_version(tmp_path).endswith("+changes")


def test_a_run_records_the_code_it_ran(tmp_path):
    """run_main writes the commit under the command in the run's log (what git itself says);
    the runner's entries carry it, and the summary counts the runs per commit."""
    import subprocess

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    log = tmp_path / "run" / "run.log"
    returncode, _ = run_main([sys.executable, "-c", "print('the run')"], log)
    assert returncode == 0 and log.read_text().splitlines()[2] == "the run"
    code = run_code(log.parent)
    assert head.startswith(code.removesuffix("+changes")) and len(code) >= 7
    assert run_code(tmp_path / "nowhere") is None

    runner = Runner(REPO / "configs/tiny.py", tmp_path, "test", report_only=True)
    runs = []
    for name, header in (("a", "# code: 1234567\n"), ("b", "# code: 1234567\n"),
                         ("c", "# code: 89abcde+changes\n"), ("d", "")):  # fmt: skip
        write_run(tmp_path / name, offpolicy_records(2, 2, 0.1), {})
        (tmp_path / name / "run.log").write_text("$ python -m jaxrlhf.main\n" + header)
        runs.append(PlannedRun({"name": name}, tmp_path / name, {}))
    runs.append(PlannedRun({"name": "never run"}, tmp_path / "e", {}))
    entries = runner.run_all(runs, last=1)
    assert [e["code"] for e in entries] == ["1234567", "1234567", "89abcde+changes", None, None]
    assert code_summary(entries) == ("1234567 (2 runs), 89abcde+changes (1 run), "
                                     "not recorded (1 run)")  # fmt: skip
    assert code_summary([]) == "none"


def test_offpolicy_figure_has_a_row_per_loss_with_corrections():
    assert offpolicy.panel_rows(["rloo", "online_dpo", "ppo"]) == [["online_dpo", "ppo", "rloo"]]
    losses = ["online_dpo", "rloo", "rloo+mask", "grpo", "grpo+truncate", "grpo+mask"]
    assert offpolicy.panel_rows(losses) == [
        ["grpo", "grpo+mask", "grpo+truncate", "online_dpo"],
        ["online_dpo", "rloo", "rloo+mask"],
    ]
    # a correction's row without its plain loss still gets its own panels
    assert offpolicy.panel_rows(["online_dpo", "grpo+mask"]) == [["grpo+mask", "online_dpo"]]


def test_offpolicy_plot_needs_a_finished_run(tmp_path):
    with pytest.raises(ValueError, match="no finished run"):
        offpolicy.plot_results([{"seeds": 0}], tmp_path / "x.png", steps=4)


def test_async_vs_sync_pairs_seeds_and_chooses_on_validation(tmp_path, capsys):
    # Variant lr=a: async = sync − 0.02 + noise; lr=b: async = sync − 0.10 (clearly worse),
    # but b is better on validation. Evaluations at step 2 (in records) and 4 (summary).
    test_sync = {0: 0.40, 1: 0.30, 2: 0.35}
    noise = {0: 0.01, 1: -0.03, 2: -0.04}
    for variant, gap, validation in (("a", 0.02, 0.3), ("b", 0.10, 0.6)):
        for mode in ("sync", "async"):
            for seed, sync_value in test_sync.items():
                value = sync_value - (gap + noise[seed] if mode == "async" else 0.0)
                records = offpolicy_records(1, 4, 0.5)
                records[1] |= {"test_accuracy": value / 2, "eval_accuracy": validation / 2}
                summary = {"test_accuracy_end": value, "eval_accuracy_end": validation}
                folder = tmp_path / f"train.learning_rate={variant}" / mode / f"seed{seed}"
                write_run(folder, records, summary)
    async_vs_sync.main(["--report-only", "--out", str(tmp_path), "--steps", "4",
                        "--eval-every", "2", "--vary", "train.learning_rate=a,b"])  # fmt: skip
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["chosen"] == "train.learning_rate=b"
    rows = {(r["variant"][-1], r["split"], r["step"]): r for r in results["comparisons"]}
    a_end = rows["a", "test", 4]
    diffs = [-(0.02 + noise[s]) for s in test_sync]  # async − sync per seed
    assert a_end["difference"] == pytest.approx(np.mean(diffs))
    assert a_end["difference_stderr"] == pytest.approx(np.std(diffs, ddof=1) / math.sqrt(3))
    assert a_end["sync"] == pytest.approx(0.35) and a_end["paired_seeds"] == 3
    assert a_end["within_2_stderr"] and not rows["b", "test", 4]["within_2_stderr"]
    assert rows["a", "test", 2]["difference"] == pytest.approx(np.mean(diffs) / 2)
    assert (tmp_path / "async_vs_sync.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "chosen on validation: train.learning_rate=b" in printed
    assert "| train.learning_rate=b (chosen) | test | 4 | 35.0 ± 2.9 |" in printed


def test_vary_parsing():
    from jaxrlhf.experiments.runner import parse_vary

    assert parse_vary("") == ("", [""])
    assert parse_vary("train.learning_rate=3e-6, 1e-5") == (
        "train.learning_rate", ["3e-6", "1e-5"])  # fmt: skip
    with pytest.raises(ValueError, match="KEY=V1,V2"):
        parse_vary("train.learning_rate")
    with pytest.raises(SystemExit):  # the experiments' command lines say so
        async_vs_sync._parse_args(["--vary", "train.learning_rate"])


def test_async_vs_sync_plans_continuous_async_beside_the_shared_sync_runs(tmp_path):
    args = async_vs_sync._parse_args(["--seeds", "0,1", "--steps", "4", "--out", str(tmp_path)])
    one_step_off = async_vs_sync.plan(args, tmp_path)
    args.async_mode = "continuous"
    continuous = async_vs_sync.plan(args, tmp_path)
    # The sync runs are the same runs (same folder, same overrides): one --out serves both.
    assert one_step_off[::2] == continuous[::2]
    assert [r.folder.relative_to(tmp_path).as_posix() for r in continuous] == [
        "default/sync/seed0", "default/continuous/seed0",
        "default/sync/seed1", "default/continuous/seed1"]  # fmt: skip
    for off, cont in zip(one_step_off[1::2], continuous[1::2], strict=True):
        assert off.folder.parent.name == "async" and off.labels == cont.labels
        extra = {k: v for k, v in cont.overrides.items() if off.overrides.get(k) != v}
        assert extra == {
            "output_dir": str(cont.folder),
            "rollout.continuous": True,
            "generator.swap_mode": "in-flight",
            "generator.in_flight_kv": "keep",
        }
        assert cont.overrides["max_staleness"] == off.overrides["max_staleness"] == 1
    assert all(r.overrides["max_staleness"] == 0 for r in continuous[::2])
    assert not any("rollout.continuous" in r.overrides for r in one_step_off)


def test_an_experiments_generators_by_swap_setting():
    assert given_generators("") == {}
    assert given_generators("h:1") == {s: "h:1" for s in SWAP_SETTINGS}  # each run checks it
    assert given_generators("drain=h:1,in-flight-keep=h:2") == {
        "drain": "h:1", "in-flight-keep": "h:2"}  # fmt: skip
    with pytest.raises(ValueError, match="SETTING=HOST:PORT"):
        given_generators("drain=h:1,fast=h:2")


def test_swap_modes_figures_by_hand():
    spec = importlib.util.spec_from_file_location("swap_modes", REPO / "bench/swap_modes.py")
    swap_modes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(swap_modes)

    def record(step, wait, sync, staleness):
        return {"step": step, "step_s": 1.0 + step, "wait_for_generation_s": wait,
                "weight_sync_s": sync, "publish_blocked_s": sync / 2,
                "generator_idle_s": 0.1, "generator_pause_s": 0.05 * step,
                "generator_requests_mean": 8.0,
                "generator_occupancy": 0.5, "generate_s": 0.9, "train_s": 0.2,
                "token_staleness_mean": staleness,
                "mixed_version_fraction": 1.0 - staleness}  # fmt: skip

    drain = [record(1, 9.0, 9.0, 1.0), record(2, 0.0, 0.5, 1.0), record(3, 0.1, 0.3, 1.0),
             record(4, 0.0, 0.0, 1.0)]  # fmt: skip
    figures = swap_modes.run_figures(drain, warmup=1)  # steps 2 and 3; the last is left out
    assert figures["step_s"] == pytest.approx(3.5)
    assert figures["learner_idle_s"] == pytest.approx((0.25 + 0.25) / 2)  # wait + blocked
    assert figures["publish_blocked_s"] == pytest.approx(0.2)
    assert figures["weight_sync_s"] == pytest.approx(0.4)  # beside the step, in part
    assert figures["generator_pause_s"] == pytest.approx(0.125)
    with pytest.raises(ValueError, match="at least warmup"):
        swap_modes.run_figures(drain, warmup=3)
    in_flight = [{**figures, "step_s": 3.0, "token_staleness_mean": 0.25},
                 {**figures, "step_s": 4.0, "token_staleness_mean": 0.75}]  # fmt: skip
    result = swap_modes.summarize({"drain": [figures, figures], "in-flight-keep": in_flight})
    assert result["in-flight-keep"]["step_s"]["mean"] == 3.5
    assert result["in-flight-keep"]["step_s"]["stderr"] == pytest.approx(0.5)  # 0.707 / sqrt 2
    assert result["drain"]["step_s"]["stderr"] == 0.0
    assert result["ratio_to_drain"]["in-flight-keep"]["token_staleness_mean"] == 0.5
    assert "in-flight-keep / drain: time per update 1.000" in swap_modes.table(result)


@pytest.fixture
def started_services(monkeypatch):
    """`start_server` replaced by fake servers (listed in start order) that fail the test when
    one starts while another still runs."""
    import jaxrlhf.fleet.service

    started = []

    class Server:
        def __init__(self, options, cpus):
            self.address, self.options, self.cpus = f"127.0.0.1:{len(started)}", options, cpus
            self.exit_code = None
            self.process = type("P", (), {"poll": lambda _: self.exit_code})()

        def terminate(self):
            self.exit_code = -15

        def log_tail(self):
            return f"(log of {self.address})"

    def start_server(model, log, options, cpus=None):
        assert all(s.exit_code is not None for s in started), "two engines at once"
        started.append(Server(options, cpus))
        return started[-1]

    monkeypatch.setattr(jaxrlhf.fleet.service, "start_server", start_server)
    return started


def test_an_experiment_shares_one_service_per_swap_setting(tmp_path, started_services):
    """A run gets a service in its swap setting, started on the experiment's cores and kept
    for the next runs in that setting; one in another setting replaces it (one engine at a
    time), and one that died is replaced."""
    from jaxrlhf.experiments.runner import Runner

    started = started_services
    runner = Runner(REPO / "configs/tiny.py", tmp_path, "test", cpus_generator="1")
    drain, keep = {}, {"generator.swap_mode": "in-flight"}
    recompute = {**keep, "generator.in_flight_kv": "recompute"}
    addresses = [runner.services.address(o) for o in (drain, drain, keep, keep, recompute)]
    assert addresses == ["127.0.0.1:0", "127.0.0.1:0", "127.0.0.1:1", "127.0.0.1:1",
                         "127.0.0.1:2"]  # fmt: skip
    swap_flags = [s.options[s.options.index("--swap-mode") + 1] for s in started]
    assert swap_flags == ["drain", "in-flight", "in-flight"] and started[0].cpus == [1]
    assert [s.exit_code for s in started] == [-15, -15, None]
    assert runner.services.died("127.0.0.1:2") is None
    started[2].exit_code = -9
    assert runner.services.died("127.0.0.1:2") is started[2]
    assert runner.services.address(recompute) == "127.0.0.1:3"  # a new one in its place
    runner.close()
    assert started[3].exit_code == -15


def test_a_run_whose_service_died_runs_again_on_a_new_one(
    tmp_path, started_services, monkeypatch, capsys
):
    """`Runner._execute`: a run that fails because its service exited meanwhile is run again on
    a new service, from an empty folder; a run that fails with its service alive is not; a
    service dying more than MAX_GENERATOR_RESTARTS times ends the experiment with its log.
    (A real service killed mid-run and the learner surviving it: tests/fleet/test_fleet.py.)"""
    import jaxrlhf.experiments.runner as runner_module

    calls = []

    def run_main(command, log):
        address = command[command.index("--config.generator.addresses") + 1]
        calls.append(address)
        assert not (log.parent / "stale").exists()  # each attempt starts from an empty folder
        log.parent.mkdir(parents=True, exist_ok=True)
        (log.parent / "stale").write_text("")
        result = outcome.pop(0)
        if result == "kill":  # the service dies under the run, which then fails
            next(s for s in started_services if s.address == address).exit_code = -9
        return (0 if result == "ok" else 1), 1.0

    monkeypatch.setattr(runner_module, "run_main", run_main)
    monkeypatch.setattr(runner_module, "main_command", lambda config, overrides: [
        "main", "--config.generator.addresses", overrides["generator.addresses"]])  # fmt: skip
    runner = Runner(REPO / "configs/tiny.py", tmp_path, "test")
    run = PlannedRun({"seed": 0}, tmp_path / "run", {})

    outcome = ["kill", "ok"]
    assert runner._execute(run)[0] == 0
    assert calls == ["127.0.0.1:0", "127.0.0.1:1"] and runner.generator_restarts == 1
    assert json.loads((tmp_path / "run" / SETTINGS_FILE).read_text()) == {}
    out = capsys.readouterr().out
    assert "the generator service died during the run: it is run again on a new one" in out
    assert "the generator service exited; starting a new one:\n(log of 127.0.0.1:0)" in out

    calls.clear()
    outcome = ["fail"]  # the run's own failure, its service alive: not run again
    assert runner._execute(run)[0] == 1 and calls == ["127.0.0.1:1"]
    assert not (tmp_path / "run" / SETTINGS_FILE).exists()

    outcome = ["kill"] * (runner_module.MAX_GENERATOR_RESTARTS + 1)
    with pytest.raises(SystemExit, match=r"restarted 3 times already\):\n\(log of 127"):
        runner._execute(run)
    runner.close()


def test_a_bench_runs_one_service_at_a_time(tmp_path, started_services, monkeypatch):
    """`run_side_by_side` (pipeline_modes, swap_modes): modes in one swap setting share its
    service; a mode in another stops it first, and when the rotated order comes back to a
    setting its service is started again (two SmolLM2 engines and a learner overflow 24 GB)."""
    import jaxrlhf.experiments.services as services

    ran = []

    def run_main(command, log):
        address = command[command.index("--config.generator.addresses") + 1]
        running = [s for s in started_services if s.exit_code is None]
        assert [s.address for s in running] == [address]  # only the run's own service is up
        ran.append((log.parent.name, address))
        return 0, 0.0

    monkeypatch.setattr(services, "run_main", run_main)
    monkeypatch.setattr(services, "main_command", lambda config, overrides: [
        "main", "--config.generator.addresses", overrides["generator.addresses"]])  # fmt: skip
    modes = {"sync": {}, "one-step-off": {}, "continuous": {"generator.swap_mode": "in-flight"}}
    per_run = services.run_side_by_side(
        "test", list(modes), 2, tmp_path, REPO / "configs/tiny.py", {},
        lambda mode, folder: dict(modes[mode]), lambda folder: {"run": folder.name})  # fmt: skip
    assert ran == [("sync-0", "127.0.0.1:0"), ("one-step-off-0", "127.0.0.1:0"),
                   ("continuous-0", "127.0.0.1:1"), ("one-step-off-1", "127.0.0.1:2"),
                   ("continuous-1", "127.0.0.1:3"), ("sync-1", "127.0.0.1:4")]  # fmt: skip
    assert [s.exit_code for s in started_services] == [-15] * 5  # all stopped at the end
    assert per_run["sync"] == [{"run": "sync-0"}, {"run": "sync-1"}]


def test_generators_of_a_bench_by_swap_setting(tmp_path):
    given = parse_generators(" drain=127.0.0.1:5001, in-flight-recompute=host:7 ,")
    assert given == {"drain": "127.0.0.1:5001", "in-flight-recompute": "host:7"}
    for bad in ("in-flight=127.0.0.1:1", "drain:127.0.0.1:1", "drain=nowhere"):
        with pytest.raises(ValueError, match="is not SETTING=HOST:PORT"):
            parse_generators(bad)
    # A run is handed the given service of its swap setting (no engine is started for it).
    services = SharedServices(REPO / "configs" / "tiny.py", tmp_path, given)
    assert services.address({"generator.swap_mode": "drain"}) == "127.0.0.1:5001"
    assert services.address({"generator.swap_mode": "in-flight",
                             "generator.in_flight_kv": "recompute"}) == "host:7"  # fmt: skip
    assert services.started == {}


def test_pipeline_modes_figures_over_repeats_by_hand():
    spec = importlib.util.spec_from_file_location("pipeline_modes",
                                                  REPO / "bench/pipeline_modes.py")  # fmt: skip
    pipeline_modes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pipeline_modes)

    def run(step_s, generate_s=1.0, wait=0.0):
        figures = {key: 0.5 for _, key, _ in pipeline_modes.FIGURES}
        return {**figures, "step_s": step_s, "generate_s": generate_s,
                "learner_s": step_s - wait}  # fmt: skip

    per_run = {
        "sync": [run(2.0, wait=1.0), run(2.4, wait=1.2)],  # g 1.0, t 1.1 on average
        "one-step-off": [run(1.0), run(1.2)],  # 2.0x sync in both repeats
        "continuous": [run(0.8), run(1.5)],  # 2.5x and 1.6x; 1.25 and 0.8 of one-step-off
    }
    result = pipeline_modes.compare(per_run)
    assert result["ideal_speedup"] == pytest.approx((1.0 + 1.1) / 1.1)
    assert result["one-step-off"]["rate_vs_sync"] == pytest.approx(2.0)
    assert result["one-step-off"]["rate_vs_sync_stderr"] == pytest.approx(0.0)
    assert result["continuous"]["rate_vs_sync"] == pytest.approx(2.05)
    assert result["continuous"]["rate_vs_sync_stderr"] == pytest.approx(0.45)  # |2.5-1.6|/2
    assert result["continuous_vs_one_step_off"] == pytest.approx(1.025)
    assert result["continuous_vs_one_step_off_stderr"] == pytest.approx(0.225)
    assert result["continuous"]["step_s"] == pytest.approx(1.15)
    assert result["continuous"]["step_s_stderr"] == pytest.approx(0.35)
    text = pipeline_modes.table(result, list(per_run))
    assert "continuous / one-step-off update rate: 1.025 ± 0.225" in text
    assert "repeats per mode: 2" in text


def compute_records(step_s, idle, evals):
    """metrics.jsonl records of a run: step_s and learner_idle_fraction per step, kl = step/10,
    and {step: (test, validation)} accuracies where an evaluation ran."""
    records = []
    for step, (seconds, waited) in enumerate(zip(step_s, idle, strict=True), start=1):
        record = {"step": step, "step_s": seconds, "learner_idle_fraction": waited,
                  "kl": step / 10}  # fmt: skip
        if step in evals:
            record["test_accuracy"], record["eval_accuracy"] = evals[step]
        records.append(record)
    return records


def test_compute_curve_times_the_learner_without_evaluations():
    from jaxrlhf.experiments import compute

    # 6 steps, evaluated after 2 and 4 in the run and after 6 at the end (summary), and before.
    records = compute_records([30, 10, 4, 11, 5, 12], [0.9, 0.5, 0.0, 0.6, 0.1, 0.5],
                              {2: (0.2, 0.25), 4: (0.4, 0.35)})  # fmt: skip
    summary = {"test_accuracy_start": 0.1, "eval_accuracy_start": 0.15,
               "test_accuracy_end": 0.5, "eval_accuracy_end": 0.45}  # fmt: skip
    curve = compute.run_curve(records, summary)
    # Steps 3 and 5 follow an evaluation during the run: each timed as the median of steps
    # 1, 2, 4 and 6 (30, 10, 11, 12: 11.5). Step 1 keeps its time (nothing overlaps it).
    assert [p["step"] for p in curve] == [0, 2, 4, 6]
    assert [p["seconds"] for p in curve] == [0.0, 40, 40 + 11.5 + 11, 62.5 + 11.5 + 12]
    assert [p["test"] for p in curve] == [0.1, 0.2, 0.4, 0.5]
    assert [p["validation"] for p in curve] == [0.15, 0.25, 0.35, 0.45]
    assert [p["kl"] for p in curve] == [0.0, 0.2, 0.4, 0.6]
    # Idle over steps 2, 4 and 6 only (step 1 and the steps after an evaluation left out).
    assert compute.learner_idle(records, curve) == pytest.approx((0.5 + 0.6 + 0.5) / 3)
    # Without the evaluation before training, the same times without the point at 0.
    del summary["test_accuracy_start"]
    seconds = [p["seconds"] for p in compute.run_curve(records, summary)]
    assert seconds == [40, 40 + 11.5 + 11, 62.5 + 11.5 + 12]


def test_a_curve_places_each_evaluation_at_the_updates_of_the_weights_it_measured():
    """Between two publishes the generators serve the last publish's weights: a run of 8
    updates publishing every 4, evaluated after 2, 4 and 6 and at its end, measured the start
    model's weights after 2 and update 4's after 6 (no new points: those weights have theirs)."""
    from jaxrlhf.experiments import compute

    summary = {"test_accuracy_start": 0.1, "eval_accuracy_start": 0.15,
               "test_accuracy_end": 0.5, "eval_accuracy_end": 0.45}  # fmt: skip
    evals = {2: (0.1, 0.15), 4: (0.4, 0.35), 6: (0.4, 0.35)}
    older = compute_records([10] * 8, [0.5] * 8, evals)  # records before `evaluated_updates`
    expected = [(0, 0.1, 0.0, 0.0), (4, 0.4, 0.4, 40), (8, 0.5, 0.8, 80)]
    curve = compute.run_curve(older, summary, sync_every=4)
    assert [(p["step"], p["test"], p["kl"], p["seconds"]) for p in curve] == expected
    measured = {2: 0, 4: 4, 6: 4}  # as the evaluator now records them
    recorded = [{**r, "evaluated_updates": measured[r["step"]]} if r["step"] in measured else r
                for r in older]  # fmt: skip
    curve = compute.run_curve(recorded, summary)
    assert [(p["step"], p["test"], p["kl"], p["seconds"]) for p in curve] == expected
    # Publishing every update (the default), each evaluation is its own step's.
    assert [p["step"] for p in compute.run_curve(older, summary)] == [0, 2, 4, 6, 8]


def test_compute_curves_and_time_to_target_by_hand():
    from jaxrlhf.experiments import compute

    def curve(tests, validations, seconds):
        points = zip(tests, validations, seconds, strict=True)
        return [{"step": 2 * i, "seconds": s, "kl": 0.1 * i, "test": t, "validation": v}
                for i, (t, v, s) in enumerate(points)]  # fmt: skip

    runs = {
        "k=2": {0: curve([0.1, 0.3, 0.5], [0.1, 0.2, 0.4], [0, 10, 20]),
                1: curve([0.1, 0.2, 0.3], [0.1, 0.3, 0.5], [0, 12, 24])},
        "k=4": {0: curve([0.1, 0.6, 0.7], [0.1, 0.6, 0.8], [0, 11, 22]),
                1: curve([0.1, 0.4, 0.6], [0.1, 0.5, 0.6], [0, 13, 26])},
    }  # fmt: skip
    table = compute.curves(runs)
    last = table["k=2"][-1]
    assert (last["step"], last["seeds"]) == (4, 2)
    assert last["test"] == pytest.approx(0.4) and last["test_stderr"] == pytest.approx(0.1)
    assert last["seconds"] == pytest.approx(22) and last["kl"] == pytest.approx(0.2)
    target = compute.time_to_target(runs, table)
    # The lowest final mean validation accuracy: k=2's (0.4 + 0.5) / 2.
    assert target["target"] == pytest.approx(0.45)
    k2, k4 = target["variants"]["k=2"], target["variants"]["k=4"]
    assert (k2["reached"], k2["step"], k2["seconds"]) == (1, 4, 20)  # seed 1 never reaches it
    assert math.isnan(k2["step_stderr"])
    # Seed 0 at its first evaluation (0.6 at 11 s), seed 1 at its second (0.6 at 26 s).
    assert (k4["reached"], k4["step"], k4["seconds"]) == (2, 3, 18.5)
    assert k4["kl"] == pytest.approx(0.15) and k4["seconds_stderr"] == pytest.approx(7.5)
    text = compute.markdown(table, target)
    assert "| k=4 | 2/2 | 3.0 ± 1.0 | 18 ± 8 | 0.15 ± 0.05 |" in text
    assert "Time to 45.0% test accuracy" in text


def test_compute_plans_each_variant_one_step_off(tmp_path):
    from jaxrlhf.experiments import compute, load_config

    args = compute._parse_args(["--workload", "generation-bound", "--vary",
                                "train.updates_per_batch=1,4", "--seeds", "0,1", "--out",
                                str(tmp_path)])  # fmt: skip
    runs = compute.plan(args, tmp_path)
    assert [(r.labels["variant"], r.labels["seed"]) for r in runs] == [
        ("train.updates_per_batch=1", 0), ("train.updates_per_batch=1", 1),
        ("train.updates_per_batch=4", 0), ("train.updates_per_batch=4", 1)]  # fmt: skip
    overrides = runs[3].overrides
    assert overrides["train.updates_per_batch"] == "4" and overrides["max_staleness"] == 1
    assert overrides["rollout.max_running"] == 1 and overrides["eval.test_every"] == 4
    assert "generator.max_num_seqs" not in overrides  # evaluations get the whole engine
    assert overrides["generator.generate_timeout_s"] == 600  # a call's samples one by one
    assert overrides["loss_params.old_logprobs"] == "learner"  # the KL from the learner
    assert runs[3].folder == tmp_path / "train.updates_per_batch=4" / "seed1"
    from jaxrlhf.config import validate

    config = load_config(REPO / "configs" / "default.py", overrides)
    validate(config)  # the run accepts them
    assert config.train.updates_per_batch == 4 and config.rollout.min_response_tokens == 16
    with pytest.raises(SystemExit):  # the last update must be evaluated
        compute._parse_args(["--steps", "10", "--eval-every", "4"])


@pytest.mark.parametrize("model", ["bed", "bed-l"])
@pytest.mark.parametrize("name", ["async_vs_sync", "offpolicy", "compute"])
def test_model_bed_plans_every_experiment_on_configs_bed(name, model, tmp_path):
    """`--model bed` (any size) runs configs/bed.py's workload, seeds given as a range; every
    planned run's config validates. The larger sizes name their model; "bed" is the file's."""
    import importlib

    from jaxrlhf.config import validate
    from jaxrlhf.experiments import config_file_for, load_config

    experiment = importlib.import_module(f"jaxrlhf.experiments.{name}")
    extra = {"compute": ["--vary", "rollout.samples_per_prompt=4,8"],
             "offpolicy": ["--mini-batches", "1,4"]}.get(name, [])  # fmt: skip
    args = experiment._parse_args(["--model", model, "--seeds", "0-1", "--steps", "4", "--out",
                                   str(tmp_path), *extra])  # fmt: skip
    runs = experiment.plan(args, tmp_path)
    assert config_file_for(model) == REPO / "configs" / "bed.py"
    assert runs and {r.labels["seed"] for r in runs} == {0, 1}
    for run in runs:
        config = load_config(config_file_for(model), run.overrides)
        validate(config)
        assert config.model.path == model and config.total_steps == 4
        assert ("model.path" in run.overrides) == (model != "bed")

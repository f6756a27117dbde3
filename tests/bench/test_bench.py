"""Smoke tests of the scripts in bench/: each runs as a user runs it (a subprocess from the repo
root), on the suite's tiny Llama with the smallest settings, and its JSON result is checked.

The figures mean nothing at this size; these tests catch a bench that no longer runs or reports
nonsense (bench/learner_step.py once failed on a removed module constant before printing).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


def run_bench(command, env=None, timeout=300):
    """Runs a bench command from the repo root; returns its JSON lines, the last line among them."""
    result = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), result.stdout[-2000:] + result.stderr[-4000:]
    return [json.loads(line) for line in lines if line.startswith("{")]


def assert_positive_finite(row, *keys):
    for key in keys:
        assert math.isfinite(row[key]) and row[key] > 0, (key, row)


@pytest.mark.slow  # a whole bench run (learner compile + steps): minutes on 2 cores
def test_learner_step(tiny_llama):
    # The suite's 8 fake CPU devices stay: mesh (1, -1, 1) is then fsdp=8, and a batch of 8
    # really is split over them. The contraction block must reach the model it builds.
    (row,) = run_bench(
        [
            sys.executable, "bench/learner_step.py", "--model", str(tiny_llama),
            "--batch", "8", "--seq", "16", "--steps", "2", "--matmul-size", "256",
            "--cpu-contraction-block", "64",
        ]
    )  # fmt: skip
    assert row["device"] == "8x cpu"
    assert (row["batch"], row["seq"], row["dtype"]) == (8, 16, "float32")
    assert row["cpu_contraction_block"] == 64
    assert_positive_finite(
        row, "compile_s", "step_s_median", "model_tflop_per_s", "matmul_tflop_per_s", "ratio"
    )


def test_lora_step(tiny_llama):
    """bench/lora_step.py on the tiny model over the suite's 8 fake devices: both arms step,
    and LoRA's step holds less: its arguments lose the full optimizer state (the base stays, in
    float32 here), its temporaries the full gradients."""
    (row,) = run_bench(
        [sys.executable, "bench/lora_step.py", "--model", str(tiny_llama), "--rank", "8",
         "--batch", "8", "--seq", "16", "--steps", "2"]
    )  # fmt: skip
    assert row["device"] == "8x cpu" and row["rank"] == 8
    for name in ("full", "lora"):
        assert_positive_finite(row[name], "step_s_median", "argument_bytes", "peak_bytes")
    assert row["lora"]["argument_bytes"] < row["full"]["argument_bytes"]
    assert row["peak_ratio"] == pytest.approx(row["lora"]["peak_bytes"] / row["full"]["peak_bytes"])
    assert 0 < row["peak_ratio"] < 1


@pytest.mark.slow  # a whole bench run (learner compile + steps): minutes on 2 cores
def test_parity_fp64(tiny_llama):
    *per_seed, matmul = run_bench(
        [sys.executable, "bench/parity_fp64.py", "--model", str(tiny_llama), "--seeds", "0", "1"]
    )
    assert [row["seed"] for row in per_seed] == [0, 1]
    for row in per_seed:
        errors = {k: v for k, v in row.items() if k != "seed"}
        assert len(errors) == 8
        # fp32 against fp64 on a 2-layer model: rounding error only, far below a real mismatch.
        for key, value in errors.items():
            assert math.isfinite(value) and 0 <= value < 1e-3, (key, row)
    assert set(matmul) == {"matmul_k1536_rel_err_xla", "matmul_k1536_rel_err_torch"}
    for value in matmul.values():
        assert 0 < value < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_overhead(tiny_llama, generator_address):
    # The suite's running service is the gRPC side: only the in-process engine starts here.
    (row,) = run_bench(
        [
            sys.executable, "bench/generate_overhead.py", "--address", generator_address,
            "--num-prompts", "4", "--prompt-len", "8", "--max-tokens", "8", "--repeats", "2",
        ],
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),
    )  # fmt: skip
    assert row["model"] == str(tiny_llama)
    assert row["tokens"] == 4 * 8
    assert len(row["service_seconds"]) == len(row["in_process_seconds"]) == 2
    assert_positive_finite(
        row, "service_tokens_per_s", "in_process_tokens_per_s", "ratio", "median_paired_ratio"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_weight_sync(tiny_llama, generator_server):
    # The suite's running service (the learner runs that share it publish their own weights
    # first); only the in-process engine starts here.
    (row,) = run_bench(
        [
            sys.executable, "bench/weight_sync.py", "--model", str(tiny_llama),
            "--dtypes", "float32", "--repeats", "1", "--warmup", "1",
            "--address", generator_server.address,
            "--service-pid", str(generator_server.process.pid),
        ],
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),
    )  # fmt: skip
    assert (row["dtype"], row["tensors"]) == ("float32", 20)  # 2 layers x 9 + embedding + norm
    assert row["preload"] is True  # the suite's service preloads its updates
    assert row["bytes"] > 0
    assert_positive_finite(row, "in_process_reload_s", "stream_s", "shared_s")
    for transport in ("stream", "shared"):
        assert_positive_finite(row, f"{transport}_gb_per_s", f"{transport}_ratio_over_in_process")
        assert 0 < row[f"{transport}_pause_s"] <= row[f"{transport}_s"]
        assert 0 <= row[f"{transport}_preload_s"] <= row[f"{transport}_s"]
        assert row[f"{transport}_pause_over_in_process"] > 0
    assert row["stream_preload_s"] > 0  # the bytes arrive before the pause
    assert row["cores"] >= 1
    for transport in ("stream", "shared"):  # both sides' CPU time: at least the pause's
        assert row[f"{transport}_cpu_s"] > 0
        assert row[f"{transport}_cpu_floor_over_in_process"] > 0


@pytest.mark.slow
def test_gpu_learner_smoke(tiny_llama, tmp_path):
    # One CPU device, as the script runs on one GPU; SMOKE=1 keeps each run's dtype and remat.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(SMOKE="1", SMOKE_MODEL=str(tiny_llama), OUT=str(tmp_path), PYTHON=sys.executable)
    rows = run_bench(["bash", "bench/gpu_learner.sh"], env=env)
    files = {
        "llama1b_bf16_b16_s1024": "bfloat16",
        "llama1b_bf16_b16_s1024_remat": "bfloat16",
        "llama1b_bf16_b8_s2048_remat": "bfloat16",
        "llama1b_fp32_b8_s1024": "float32",
    }
    assert len(rows) == len(files)
    for (name, dtype), row in zip(files.items(), rows, strict=True):
        assert json.loads((tmp_path / f"{name}.json").read_text()) == row
        assert (row["model"], row["dtype"], row["device"]) == (str(tiny_llama), dtype, "1x cpu")
        assert (row["batch"], row["seq"], row["cpu_contraction_block"]) == (2, 16, 0)
        assert_positive_finite(row, "step_s_median", "ratio")


@pytest.mark.slow  # compiles the plan's programs: over a minute on 2 cores
def test_plan_check():
    # The tiny config's learner programs on one CPU device beside its plan (the CPU keeps no
    # peak-memory statistics: the measured figure is null there, a number on a GPU).
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    (row,) = run_bench([sys.executable, "bench/plan_check.py", "--config=configs/tiny.py",
                        "--steps", "1"], env=env)  # fmt: skip
    assert row["plan_fits"] is True and row["plan_peak_bytes"] > 0
    assert row["programs_run"] == ["train_step", "reference_logprobs"]
    assert row["loss_finite"] is True and row["measured_peak_bytes"] is None
    assert_positive_finite(row, "step_s_median")


@pytest.mark.slow
def test_publish_memory(tiny_llama, generator_address):
    # Two learner processes publish the shared server's own model to it, twice per mode. A
    # bound of 0 layers, which any publish exceeds: the bench must report both processes and
    # exit 1. The sliced publish must have served exactly what one stream of the model does.
    command = [sys.executable, "bench/publish_memory.py", "--model", str(tiny_llama),
               "--address", generator_address, "--publishes", "2",
               "--max-increase-layers", "0"]  # fmt: skip
    result = subprocess.run(command, cwd=REPO, env=dict(os.environ, XLA_FLAGS=""),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    output = result.stdout[-2000:] + result.stderr[-4000:]
    assert result.returncode == 1, output
    assert "publishing exceeded the memory bound" in result.stderr, output
    (*rows, summary) = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
    assert [r["process"] for r in rows] == [0, 1] and summary["devices"] == 4
    assert summary["served_equal_one_stream"] is True
    assert "the served weights differ" not in result.stderr, output
    # Every byte of the model sent once over the two processes, each sending a part.
    assert summary["sliced_bytes_all_processes"] == summary["model_bytes"]
    assert all(0 < r["sliced_bytes"] < summary["model_bytes"] for r in rows)
    assert summary["sliced"]["swapped_version"] == rows[0]["sliced"]["swapped_version"] > (
        summary["gathered"]["swapped_version"] > 0)  # fmt: skip
    assert all(len(r[mode]["peak_increase_bytes_each"]) == 2
               for r in rows for mode in ("sliced", "gathered"))  # fmt: skip
    assert 0 < summary["layer_bytes"] < summary["model_bytes"]
    assert summary["max_increase_layers"] == 0 and summary["within_bound"] is False
    assert all(f"process {r['process']} (sliced): +" in result.stderr for r in rows), output


def test_publish_memory_bound():
    """The bench's check (bench/publish_memory.py `over_bound`), on hand-made rows: a process
    at exactly 0.25 layers over its shards holds the bound, one byte more does not."""
    path = REPO / "bench" / "publish_memory.py"
    spec = importlib.util.spec_from_file_location("publish_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [
        {"process": 0, "sliced": {"peak_increase_bytes": 25_000_000}, "layer_bytes": 100_000_000},
        {"process": 1, "sliced": {"peak_increase_bytes": 25_000_001}, "layer_bytes": 100_000_000},
    ]
    assert bench.over_bound(rows[:1], 0.25) == []
    (message,) = bench.over_bound(rows, 0.25)
    expected = "process 1 (sliced): +25.0 MB = 0.25 layers over its own shards (bound 0.25 layers"
    assert message == expected + " = 25.0 MB)"


@pytest.mark.slow
def test_generate_load(tiny_llama, generator_address):
    # 2 client processes x 4 streams against the shared server for a few seconds, weights
    # updated every second: no failed call, no call with two versions.
    command = [sys.executable, "bench/generate_load.py", "--model", str(tiny_llama),
               "--address", generator_address, "--processes", "2", "--streams", "4",
               "--seconds", "6", "--baseline-seconds", "2", "--update-every", "1"]  # fmt: skip
    (row,) = run_bench(command)
    assert row["streams"] == 8 and row["calls"] > 8 and row["updates"] >= 2
    assert row["failed_calls"] == 0 and row["mixed_version_calls"] == 0, row
    assert_positive_finite(row, "tokens_per_s", "one_client_tokens_per_s", "latency_p99_s")


@pytest.mark.slow  # a bed build and a run that starts its own generator service
def test_bed(own_generator, tmp_path):
    """bench/bed.py on a bed of 3 SFT steps, 2 updates and the held-out splits cut short: a
    JSON line with the parameters and the run's figures (building twice gives the same bytes:
    tests/models/test_bed.py)."""
    (row,) = run_bench(
        [
            sys.executable, "bench/bed.py", "--sizes", "bed", "--sft-steps", "3",
            "--steps", "2", "--out", str(tmp_path), "--config.task.num_eval=8",
            "--config.task.num_test=8",
        ],
        timeout=600,
    )  # fmt: skip
    assert (row["size"], row["sft_steps"], row["updates"]) == ("bed", 3, 2)
    # By hand: 2 layers of attention (4 x 64 x 64), MLP (3 x 64 x 256) and 2 norms (64 each),
    # embeddings and untied head (47 x 64 each), the final norm.
    assert row["parameters"] == 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) + 2 * 47 * 64 + 64
    assert 0 <= row["test_before"] <= 100 and 0 <= row["test_after"] <= 100
    assert row["gain"] == pytest.approx(row["test_after"] - row["test_before"])
    assert_positive_finite(row, "build_s", "learner_s_median", "wall_s")


def test_bed_choose_steps_picks_the_length_nearest_the_default_bed(monkeypatch, tmp_path, capsys):
    """`bench/bed.py --choose-steps`: the default bed is measured first (as built), then each
    other size at each SFT length, on validation alone; the length whose accuracy is nearest the
    bed's is chosen. (Its builds and runs are the functions `test_bed` runs for real; here they
    are replaced by their figures, to check the rule.)"""
    spec = importlib.util.spec_from_file_location("bed_bench", REPO / "bench/bed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    accuracy = {"bed-350": 37.5, "bed-m-400": 10.0, "bed-m-425": 30.0, "bed-m-450": 42.0}
    asked = []
    monkeypatch.setattr(
        bench, "built", lambda name, recipe, root: (tmp_path / f"{name}-{recipe.steps}", 1.0)
    )

    def run(folder, model, steps, full, extra):
        asked.append((model.name, steps, full, extra["eval.test"]))
        return {"val_before": accuracy[model.name]}

    monkeypatch.setattr(bench, "run", run)
    bench.choose_steps(["bed", "bed-m"], [400, 425, 450], tmp_path, tmp_path, 0, {})
    *_, last = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # Each build evaluated once, before one update, on validation only; |42.0 - 37.5| = 4.5 is
    # nearer than |30.0 - 37.5| = 7.5.
    assert asked == [(name, 0, False, False) for name in accuracy]
    assert last == {"size": "bed-m", "target_val": 37.5, "chosen": 450, "val_before": 42.0}


def test_lora_sync(tiny_llama, generator_address, lora_generator):
    """bench/lora_sync.py on the suite's tiny generators (drain, and LoRA mode): both variants
    publish, each first sample after a publish is on its version (the bench checks), and the
    adapter's bytes are its PEFT tensors' (rank 8, seven targets, 2 layers of the tiny model,
    float32), a fraction of the model's."""
    (row,) = run_bench(
        [sys.executable, "bench/lora_sync.py", "--model", str(tiny_llama), "--rank", "8",
         "--publishes", "2", "--quiet-seconds", "1", "--between-seconds", "0.2",
         "--full-address", generator_address, "--adapter-address", lora_generator],
        timeout=600,
    )  # fmt: skip
    hidden, kv, inter = 128, 64, 256  # the tiny Llama (jaxrlhf.models.tiny)
    sides = 4 * hidden + 2 * (hidden + kv) + 3 * (hidden + inter)  # q, o; k, v; the MLP
    assert row["adapter"]["bytes"] == 2 * 8 * sides * 4
    assert row["bytes_ratio"] == pytest.approx(row["adapter"]["bytes"] / row["full"]["bytes"])
    assert row["bytes_ratio"] < 0.2
    assert row["adapter"]["pause_s"] == 0 and row["full"]["pause_s"] > 0
    for variant in ("full", "adapter"):
        assert_positive_finite(
            row[variant], "to_first_sample_s", "stall_s", "quiet_stall_s", "quiet_calls_per_s"
        )

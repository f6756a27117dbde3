"""The entry point: config errors before any work, and the tiny SFT run end to end."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO


def run_main(*overrides, cwd=REPO, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return subprocess.run(
        [sys.executable, "-m", "jaxrlhf.main", "--config=configs/tiny.py", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("--config.train.no_such_key=1", "no_such_key"),
        ("--config.train.batch_size=eight", "batch_size"),
        ("--config.stage=dance", "config.stage='dance'"),
        ("--config.mesh.shape=(1,2)", "config.mesh.shape"),
        ("--config.model.dtype=float8", "config.model.dtype"),
        ("--config.loss=dpo", "config.loss='dpo'"),
        ("--config.sync_every=3", "use max_staleness >= sync_every - 1"),
        ("--config.loss_params.truncated_is_cap=2.0", "has no importance ratio"),
    ],
)
def test_bad_config_is_rejected_before_work(override, message, tmp_path):
    result = run_main(override, f"--config.output_dir={tmp_path / 'out'}", timeout=120)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "out").exists()  # nothing was started


def test_tiny_sft_runs_end_to_end_and_learns(tmp_path):
    out = tmp_path / "run"
    result = run_main("--config.stage=sft", f"--config.output_dir={out}", "--config.total_steps=6")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_nll_end"] < summary["eval_nll_start"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 7))
    assert np.isfinite([x["loss"] for x in lines]).all()
    assert (out / "hf_export" / "model.safetensors").exists()
    assert (out / "hf_export" / "tokenizer.json").exists()
    # The same command again is refused at once, and the finished run is left as it was.
    before = (out / "summary.json").read_text()
    again = run_main("--config.stage=sft", f"--config.output_dir={out}", "--config.total_steps=6",
                     timeout=120)  # fmt: skip
    assert again.returncode == 2
    assert "already holds the checkpoints of an earlier run (steps [" in again.stderr
    assert "--config.resume=true" in again.stderr
    assert (out / "summary.json").read_text() == before


def test_num_mini_batches_is_the_papers_test_bed():
    from jaxrlhf.config import base_config, resolve, validate

    config = base_config()
    config.num_mini_batches = 4
    resolve(config)
    assert (config.sync_every, config.max_staleness) == (4, 3)
    validate(config)


@pytest.mark.parametrize(
    "name, stages",
    [("tldr", ["sft", "reward", ""]), ("nobots", ["sft", "reward", ""]), ("gsm8k", ["sft", ""])],
)
def test_recipe_configs_validate_and_chain(name, stages):
    """The paper's configs: every stage validates and starts from the previous one's output."""
    import importlib

    from jaxrlhf.config import resolve, validate

    module = importlib.import_module(f"configs.{name}")
    configs = {stage or "rlhf": module.get_config(stage) for stage in stages}
    for stage, config in configs.items():
        validate(resolve(config))
        assert config.stage == stage and config.output_dir == f"runs/{name}/{stage}"
    if "reward" in configs:
        assert configs["reward"].model.path == "runs/" + name + "/sft"
        assert configs["rlhf"].task.reward_model == f"runs/{name}/reward"
    with pytest.raises(ValueError, match="stage"):
        module.get_config("dance")


def test_recipe_stage_is_chosen_after_a_colon(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jaxrlhf.main", "--config=configs/tldr.py:dance"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""),
    )  # fmt: skip
    assert result.returncode != 0 and "stage 'dance'" in result.stderr


def test_generators_in_another_swap_mode_are_refused():
    from types import SimpleNamespace

    from jaxrlhf.stages.rlhf import check_swap_mode

    gen = SimpleNamespace(swap_mode="in-flight", in_flight_kv="keep")
    drain = SimpleNamespace(swap_mode="drain", in_flight_kv="")
    recompute = SimpleNamespace(swap_mode="in-flight", in_flight_kv="recompute")
    keep = SimpleNamespace(swap_mode="in-flight", in_flight_kv="keep")
    check_swap_mode(gen, ["a:1"], [keep])
    with pytest.raises(ValueError) as error:
        check_swap_mode(gen, ["a:1", "b:2", "c:3"], [keep, drain, recompute])
    message = str(error.value)
    assert "b:2 swaps drain" in message and "c:3 swaps in-flight (KV recompute)" in message
    assert "a:1" not in message and "--swap-mode in-flight --in-flight-kv keep" in message
    # A server older than swap modes reports none: it drains.
    check_swap_mode(SimpleNamespace(swap_mode="drain", in_flight_kv="keep"), ["a:1"],
                    [SimpleNamespace(swap_mode="", in_flight_kv="")])  # fmt: skip


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("rollout.length_law", "pareto:2", "config.rollout.length_law: length law 'pareto:2'"),
        ("generator.capacity", -1, "config.generator.capacity=-1: must be >= 0"),
        ("generator.weight_chunk_bytes", 0, "config.generator.weight_chunk_bytes=0: must be in"),
        (
            "rollout.min_response_tokens",
            17,
            "config.rollout.min_response_tokens=17: must be in [0, max_response_tokens=16]",
        ),
        ("generator.cpu_reserved_cores", -2, "config.generator.cpu_reserved_cores=-2: must be"),
        ("generator.engine_executor", "ray",
         "config.generator.engine_executor='ray': must be 'uni', 'mp' or ''"),
        ("rollout.max_running", -1, "config.rollout.max_running=-1: must be >= 0"),
        ("rollout.prompts_per_call", 0, "config.rollout.prompts_per_call=0: must be >= 1"),
        ("generator.swap_mode", "in-flight",
         'config.rollout.max_running=2 needs config.generator.swap_mode="drain"'),
    ],
)  # fmt: skip
def test_generator_settings_are_checked(key, value, message):
    from jaxrlhf.config import ConfigError, base_config, validate

    config = base_config()
    config.rollout.max_running = 2  # (valid under the default "drain" swaps)
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(config)


def test_a_least_response_length_is_sent_and_checked_against_the_length_law():
    from jaxrlhf.config import ConfigError, base_config, validate
    from jaxrlhf.rl.trainer import _sampling

    config = base_config()
    config.rollout.min_response_tokens = 6
    validate(config)
    assert _sampling(config)["min_tokens"] == 6  # vLLM's min_tokens: no EOS before 6 tokens
    config.rollout.length_law = "pareto:1.0:4"  # a budget of 4 would be below the least
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "min_response_tokens=6 exceeds the least budget of length_law='pareto:1.0:4' (4)"
        ),
    ):
        validate(config)
    config.rollout.length_law = "pareto:1.0:6"
    validate(config)


def test_a_started_generator_computes_on_every_core_unless_told():
    from jaxrlhf.config import base_config
    from jaxrlhf.fleet.service import engine_args

    gen = base_config().generator
    args = engine_args(gen)
    assert args[args.index("--cpu-reserved-cores") + 1] == "0"
    gen.cpu_reserved_cores = -1  # vLLM's own default
    assert "--cpu-reserved-cores" not in engine_args(gen)


def test_a_started_generator_runs_its_model_where_told():
    from jaxrlhf.config import base_config
    from jaxrlhf.fleet.service import engine_args

    gen = base_config().generator
    assert "--engine-executor" not in engine_args(gen)  # the service's own default
    gen.engine_executor = "uni"
    args = engine_args(gen)
    assert args[args.index("--engine-executor") + 1] == "uni"


def test_a_uni_engine_computes_on_the_cores_left_to_it(monkeypatch):
    from generator_service.__main__ import engine_threads, option_error, parse_args

    monkeypatch.delenv("JAXRLHF_ENGINE_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    base = ["--model", "m", "--engine-executor", "uni"]
    assert engine_threads(parse_args(base)) is None  # vLLM's choice: one
    assert engine_threads(parse_args([*base, "--cpu-reserved-cores", "0"])) == 4
    assert engine_threads(parse_args([*base, "--cpu-reserved-cores", "1"])) == 3
    assert engine_threads(parse_args([*base, "--cpu-reserved-cores", "9"])) == 1
    given = parse_args([*base, "--cpu-reserved-cores", "0", "--engine-threads", "2"])
    assert engine_threads(given) == 2
    assert option_error(parse_args([*base, "--engine-threads", "-1"])) == (
        "--engine-threads=-1: must be >= 0"
    )


def test_a_started_generator_preloads_its_swaps_unless_told():
    from jaxrlhf.config import base_config
    from jaxrlhf.experiments.services import swap_setting
    from jaxrlhf.fleet.service import engine_args

    gen = base_config().generator
    assert "--preload" in engine_args(gen) and swap_setting(gen) == "drain"
    gen.preload = False
    assert "--no-preload" in engine_args(gen) and swap_setting(gen) == "drain-no-preload"


PIN_CHECK = """
import json, os, threading, jax, jax.numpy as jnp
from jaxrlhf.main import pin_process
jnp.ones(4).block_until_ready()  # XLA's compute threads exist from here
ready = threading.Event()
threading.Thread(target=ready.wait, daemon=True).start()
pin_process({0})
later = threading.Thread(target=ready.wait, daemon=True)
later.start()
masks = {}
for task in os.listdir("/proc/self/task"):
    status = open(f"/proc/self/task/{task}/status").read()
    lines = [l for l in status.splitlines() if l.startswith("Cpus_allowed_list")]
    masks[task] = lines[0].split()[1]
ready.set()
print(json.dumps([sorted(set(masks.values())), len(masks)]))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or 0 not in os.sched_getaffinity(0),
                    reason="needs cores 0 and another")  # fmt: skip
def test_learner_cpus_pins_every_thread_of_the_process():
    # `learner_cpus` once pinned the main thread alone; XLA's threads kept every core.
    result = subprocess.run([sys.executable, "-c", PIN_CHECK], cwd=REPO, capture_output=True,
                            text=True, timeout=120,
                            env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""))  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    masks, threads = json.loads(result.stdout.strip().splitlines()[-1])
    assert masks == ["0"] and threads > 3, result.stdout

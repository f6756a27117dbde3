"""One command runs a recipe (issue 47): the stages its RLHF stage needs, each skipped when its
folder holds a finished run. The chain's rules and "finished" here; then the No Robots recipe
end to end on tiny stand-ins: `python -m jaxrlhf.main --config=configs/nobots.py` runs SFT ->
reward model -> RLHF, and the same command again skips all three."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxrlhf.stages.chain import export_is_complete, is_finished, recipe_runs
from tests.conftest import REPO, tiny_model

FIXTURES = REPO / "tests" / "fixtures" / "data"


def stage_config(name: str):
    return importlib.import_module(f"configs.{name}").get_config


@pytest.mark.parametrize(
    "name, stages, first_model",
    [
        ("nobots", ["sft", "reward", "rlhf"], "meta-llama/Llama-3.1-8B"),
        ("tldr", ["sft", "reward", "rlhf"], "EleutherAI/pythia-1b-deduped"),
        # Its RLHF stage starts from an SFT-ed hub model and scores with a checker.
        ("gsm8k", ["rlhf"], "realtreetune/rho-1b-sft-GSM8K"),
    ],
)
def test_a_recipe_runs_the_stages_its_rlhf_stage_reads(
    name, stages, first_model, monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)  # runs/ is relative to the working folder
    runs = recipe_runs({}, stage_config(name))
    assert [run.stage for run in runs] == stages
    assert [run.config.output_dir for run in runs] == [f"runs/{name}/{s}" for s in stages]
    assert runs[0].config.model.path == first_model
    assert not any(run.finished for run in runs)
    assert not any(run.config.recipe.whole for run in runs)  # each is one stage
    if name != "gsm8k":
        assert runs[1].config.model.path == runs[2].config.model.path == f"runs/{name}/sft"
        assert runs[2].config.task.reward_model == f"runs/{name}/reward"


def test_overrides_apply_to_every_stage_but_the_linking_keys(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    overrides = {
        "output_dir": "exp/",  # the recipe's root
        "model.path": "/models/llama",  # the first stage's start
        "total_steps": 3,  # every stage
        "task.preference_source": "/data/pairs.jsonl",
        "stage": "sft",  # the recipe's business
    }
    runs = recipe_runs(overrides, stage_config("nobots"))
    sft, reward, rlhf = (run.config for run in runs)
    assert [c.output_dir for c in (sft, reward, rlhf)] == ["exp/sft", "exp/reward", "exp/rlhf"]
    assert (sft.model.path, reward.model.path, rlhf.model.path) == (
        "/models/llama", "exp/sft", "exp/sft")  # fmt: skip
    assert rlhf.task.reward_model == "exp/reward" and rlhf.eval.sft_model == "exp/sft"
    assert [c.stage for c in (sft, reward, rlhf)] == ["sft", "reward", "rlhf"]
    assert {c.total_steps for c in (sft, reward, rlhf)} == {3}
    assert {c.task.preference_source for c in (sft, reward, rlhf)} == {"/data/pairs.jsonl"}
    # A reward model of one's own: no reward stage.
    runs = recipe_runs({"task.reward_model": "/models/rm"}, stage_config("nobots"))
    assert [run.stage for run in runs] == ["sft", "rlhf"]


def make_finished(folder: Path, model: Path) -> Path:
    shutil.copytree(model, folder / "hf_export")
    (folder / "summary.json").write_text(json.dumps({"stage": "sft", "steps": 1}))
    return folder


def test_a_stage_is_finished_with_its_summary_and_a_whole_export(tmp_path):
    model = tiny_model("llama")
    folder = make_finished(tmp_path / "sft", model)
    assert is_finished(folder)
    weights = folder / "hf_export" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-4])  # an export cut short
    assert not export_is_complete(folder / "hf_export") and not is_finished(folder)
    weights.write_bytes(data)
    summary = folder / "summary.json"
    summary.write_text('{"stage": "sft", "st')  # a summary cut short
    assert not is_finished(folder)
    summary.unlink()  # killed before its summary
    assert not is_finished(folder)
    summary.write_text("{}")
    (folder / "hf_export" / "config.json").unlink()
    assert not is_finished(folder)
    assert not is_finished(tmp_path / "nothing")


def test_a_sharded_export_is_whole_only_with_every_shard(tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(tiny_model("llama"), folder)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors",
                            "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert not export_is_complete(folder)
    shutil.copy(folder / "model-00001-of-00002.safetensors",
                folder / "model-00002-of-00002.safetensors")  # fmt: skip
    assert export_is_complete(folder)


def recipe_command(tiny, generator_address, *extra):
    """The No Robots recipe on stand-ins: a tiny Llama for Llama 3.1 8B, the fixture in No
    Robots' hub schema for the hub set, toy pairs in its preference layout, the suite's shared
    generator service (it serves the tiny Llama), and sizes that fit them."""
    return [
        sys.executable, "-m", "jaxrlhf.main", "--config=configs/nobots.py",
        f"--config.model.path={tiny}",
        f"--config.task.source={FIXTURES / 'no_robots'}",
        f"--config.task.preference_source={FIXTURES / 'toy_pref'}",
        "--config.task.validation_fraction=0.5",  # a validation split out of 6 rows
        "--config.total_steps=2", "--config.train.batch_size=4",
        "--config.train.micro_batch_size=0", "--config.train.max_length=192",
        "--config.model.dtype=float32", "--config.model.remat=false",
        "--config.model.logprob_chunk=0", "--config.rollout.weight_sync_dtype=",
        "--config.rollout.prompts_per_batch=2", "--config.rollout.max_prompt_tokens=176",
        "--config.rollout.max_response_tokens=8", "--config.generator.max_model_len=256",
        f"--config.generator.addresses={generator_address}",
        "--config.eval.at_start=false", "--config.eval.at_end=false", "--config.eval.test=false",
        *extra,
    ]  # fmt: skip


def run_recipe(command, cwd, timeout=600):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(REPO))
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)  # fmt: skip
    return result, time.perf_counter() - started


def test_one_command_runs_the_nobots_recipe_and_skips_finished_stages(
    tiny_llama, generator_address, tmp_path
):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    runs = tmp_path / "runs" / "nobots"
    command = recipe_command(tiny_llama, generator_address)
    result, first_seconds = run_recipe(command, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("[jaxrlhf] recipe configs/nobots.py: sft -> reward -> rlhf")
    assert "summary.json and a whole hf_export/" in lines[0]
    for line, stage in zip(lines[1:4], ("sft", "reward", "rlhf"), strict=True):
        assert line.startswith(f"[jaxrlhf]   {stage}") and str(runs / stage) in line
        assert line.endswith(f"runs, from {tiny_llama if stage == 'sft' else 'runs/nobots/sft'}")
    started = [line for line in lines if line.startswith("[jaxrlhf] stage ")]
    assert [line.split(";")[0] for line in started] == [
        "[jaxrlhf] stage sft", "[jaxrlhf] stage reward", "[jaxrlhf] stage rlhf"]  # fmt: skip
    for stage in ("sft", "reward", "rlhf"):
        assert is_finished(runs / stage), stage
    summaries = {s: json.loads((runs / s / "summary.json").read_text()) for s in ("sft", "reward")}
    assert summaries["sft"]["steps"] == summaries["reward"]["steps"] == 2
    assert json.loads((runs / "rlhf" / "summary.json").read_text())["steps"] == 2
    reward_config = json.loads((runs / "reward" / "hf_export" / "config.json").read_text())
    assert reward_config["architectures"] == ["LlamaForSequenceClassification"]
    assert lines[-1].startswith("[jaxrlhf] recipe done: the policy is in runs/nobots/rlhf")

    stamps = {p: p.stat().st_mtime_ns for p in runs.rglob("*")}
    again, again_seconds = run_recipe(command, tmp_path, timeout=120)
    assert again.returncode == 0, again.stderr[-4000:]
    for line, stage in zip(again.stdout.splitlines()[1:4], ("sft", "reward", "rlhf"), strict=True):
        assert line.startswith(f"[jaxrlhf]   {stage}") and line.endswith("finished: skipped")
    assert "[jaxrlhf] stage " not in again.stdout  # no stage started
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("*")} == stamps  # nothing touched

    # A stage killed before its summary is not finished; its checkpoints are not overwritten.
    (runs / "reward" / "summary.json").unlink()
    killed, _ = run_recipe(command, tmp_path, timeout=120)
    assert killed.returncode == 2 and "Traceback" not in killed.stderr
    [line] = killed.stderr.splitlines()
    assert line.startswith(
        "config error: runs/nobots/reward (the recipe's reward stage) holds the checkpoints of a "
        "run that did not finish (steps ["
    )
    again = shlex.join(["python", "-m", "jaxrlhf.main", *command[3:], "--config.resume=true"])
    assert line.endswith(f"continue it with `{again}`, or delete that folder to run the stage "
                         "afresh")  # fmt: skip
    resumed, _ = run_recipe([*command, "--config.resume=true"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    statuses = [line.split(": ", 1)[1] for line in resumed.stdout.splitlines()[1:4]]
    assert statuses == ["finished: skipped", "resumes", "finished: skipped"]
    assert is_finished(runs / "reward")
    print(f"first run {first_seconds:.0f} s, second {again_seconds:.1f} s")
    assert again_seconds < first_seconds / 3

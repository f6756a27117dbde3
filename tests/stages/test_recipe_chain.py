"""One command runs a recipe: the stages its RLHF stage needs, each skipped only when its
folder holds a finished run made by the same settings and inputs. The stages a recipe has and
what a whole export is here; then the No Robots recipe end to end on tiny stand-ins: `python -m
jaxrlhf.main --config=configs/nobots.py` runs SFT -> reward model -> RLHF, the same command
again skips all three, and a changed key or a deleted stage is refused, then rerun (the rules
themselves: tests/stages/test_reruns.py)."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxrlhf.stages import provenance
from jaxrlhf.stages.chain import export_is_complete, is_finished, recipe_runs
from tests.conftest import REPO, tiny_model

FIXTURES = REPO / "tests" / "fixtures" / "data"
STAGES = ("sft", "reward", "rlhf")


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


# Sizes that fit the stand-ins, for every stage (a plain key reaches the RLHF stage alone).
SIZES = ["total_steps=2", "train.batch_size=4", "train.micro_batch_size=0",
         "train.max_length=192", "model.dtype=float32", "model.remat=false",
         "model.logprob_chunk=0"]  # fmt: skip


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
        *(f"--config.{stage}{size}" for stage in ("", "sft.", "reward.") for size in SIZES),
        "--config.rollout.weight_sync_dtype=",
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


def stage_lines(stdout: str) -> dict[str, str]:
    """The plan's line of each stage: its status after the folder's name."""
    lines = {}
    for line in stdout.splitlines():
        for stage in ("sft", "reward", "rlhf"):
            if line.startswith(f"[jaxrlhf]   {stage} "):
                lines[stage] = line.split(": ", 1)[1]
    return lines


def test_one_command_runs_the_nobots_recipe_and_never_reuses_a_stale_stage(
    tiny_llama, generator_address, tmp_path
):
    """As a new user would: run it, run it again (skipped), change an SFT key (refused),
    delete sft/ (refused: the reward model and the policy were built on it), then rerun from
    the stage the refusal names: every stage is rebuilt on the new SFT model."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    runs = tmp_path / "runs" / "nobots"
    command = recipe_command(tiny_llama, generator_address)
    result, first_seconds = run_recipe(command, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("[jaxrlhf] recipe configs/nobots.py: sft -> reward -> rlhf")
    assert "made by the same settings and inputs" in lines[0]
    assert stage_lines(result.stdout) == {
        "sft": f"runs, from {tiny_llama}", "reward": "runs, from runs/nobots/sft",
        "rlhf": "runs, from runs/nobots/sft"}  # fmt: skip
    assert "[jaxrlhf]          overrides: task.source=" in result.stdout  # each stage's keys
    started = [line for line in lines if line.startswith("[jaxrlhf] stage ")]
    assert [line.split(";")[0] for line in started] == [
        "[jaxrlhf] stage sft", "[jaxrlhf] stage reward", "[jaxrlhf] stage rlhf"]  # fmt: skip
    for stage in ("sft", "reward", "rlhf"):
        assert is_finished(runs / stage), stage
    summaries = {s: json.loads((runs / s / "summary.json").read_text()) for s in STAGES}
    assert {summary["steps"] for summary in summaries.values()} == {2}
    reward_config = json.loads((runs / "reward" / "hf_export" / "config.json").read_text())
    assert reward_config["architectures"] == ["LlamaForSequenceClassification"]
    assert lines[-1].startswith("[jaxrlhf] recipe done: the policy is in runs/nobots/rlhf")

    stamps = {p: p.stat().st_mtime_ns for p in runs.rglob("*")}
    again, again_seconds = run_recipe(command, tmp_path, timeout=120)
    assert again.returncode == 0, again.stderr[-4000:]
    assert set(stage_lines(again.stdout).values()) == {"finished: skipped"}
    assert "[jaxrlhf] stage " not in again.stdout  # no stage started
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("*")} == stamps  # nothing touched

    # A changed SFT key: refused before any work, naming it; nothing touched.
    changed, _ = run_recipe([*command, "--config.sft.train.learning_rate=3e-5"], tmp_path,
                            timeout=120)  # fmt: skip
    assert changed.returncode == 2 and "Traceback" not in changed.stderr
    [line] = changed.stderr.splitlines()
    assert line.startswith("config error: runs/nobots/sft (the recipe's sft stage) was made "
                           "with other settings: train.learning_rate 2e-05 → 3e-05: rerun the "
                           "sft stage and those after it with `python -m jaxrlhf.main")  # fmt: skip
    assert {p: p.stat().st_mtime_ns for p in runs.rglob("*")} == stamps

    # sft/ deleted: the reward model and the policy were trained from it; refused.
    shutil.rmtree(runs / "sft")
    deleted, _ = run_recipe(command, tmp_path, timeout=120)
    assert deleted.returncode == 2 and "Traceback" not in deleted.stderr
    refused = deleted.stderr.splitlines()
    assert [line.split(" (")[0] for line in refused] == [
        "config error: runs/nobots/reward", "config error: runs/nobots/rlhf"]  # fmt: skip
    assert "which this command trains again" in refused[0]
    assert "--config.recipe.rerun_from=reward`" in refused[0]
    rerun, _ = run_recipe([*command, "--config.recipe.rerun_from=reward"], tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert stage_lines(rerun.stdout) == {
        "sft": f"runs, from {tiny_llama}", "reward": "reruns afresh (its folder emptied first)",
        "rlhf": "reruns afresh (its folder emptied first)"}  # fmt: skip
    records = {s: provenance.read_record(runs / s) for s in STAGES}
    assert records["reward"].inputs == {"model.path": records["sft"].output_digest}
    assert records["rlhf"].inputs == {
        "model.path": records["sft"].output_digest,
        "task.reward_model": records["reward"].output_digest}  # fmt: skip
    skipped, _ = run_recipe(command, tmp_path, timeout=120)
    assert set(stage_lines(skipped.stdout).values()) == {"finished: skipped"}
    print(f"first run {first_seconds:.0f} s, second {again_seconds:.1f} s")
    assert again_seconds < first_seconds / 3

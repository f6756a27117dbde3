"""Each documented command with each missing prerequisite: one line naming it, exit 2, no
traceback, nothing written (issue 47).

Every command runs as a user runs it, in a fresh folder (`runs/` is relative to it) with no
Hugging Face cache, no token and none of the hub variables of the shell that runs the tests
(`conftest.without_hub_settings`: HF_*, TRANSFORMERS_OFFLINE, HUGGING_FACE_HUB_TOKEN). "The
hub cannot be reached" is real, never mocked: the hub endpoint is a closed local port (the
same ConnectError as no network, on any machine), or HF_HUB_OFFLINE=1. The hub's answer for a
gated model cannot be fetched here: a local server answers huggingface_hub's request as the
hub does for a gated repository (401 with `X-Error-Code: GatedRepo`), so huggingface_hub's
own code classifies it (`GatedRepoError`). Whether the real hub still answers so is not covered.
"""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_model, without_hub_settings

FIXTURES = REPO / "tests" / "fixtures" / "data"
NO_ROBOTS, TOY_PREF = FIXTURES / "no_robots", FIXTURES / "toy_pref"
GATED = "meta-llama/Llama-3.1-8B"  # the No Robots recipe's base model, gated on the hub


class _Hub(http.server.BaseHTTPRequestHandler):
    """Answers as the hub does: a gated repository's access check without access is a 401 with
    `X-Error-Code: GatedRepo`; any other repository is not found."""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.startswith(f"/api/models/{GATED}/"):
            code = "GatedRepo"
            error = (
                f"Access to model {GATED} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in."
            )
        else:
            code, error = "RepoNotFound", "Repository not found"
        self.send_response(401)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", error)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def gated_hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def closed_port() -> str:
    """An endpoint nothing listens on: connecting fails at once, as without network."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, Path]:
    """Folders outside the commands' working folder: a model, and models that are not."""
    root = tmp_path_factory.mktemp("stand-ins")
    (root / "empty").mkdir()
    (root / "config-only").mkdir()
    (root / "config-only" / "config.json").write_text("{}")
    (root / "bad-config").mkdir()
    (root / "bad-config" / "config.json").write_text("{not json")
    (root / "bad-config" / "model.safetensors").write_bytes(b"")
    checkpoint = root / "checkpoint"
    (checkpoint / "checkpoints" / "2" / "state").mkdir(parents=True)
    return {"model": tiny_model("llama"), "checkpoint": checkpoint, **{
        name: root / name for name in ("empty", "config-only", "bad-config")}}  # fmt: skip


def finished_sft(cwd: Path, model: Path, task: str = "nobots") -> None:
    """runs/<task>/sft as a finished SFT stage leaves it (summary.json, whole hf_export/)."""
    folder = cwd / "runs" / task / "sft"
    shutil.copytree(model, folder / "hf_export")
    (folder / "summary.json").write_text(json.dumps({"stage": "sft", "steps": 1}))


def unfinished_sft(cwd: Path, model: Path) -> None:
    """runs/nobots/sft as a run killed before its export leaves it."""
    (cwd / "runs" / "nobots" / "sft" / "checkpoints" / "1" / "state").mkdir(parents=True)


def hf_home(cwd: Path) -> Path:
    """The HF_HOME of the command run in `cwd` (empty unless a setup fills it)."""
    return cwd.parent / "hf"


def cached_reward_model(cwd: Path, model: Path) -> None:
    """someone/reward in the hub cache as huggingface_hub leaves a download of a reward model:
    config and weights, no tokenizer files (it is read with the policy's tokenizer)."""
    commit = "0" * 40
    repo = hf_home(cwd) / "hub" / "models--someone--reward"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model / name, repo / "snapshots" / commit / name)


MAIN, EVALUATE, PLAN = "jaxrlhf.main", "jaxrlhf.evaluate", "jaxrlhf.plan"
SERVICE = "generator_service"
HUB_DOWN = "the hub cannot be reached (ConnectError"
NO_FOLDER = "--config.model.path=LOCAL_FOLDER"
DATA = [f"--config.task.source={NO_ROBOTS}", f"--config.task.preference_source={TOY_PREF}"]

# (id, module, arguments ({name} = a stand-in), environment ("offline", "gated", "token"),
#  setup of the working folder, fragments of the one line)
CASES = [
    # The headline commands in a fresh clone: the base model is neither cached nor reachable.
    ("nobots", MAIN, ["--config=configs/nobots.py", *DATA], "", None,
     [f"config.model.path={GATED}: the model is not in the local cache", HUB_DOWN, NO_FOLDER]),
    ("nobots:sft", MAIN, ["--config=configs/nobots.py:sft", *DATA], "", None,
     [f"config.model.path={GATED}:", HUB_DOWN, NO_FOLDER]),
    ("tldr", MAIN, ["--config=configs/tldr.py", f"--config.task.source={FIXTURES}/tldr_sft",
                    f"--config.task.preference_source={FIXTURES}/tldr_pref"], "", None,
     ["config.model.path=EleutherAI/pythia-1b-deduped:", HUB_DOWN, NO_FOLDER]),
    ("gsm8k", MAIN, ["--config=configs/gsm8k.py", f"--config.task.source={FIXTURES}/gsm8k"], "",
     None, ["config.model.path=realtreetune/rho-1b-sft-GSM8K:", HUB_DOWN, NO_FOLDER]),
    ("gsm8k:sft", MAIN, ["--config=configs/gsm8k.py:sft",
                         f"--config.task.source={FIXTURES}/gsm8k"], "", None,
     ["config.model.path=microsoft/rho-math-1b-v0.1:", HUB_DOWN, NO_FOLDER]),
    ("hub-offline", MAIN, ["--config=configs/nobots.py", *DATA], "offline", None,
     [f"config.model.path={GATED}:", "(HF_HUB_OFFLINE is set)", NO_FOLDER]),
    ("transformers-offline", MAIN, ["--config=configs/nobots.py", *DATA], "transformers-offline",
     None, [f"config.model.path={GATED}:", "(TRANSFORMERS_OFFLINE is set)", NO_FOLDER]),
    # Llama 3.1 is gated: reachable, but not without a token (or with one that has no access).
    ("gated", MAIN, ["--config=configs/nobots.py", *DATA], "gated", None,
     [f"config.model.path={GATED} is a gated model and no Hugging Face token is set",
      f"/{GATED}, then set HF_TOKEN", NO_FOLDER]),
    ("gated-token", MAIN, ["--config=configs/nobots.py", *DATA], "gated token", None,
     [f"config.model.path={GATED} is a gated model and the Hugging Face token set",
      "has no access to it: request access at"]),
    ("not-on-hub", MAIN, ["--config=configs/gsm8k.py", "--config.model.path=someone/no-such-model",
                          f"--config.task.source={FIXTURES}/gsm8k"], "gated", None,
     ["config.model.path=someone/no-such-model: no such local folder, and the hub has no model"]),
    # Datasets: neither cached nor reachable, or a local path that is not there.
    ("dataset", MAIN, ["--config=configs/nobots.py", "--config.model.path={model}",
                       f"--config.task.preference_source={TOY_PREF}"], "", None,
     ["config.task.source=HuggingFaceH4/no_robots: the dataset is not in the local cache",
      HUB_DOWN, "--config.task.source=PATH"]),
    ("tldr-preferences", MAIN, ["--config=configs/tldr.py:reward", "--config.model.path={model}"],
     "", None, ["config.task.preference_source=vwxyzjn/summarize_from_feedback_oai_preprocessing",
                HUB_DOWN, "--config.task.preference_source=PATH"]),
    ("dataset-path", MAIN, ["--config=configs/gsm8k.py", "--config.model.path={model}",
                            "--config.task.source=/no/such/gsm8k.jsonl"], "", None,
     ["config.task.source=/no/such/gsm8k.jsonl does not exist"]),
    ("no-preferences", MAIN, ["--config=configs/nobots.py", "--config.model.path={model}",
                              f"--config.task.source={NO_ROBOTS}"], "", None,
     ["config.task.preference_source is required by the No Robots reward stage",
      "`messages`", "`chosen` and `rejected`"]),
    # A stage run alone before the stage it starts from.
    ("nobots:reward", MAIN, ["--config=configs/nobots.py:reward", *DATA], "", None,
     ["config.model.path=runs/nobots/sft does not exist: it is the output of the recipe's sft",
      "`python -m jaxrlhf.main --config=configs/nobots.py:sft`"]),
    ("tldr:reward", MAIN, ["--config=configs/tldr.py:reward",
                           f"--config.task.preference_source={FIXTURES}/tldr_pref"], "", None,
     ["config.model.path=runs/tldr/sft does not exist",
      "`python -m jaxrlhf.main --config=configs/tldr.py:sft`"]),
    ("nobots:rlhf", MAIN, ["--config=configs/nobots.py:rlhf", *DATA], "", finished_sft,
     ["config.task.reward_model=runs/nobots/reward does not exist: it is the output of the "
      "recipe's reward stage", "`python -m jaxrlhf.main --config=configs/nobots.py:reward`"]),
    ("sft-killed", MAIN, ["--config=configs/nobots.py:reward", *DATA], "", unfinished_sft,
     ["config.model.path=runs/nobots/sft holds no finished sft stage",
      "`python -m jaxrlhf.main --config=configs/nobots.py:sft --config.resume=true`"]),
    # Model folders that are not there, or hold no model.
    ("model-path", MAIN, ["--config=configs/gsm8k.py", "--config.model.path=/no/such/model",
                          f"--config.task.source={FIXTURES}/gsm8k"], "", None,
     ["config.model.path=/no/such/model does not exist"]),
    ("model-empty", MAIN, ["--config=configs/gsm8k.py", "--config.model.path={empty}",
                           f"--config.task.source={FIXTURES}/gsm8k"], "", None,
     ["holds no model: no config.json"]),
    ("model-weightless", MAIN, ["--config=configs/gsm8k.py", "--config.model.path={config-only}",
                                f"--config.task.source={FIXTURES}/gsm8k"], "", None,
     ["holds no weights: neither model.safetensors"]),
    ("reward-model", MAIN, ["--config=configs/tldr.py:rlhf", "--config.model.path={model}",
                            "--config.task.reward_model=/no/such/rm",
                            f"--config.task.source={FIXTURES}/tldr_sft"], "", None,
     ["config.task.reward_model=/no/such/rm does not exist"]),
    # A hub reward model cached without tokenizer files is no problem (the one line is the
    # source's); a policy model so cached is not cached: its tokenizer is read.
    ("hub-reward-model", MAIN, ["--config=configs/tldr.py:rlhf", "--config.model.path={model}",
                                "--config.task.reward_model=someone/reward",
                                "--config.task.source=/no/such/tldr"], "", cached_reward_model,
     ["config.task.source=/no/such/tldr does not exist"]),
    ("hub-policy-model", MAIN, ["--config=configs/gsm8k.py", "--config.model.path=someone/reward",
                                f"--config.task.source={FIXTURES}/gsm8k"], "",
     cached_reward_model, ["config.model.path=someone/reward: the model is not in the local "
                           "cache", HUB_DOWN, NO_FOLDER]),
    ("reward-model-empty", MAIN, ["--config=configs/tldr.py:rlhf", "--config.model.path={model}",
                                  "--config.task.reward_model={empty}",
                                  f"--config.task.source={FIXTURES}/tldr_sft"], "", None,
     ["config.task.reward_model=", "holds no model: no config.json"]),
    # jaxrlhf.evaluate
    ("evaluate-checkpoint", EVALUATE, ["--config=configs/nobots.py",
                                       "--checkpoint=runs/nobots/rlhf",
                                       "--config.model.path={model}",
                                       "--config.eval.sft_model={model}",
                                       f"--config.task.source={NO_ROBOTS}"], "", None,
     ["--checkpoint=runs/nobots/rlhf: no Orbax checkpoint",
      "make it with `python -m jaxrlhf.main --config=configs/nobots.py`"]),
    ("evaluate-empty-checkpoint", EVALUATE, ["--config=configs/gsm8k.py", "--checkpoint={empty}",
                                             "--config.model.path={model}",
                                             "--config.eval.sft_model={model}",
                                             f"--config.task.source={FIXTURES}/gsm8k"], "", None,
     ["--checkpoint=", "/empty: no Orbax checkpoint under"]),
    ("evaluate-model", EVALUATE, ["--config=configs/gsm8k.py", "--checkpoint={checkpoint}",
                                  f"--config.task.source={FIXTURES}/gsm8k"], "", None,
     ["config.model.path=realtreetune/rho-1b-sft-GSM8K:", HUB_DOWN, NO_FOLDER]),
    ("evaluate-gold", EVALUATE, ["--config=configs/gsm8k.py", "--checkpoint={checkpoint}",
                                 "--config.model.path={model}", "--config.eval.sft_model={model}",
                                 "--config.eval.gold_reward_model=/no/such/gold",
                                 f"--config.task.source={FIXTURES}/gsm8k"], "", None,
     ["config.eval.gold_reward_model=/no/such/gold does not exist"]),
    ("evaluate-sft-missing", EVALUATE, ["--config=configs/nobots.py", "--checkpoint={checkpoint}",
                                        f"--config.task.source={NO_ROBOTS}"], "", None,
     ["config.model.path=runs/nobots/sft does not exist"]),
    # jaxrlhf.plan: the architecture of each model it sizes.
    ("plan-path", PLAN, ["--config=configs/tiny.py", "--config.model.path=/no/such/model"], "",
     None,
     ["config.model.path=/no/such/model: the architecture of '/no/such/model' is unknown"]),
    ("plan-unreadable", PLAN, ["--config=configs/tldr.py:sft",
                               "--config.model.architecture={bad-config}"], "", None,
     ["config.model.architecture=", "bad-config: Expecting property name"]),
    # python -m generator_service --model M
    ("service-path", SERVICE, ["--model", "/a/folder/that/does/not/exist"], "", None,
     ["--model /a/folder/that/does/not/exist: no such folder"]),
    ("service-empty", SERVICE, ["--model", "{empty}"], "", None,
     ["holds no model: no config.json"]),
    ("service-unreadable", SERVICE, ["--model", "{bad-config}"], "", None,
     ["holds an unreadable config.json (JSONDecodeError"]),
    ("service-hub", SERVICE, ["--model", GATED], "", None,
     [f"--model {GATED}: the model is not in the local Hugging Face cache", HUB_DOWN,
      "--model LOCAL_FOLDER"]),
    ("service-gated", SERVICE, ["--model", GATED], "gated", None,
     [f"--model {GATED} is a gated model and no Hugging Face token is set", "HF_TOKEN"]),
    # What a whole recipe cannot do: a stage picked by key (the paths would be another
    # stage's), or stages without the exports the next one starts from.
    ("recipe-stage-key", MAIN, ["--config=configs/nobots.py", "--config.stage=sft"], "", None,
     ["config error: --config.stage with a recipe: name the stage after the colon, "
      "--config=configs/nobots.py:sft"]),
    ("recipe-no-export", MAIN, ["--config=configs/tldr.py", "--config.export=false"], "", None,
     ["config error: config.export=false: the stages of a whole recipe start from each other's "
      "hf_export/"]),
]  # fmt: skip


def files_under(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize(
    "module, arguments, environment, setup, fragments",
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_a_missing_prerequisite_is_one_line_and_exit_2(
    module, arguments, environment, setup, fragments, stand_ins, closed_port, gated_hub, tmp_path
):
    hub = gated_hub if "gated" in environment.split() else closed_port
    refused(module, arguments, environment, setup, fragments, stand_ins, hub, tmp_path)


@pytest.mark.parametrize("case", ["nobots", "gated"])
def test_the_users_hub_variables_do_not_reach_the_commands(
    case, monkeypatch, stand_ins, closed_port, gated_hub, tmp_path
):
    """As exported on an offline machine (or with a token): each case refuses as without them."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_a_token_of_the_user")
    monkeypatch.setenv("HF_TOKEN", "hf_a_token_of_the_user")
    module, arguments, environment, setup, fragments = {c[0]: c[1:] for c in CASES}[case]
    hub = gated_hub if "gated" in environment.split() else closed_port
    refused(module, arguments, environment, setup, fragments, stand_ins, hub, tmp_path)


def refused(module, arguments, environment, setup, fragments, stand_ins, hub, tmp_path) -> None:
    """Runs `python -m module arguments` in a fresh folder, the hub at `hub` and no Hugging Face
    variable of the user's (`environment`: the ones the case sets); asserts the one line."""
    cwd = tmp_path / "clone"
    cwd.mkdir()
    (cwd / "configs").symlink_to(REPO / "configs")
    if setup:
        setup(cwd, stand_ins["model"])
    before = files_under(cwd)
    env = without_hub_settings()
    env.update(PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", XLA_FLAGS="",
               HF_HOME=str(hf_home(cwd)), HF_ENDPOINT=hub)  # fmt: skip
    words = environment.split()
    if "offline" in words:
        env["HF_HUB_OFFLINE"] = "1"
    if "transformers-offline" in words:
        env["TRANSFORMERS_OFFLINE"] = "1"
    if "token" in words:
        env["HF_TOKEN"] = "hf_a_token_without_access"
    arguments = [a.format(**{k: str(v) for k, v in stand_ins.items()}) for a in arguments]
    result = subprocess.run([sys.executable, "-m", module, *arguments], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(("error: ", "config error: ")), output[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert result.stdout == ""
    assert files_under(cwd) == before  # nothing written: no runs/, no stage folder


def test_the_traceback_behind_a_refusal_is_shown_on_request(closed_port, tmp_path):
    env = without_hub_settings()
    env.update(JAXRLHF_TRACEBACK="1", JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(REPO),
               HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=closed_port)  # fmt: skip
    result = subprocess.run([sys.executable, "-m", MAIN, "--config=configs/gsm8k.py"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "ConnectError" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("error: config.task.source=openai/gsm8k")

"""What a command needs before it starts, checked before any work: one line for each thing
missing and exit 2, instead of a traceback from deep inside a stage.

    models    `model.path`, `task.reward_model`, `loss_params.value_model_path`,
              `eval.gold_reward_model`, `eval.sft_model`: a local folder that holds a model
              (config.json and safetensors; a stage's output folder: its whole `hf_export/`),
              a model built here ("smollm2", "tiny", "tiny-long", the bed's "bed", "bed-m",
              "bed-l"), or a hub name that is in the local Hugging Face cache or that the hub
              will serve (a gated one: to a token with access)
    datasets  `task.source`, `task.preference_source` (or the task's hub default): an existing
              local file or folder, or a hub name in the `datasets` cache or that the hub serves

Local checks come first, then the hub is asked about what is not cached: one
`huggingface_hub.auth_check` request per name, nothing downloaded. A name is "unreachable"
when that request fails without an answer from the hub (no network, a timeout), or when
huggingface_hub is offline: HF_HUB_OFFLINE=1, or TRANSFORMERS_OFFLINE=1, which it reads
the same (the refusal names the one set). A gated repository is recognised by the error
huggingface_hub raises for the hub's answer (`GatedRepoError`). `JAXRLHF_TRACEBACK=1`
prints the traceback behind a refusal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import traceback
from collections.abc import Iterable
from pathlib import Path

from jaxrlhf.data import task_registry
from jaxrlhf.data.sources import looks_like_path
from jaxrlhf.models.paths import BED_NAMES
from jaxrlhf.stages.chain import export_is_complete, get_key, is_finished

TRACEBACK_ENV = "JAXRLHF_TRACEBACK"
BUILT_HERE = ("smollm2", "tiny", "tiny-long", *BED_NAMES)  # jaxrlhf.models.paths.resolve_model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
DATASET_LAYOUT = (
    "a .jsonl/.parquet file or a folder of {split}.jsonl files in the hub's schema, see "
    "docs/recipes.md"
)


class Missing(Exception):
    """A missing prerequisite; `str()` is the one line a user sees. `cause`: the exception
    behind it, if any (printed with JAXRLHF_TRACEBACK=1)."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


@dataclasses.dataclass(frozen=True)
class Need:
    """One thing a command reads: `key` (the config key that names it), its `value`, its kind
    ("model", "tokenizer model" for one whose tokenizer is read too, or "dataset")."""

    key: str
    value: str
    kind: str


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How to name the command that makes a recipe's stage: its config file as typed, and the
    root of its stages' folders (`config.recipe.root`)."""

    config_file: str
    root: str

    def stage_of(self, path: str) -> str | None:
        for stage in ("sft", "reward", "rlhf"):
            if Path(path) == Path(self.root) / stage:
                return stage
        return None

    def command(self, stage: str, *extra: str) -> str:
        """The command that makes `stage` (RLHF: the whole recipe, which makes what it needs)."""
        config = self.config_file + ("" if stage == "rlhf" else f":{stage}")
        return " ".join(["python -m jaxrlhf.main", f"--config={config}", *extra])


def recipe_of(config, config_argument: str) -> Recipe | None:
    """The Recipe of a recipe config, from the `--config=` argument as typed; else None."""
    recipe = config.get("recipe")
    if not recipe:
        return None
    return Recipe(config_argument.split(":", 1)[0], recipe.root)


def stage_needs(config) -> list[Need]:
    """The models and datasets a `jaxrlhf.main` stage reads."""
    needs = [Need("config.model.path", config.model.path, "tokenizer model")]
    if config.stage == "rlhf":
        if config.task.reward_model:
            needs.append(Need("config.task.reward_model", config.task.reward_model, "model"))
        if config.loss_params.value_model_path:
            value = config.loss_params.value_model_path
            needs.append(Need("config.loss_params.value_model_path", value, "model"))
    key = "preference_source" if config.stage == "reward" else "source"
    return needs + _dataset_needs(config.task, key)


def evaluate_needs(config) -> list[Need]:
    """The models and datasets `jaxrlhf.evaluate` reads."""
    needs = [Need("config.model.path", config.model.path, "tokenizer model")]
    for key in ("gold_reward_model", "sft_model"):
        if config.eval[key]:
            needs.append(Need(f"config.eval.{key}", config.eval[key], "tokenizer model"))
    return needs + _dataset_needs(config.task, "source")


def plan_problems(config) -> list[Missing]:
    """What `jaxrlhf.plan` cannot size: each model whose architecture is neither in a local
    folder's config.json nor known offline (`jaxrlhf.models.known`)."""
    from jaxrlhf.losses import LOSSES
    from jaxrlhf.models.known import architecture_of

    def named(architecture_key: str, key: str) -> tuple[str, str]:
        config_key = architecture_key if get_key(config, architecture_key) else key
        return f"config.{config_key}", get_key(config, config_key)

    models = [named("model.architecture", "model.path")]
    if config.stage == "rlhf":
        if LOSSES[config.loss].needs_value_model and config.loss_params.value_model_path:
            models.append(("config.loss_params.value_model_path",
                           config.loss_params.value_model_path))  # fmt: skip
        if config.task.reward_model:
            models.append(named("task.reward_model_architecture", "task.reward_model"))
    found = []
    for key, value in models:
        try:
            architecture_of(value)
        except (OSError, ValueError, KeyError, TypeError) as error:
            found.append(Missing(f"{key}={value}: {error}", error))
    return found


def _dataset_needs(task, key: str) -> list[Need]:
    sources = task_registry.task(task.name).sources
    if not sources:
        return []  # generated here (arithmetic)
    source = task.get(key, "") or sources.get(key) or ""
    return [Need(f"config.task.{key}", source, "dataset")]


# Why a key without a value and without a default is needed, and what it must name.
_REQUIRED = {
    "config.task.preference_source": "config.task.preference_source is required by the No "
    "Robots reward stage (the hub has no preference pairs for it): a .jsonl/.parquet file or a "
    "folder of {split}.jsonl files whose rows hold `messages` (the conversation, a list of "
    "{role, content}) or `prompt`, and the two answers `chosen` and `rejected` (strings or "
    "message lists), e.g. SFT samples labelled by a judge (jaxrlhf/data/nobots.py)",
}


def problems(
    needs: Iterable[Need], made: Iterable[str] = (), recipe: Recipe | None = None
) -> list[Missing]:
    """What is missing of `needs`, one problem per thing: local ones first, then what the hub
    says of the others. `made`: folders that a stage of this run writes before they are read
    (not checked)."""
    made_paths = {Path(m) for m in made}
    found: list[Missing] = []
    remote: list[Need] = []
    seen: set[str] = set()
    for need in needs:  # each model or dataset once, under the first key that names it
        if need.value in seen or need.value in BUILT_HERE:
            continue
        seen.add(need.value)
        if need.value and Path(need.value) in made_paths:
            continue
        try:
            if not need.value:
                raise Missing(_REQUIRED.get(need.key, f"{need.key} is required"))
            if _is_local(need.value, recipe):
                _check_local(need, recipe)
            else:
                remote.append(need)
        except Missing as problem:
            found.append(problem)
    for need in remote:
        try:
            _check_hub(need)
        except Missing as problem:
            found.append(problem)
    return found


def _is_local(value: str, recipe: Recipe | None) -> bool:
    return (
        Path(value).expanduser().exists()
        or looks_like_path(value)
        or (recipe is not None and recipe.stage_of(value) is not None)
    )


def _check_local(need: Need, recipe: Recipe | None) -> None:
    path = Path(need.value).expanduser()
    stage = recipe.stage_of(need.value) if recipe else None
    named = f"{need.key}={need.value}"
    if not path.exists():
        if stage:
            raise Missing(
                f"{named} does not exist: it is the output of the recipe's {stage} stage; make "
                f"it with `{recipe.command(stage)}` (or run the whole recipe: "
                f"`python -m jaxrlhf.main --config={recipe.config_file}`)"
            )
        what = DATASET_LAYOUT if need.kind == "dataset" else "a Hugging Face model folder"
        raise Missing(f"{named} does not exist: pass {what}, or a hub name")
    if need.kind == "dataset":
        return
    if stage and not is_finished(path):
        raise Missing(
            f"{named} holds no finished {stage} stage (a finished one has summary.json and a "
            f"whole hf_export/): finish it with `{recipe.command(stage, '--config.resume=true')}`"
        )
    if any((path / name).exists() for name in ("hf_export", "summary.json", "checkpoints")):
        if not export_is_complete(path / "hf_export"):
            raise Missing(
                f"{named} holds a stage's outputs but no whole exported model (hf_export/ is "
                "missing or cut short: the stage did not finish, or ran with config.export=false)"
            )
        path = path / "hf_export"
    problem = model_folder_problem(path, tokenizer=need.kind == "tokenizer model")
    if problem:
        raise Missing(f"{named} {problem}")


def model_folder_problem(folder: Path, tokenizer: bool = False) -> str | None:
    """What keeps `folder` from being loaded as a Hugging Face model, or None."""
    if not folder.is_dir():
        return "is a file, not a model folder"
    if not (folder / "config.json").exists():
        return (
            "holds no model: no config.json (a Hugging Face model folder has config.json and "
            "*.safetensors)"
        )
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as error:
        return f"holds an unreadable config.json ({type(error).__name__}: {error})"
    weights = ("model.safetensors", "model.safetensors.index.json")
    if not any((folder / name).exists() for name in weights):
        return (
            "holds no weights: neither model.safetensors nor model.safetensors.index.json (a "
            "PyTorch .bin checkpoint is not read: re-save it with safe_serialization=True)"
        )
    if tokenizer and not any((folder / name).exists() for name in TOKENIZER_FILES):
        return f"holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
    return None


def _check_hub(need: Need) -> None:
    """Raises Missing unless the hub name is cached or the hub will serve it."""
    from huggingface_hub import auth_check, constants
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo_type = "dataset" if need.kind == "dataset" else "model"
    named = f"{need.key}={need.value}"
    fix = f"pass a local copy: --{need.key}=" + (
        f"PATH ({DATASET_LAYOUT})" if repo_type == "dataset" else "LOCAL_FOLDER"
    )
    try:
        validate_repo_id(need.value)
    except HFValidationError as error:
        raise Missing(f"{named} is neither a local folder nor a hub name", error) from None
    if repo_type == "dataset":
        cached = _cached_dataset(need.value)
    else:  # a reward or value model is read with the policy's tokenizer
        cached = _cached_model(need.value, tokenizer=need.kind == "tokenizer model")
    if cached:
        return
    snapshot = _hub_snapshot(need.value, repo_type) if repo_type == "dataset" else None
    if snapshot:
        fix = f"{fix}; a downloaded snapshot is at {snapshot}"
    if constants.HF_HUB_OFFLINE:
        raise Missing(
            f"{named}: the {repo_type} is not in the local cache and the hub cannot be reached "
            f"({offline_variable()} is set); {fix}"
        )
    try:
        auth_check(need.value, repo_type=repo_type)
    except Exception as error:  # noqa: BLE001 - classified below, whatever the transport
        raise _hub_refusal(error, named, need.value, repo_type, fix) from None


def offline_variable() -> str:
    """The variable that keeps huggingface_hub offline: HF_HUB_OFFLINE when set (to anything),
    else TRANSFORMERS_OFFLINE, which huggingface_hub reads as HF_HUB_OFFLINE (`constants`)."""
    return "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE") else "TRANSFORMERS_OFFLINE"


def _hub_refusal(error: Exception, named: str, name: str, repo_type: str, fix: str) -> Missing:
    """The refusal for what `auth_check` raised: gated (without a token, or with one that has
    no access), not on the hub, or no answer at all (unreachable)."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    url = f"{constants.ENDPOINT}/{'datasets/' if repo_type == 'dataset' else ''}{name}"
    if isinstance(error, GatedRepoError):  # a RepositoryNotFoundError too: first
        if get_token() is None:
            return Missing(
                f"{named} is a gated {repo_type} and no Hugging Face token is set: accept its "
                f"terms at {url}, then set HF_TOKEN to a token of that account; or {fix}",
                error,
            )
        return Missing(
            f"{named} is a gated {repo_type} and the Hugging Face token set (HF_TOKEN or `hf "
            f"auth login`) has no access to it: request access at {url}; or {fix}",
            error,
        )
    if isinstance(error, RepositoryNotFoundError):
        return Missing(
            f"{named}: no such local folder, and the hub has no {repo_type} of that name (or it "
            f"is private: set HF_TOKEN); {fix}",
            error,
        )
    reason = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}".strip()
    return Missing(
        f"{named}: the {repo_type} is not in the local cache and the hub cannot be reached "
        f"({reason}); {fix}",
        error,
    )


def _cached_model(name: str, tokenizer: bool) -> bool:
    """Whether the hub cache holds the files `resolve_model_path` would download: weights and
    config, and a tokenizer when one is read (the policy's; a reward or value model is read
    with the policy's tokenizer)."""
    from huggingface_hub import snapshot_download

    from jaxrlhf.models.hf_io import HUB_PATTERNS

    try:
        folder = Path(snapshot_download(name, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or cached in part
        return False
    return model_folder_problem(folder, tokenizer=tokenizer) is None


def _cached_dataset(name: str) -> bool:
    """Whether `datasets.load_dataset(name)` finds a prepared copy without the hub (the folders
    its offline fallback, `CachedDatasetModuleFactory`, looks in)."""
    import datasets.config
    from datasets.naming import camelcase_to_snakecase

    parts = name.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    root = Path(datasets.config.HF_DATASETS_CACHE) / "___".join(parts)
    return any(p.is_dir() for p in root.glob("*/*/*"))


def _hub_snapshot(name: str, repo_type: str) -> str | None:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, repo_type=repo_type, local_files_only=True)
    except Exception:  # noqa: BLE001 - not downloaded
        return None


def refuse(found: list[Missing]) -> None:
    """Prints each problem as one line (its traceback first with JAXRLHF_TRACEBACK=1); exit 2."""
    for problem in found:
        if os.environ.get(TRACEBACK_ENV) and problem.cause is not None:
            traceback.print_exception(problem.cause, file=sys.stderr)
        print(f"error: {problem}", file=sys.stderr, flush=True)
    sys.exit(2)

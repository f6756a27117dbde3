"""`--model` checked before the engine starts: one line naming what is missing, not vLLM's
traceback (nor a hint about memory, which is not the cause).

A local folder (a path that exists, or one written as a path: starting with `.`, `/` or `~`, or
with more than one `/`) must hold a model: a readable config.json and weights (`*.safetensors`
or `*.bin`). Anything else is a hub name: fine when the local Hugging Face cache has it (what
vLLM loads without the hub) or when the hub will serve it (`huggingface_hub.auth_check`, one
request, nothing downloaded; a gated model only to a token with access). The learner checks its
own models the same way (`jaxrlhf.prerequisites`); nothing here imports it.
"""

from __future__ import annotations

import json
from pathlib import Path

LOCAL_COPY = "pass a local copy: --model LOCAL_FOLDER"


class ModelProblem(Exception):
    """What is wrong with `--model`, in one line; `cause`: the exception behind it, if any."""

    def __init__(self, message: str, cause: BaseException | None = None):
        super().__init__(message)
        self.cause = cause


def check_model(model: str) -> None:
    """Raises ModelProblem unless `model` is a loadable local folder, a cached hub model or a
    hub model the hub will serve."""
    path = Path(model).expanduser()
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        _check_folder(model, path)
    else:
        _check_hub(model)


def _check_folder(model: str, path: Path) -> None:
    if not path.is_dir():
        what = "no such folder" if not path.exists() else "a file, not a model folder"
        raise ModelProblem(f"--model {model}: {what} (give a Hugging Face model folder, "
                           "config.json and *.safetensors, or a hub name)")  # fmt: skip
    if not (path / "config.json").is_file():
        raise ModelProblem(f"--model {model} holds no model: no config.json")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ModelProblem(
            f"--model {model} holds an unreadable config.json ({type(error).__name__}: {error})",
            error,
        ) from None
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ModelProblem(f"--model {model} holds no weights (no *.safetensors or *.bin file)")


def _check_hub(model: str) -> None:
    from huggingface_hub import auth_check, constants, get_token, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError as error:
        raise ModelProblem(
            f"--model {model} is neither a local folder nor a hub name", error
        ) from None
    try:
        folder = Path(snapshot_download(model, allow_patterns=["*.json"], local_files_only=True))
        _check_folder(model, folder)
        return  # cached
    except Exception:  # noqa: BLE001 - not cached (or in part): ask the hub
        pass
    if constants.HF_HUB_OFFLINE:
        raise ModelProblem(
            f"--model {model}: the model is not in the local Hugging Face cache and the hub "
            f"cannot be reached (HF_HUB_OFFLINE is set); {LOCAL_COPY}"
        )
    try:
        auth_check(model)
    except GatedRepoError as error:
        url = f"{constants.ENDPOINT}/{model}"
        if get_token() is None:
            raise ModelProblem(
                f"--model {model} is a gated model and no Hugging Face token is set: accept its "
                f"terms at {url}, then set HF_TOKEN to a token of that account; or {LOCAL_COPY}",
                error,
            ) from None
        raise ModelProblem(
            f"--model {model} is a gated model and the Hugging Face token set (HF_TOKEN or `hf "
            f"auth login`) has no access to it: request access at {url}; or {LOCAL_COPY}",
            error,
        ) from None
    except RepositoryNotFoundError as error:
        raise ModelProblem(
            f"--model {model}: no such local folder, and the hub has no model of that name (or "
            f"it is private: set HF_TOKEN); {LOCAL_COPY}",
            error,
        ) from None
    except Exception as error:  # noqa: BLE001 - no answer from the hub, whatever the transport
        reason = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}".strip()
        raise ModelProblem(
            f"--model {model}: the model is not in the local Hugging Face cache and the hub "
            f"cannot be reached ({reason}); {LOCAL_COPY}",
            error,
        ) from None

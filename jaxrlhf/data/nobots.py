"""No Robots (HuggingFaceH4/no_robots): 10k human-written instructions and responses.

Hub schema: `prompt` (first user turn), `prompt_id`, `messages` [{role, content}] (system / user /
assistant, ending with the assistant's answer), `category`; splits train / test (older revisions:
train_sft / test_sft, used when the plain name is absent). The prompt is every message but the
last, system messages kept; the reference is the last (assistant) message. In multi-turn chats the
earlier assistant turns are part of the prompt and only the final one is trained on.

The hub set has no preference pairs. `preference_pairs` reads your own (e.g. policy samples
labelled by a gold reward model or a judge) from a local file or folder with columns

- `messages`: the conversation to answer, a list of {role, content}. When it ends with an
  assistant turn (a No Robots row as is), that turn is the reference and is left out of the
  prompt; otherwise the reference is the chosen response. Or instead of `messages`:
- `prompt`: the user's request as a string, or a list of {role, content} (TRL's layout);
- `chosen`, `rejected`: the two responses, as strings or as message lists whose last message is
  the assistant's response (TRL's layout);
- optionally `prompt_id` or `id`.
"""

from __future__ import annotations

from jaxrlhf.data.sources import SplitNotFoundError, first_rows, load_split, require_columns
from jaxrlhf.data.task_spec import TaskSpec, unseeded
from jaxrlhf.data.types import (
    Message,
    PreferencePair,
    PromptExample,
    SFTExample,
    sft_from_references,
)

DEFAULT_SOURCE = "HuggingFaceH4/no_robots"
# No preference set exists on the hub: pass a local file in the layout described above.
DEFAULT_PREFERENCE_SOURCE: str | None = None

_OLD_SPLIT_NAMES = {"train": "train_sft", "test": "test_sft"}


def sft_examples(
    source: str = DEFAULT_SOURCE, split: str = "train", limit: int | None = None
) -> list[SFTExample]:
    return sft_from_references(prompt_examples(source, split, limit))


def prompt_examples(
    source: str = DEFAULT_SOURCE, split: str = "train", limit: int | None = None
) -> list[PromptExample]:
    dataset = _load(source, split)
    require_columns(dataset, ("messages",), source=source, split=split)
    examples = []
    for i, row in enumerate(first_rows(dataset, _with_id(dataset, ("messages",)), limit)):
        example_id = _row_id(row, split, i)
        prompt, reference = _split_reference(_messages(row["messages"], example_id), example_id)
        if reference is None:
            raise ValueError(
                f"{source!r} {split} row {example_id!r}: the last message is from "
                f"{prompt[-1]['role']!r}, expected the assistant's reference response"
            )
        examples.append(PromptExample(example_id, prompt, None, reference))
    return examples


def preference_pairs(
    source: str, split: str = "train", limit: int | None = None
) -> list[PreferencePair]:
    """Preference pairs from a local (or hub) set in the layout of the module docstring."""
    dataset = _load(source, split)
    prompt_column = "messages" if "messages" in dataset.column_names else "prompt"
    columns = (prompt_column, "chosen", "rejected")
    require_columns(
        dataset,
        columns,
        source=source,
        split=split,
        hint="A No Robots preference set needs messages (or prompt) + chosen + rejected",
    )
    pairs: list[PreferencePair] = []
    for i, row in enumerate(first_rows(dataset, _with_id(dataset, columns), limit)):
        example_id = _row_id(row, split, i)
        prompt_value = row[prompt_column]
        if isinstance(prompt_value, str):
            conversation = [{"role": "user", "content": prompt_value}]
        else:
            conversation = _messages(prompt_value, example_id)
        prompt, reference = _split_reference(conversation, example_id)
        chosen = _response(row["chosen"], example_id)
        rejected = _response(row["rejected"], example_id)
        pairs.append(
            PreferencePair(
                PromptExample(example_id, prompt, None, chosen if reference is None else reference),
                chosen,
                rejected,
            )
        )
    return pairs


def _load(source: str, split: str):
    try:
        return load_split(source, split)
    except SplitNotFoundError as error:
        old_name = _OLD_SPLIT_NAMES.get(split)
        if old_name in error.available:
            return load_split(source, old_name)
        raise


def _with_id(dataset, columns: tuple[str, ...]) -> tuple[str, ...]:
    for id_column in ("prompt_id", "id"):
        if id_column in dataset.column_names:
            return (*columns, id_column)
    return columns


def _row_id(row: dict, split: str, index: int) -> str:
    value = row.get("prompt_id", row.get("id"))
    return f"{split}-{index}" if value is None else str(value)


def _messages(raw: list[dict], example_id: str) -> list[Message]:
    if not raw:
        raise ValueError(f"row {example_id!r}: the conversation has no messages")
    try:
        return [{"role": m["role"], "content": m["content"]} for m in raw]
    except (KeyError, TypeError) as error:
        raise ValueError(
            f"row {example_id!r}: messages must be a list of {{'role', 'content'}}, got {raw!r}"
        ) from error


def _split_reference(messages: list[Message], example_id: str) -> tuple[list[Message], str | None]:
    """(prompt, reference): the final assistant turn is the reference when there is one."""
    if messages[-1]["role"] != "assistant":
        return messages, None
    if len(messages) == 1:
        raise ValueError(f"row {example_id!r}: only an assistant message, no prompt before it")
    return messages[:-1], messages[-1]["content"]


def _response(value: str | list[dict], example_id: str) -> str:
    if isinstance(value, str):
        return value
    messages = _messages(value, example_id)
    if messages[-1]["role"] != "assistant":
        raise ValueError(
            f"row {example_id!r}: a chosen/rejected conversation must end with the assistant's "
            f"response, its last message is from {messages[-1]['role']!r}"
        )
    return messages[-1]["content"]


SPEC = TaskSpec(
    name="nobots",
    description="No Robots chat: SFT set + your own preference pairs (module docstring)",
    splits={"train": "train", "validation": None, "test": "test"},
    prompts=unseeded(prompt_examples),
    sft=unseeded(sft_examples),
    sources={"source": DEFAULT_SOURCE, "preference_source": DEFAULT_PREFERENCE_SOURCE},
    preferences=unseeded(preference_pairs),
)

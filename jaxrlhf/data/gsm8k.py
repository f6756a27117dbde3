"""GSM8k grade-school maths (openai/gsm8k, config "main"): a verifiable final answer.

Hub schema: `question`, `answer`, where the answer is a worked solution (with calculator
annotations such as `<<48/2=24>>`) whose last line is `#### <number>`; splits train (7,473) and
test (1,319). Rows have no id, so a prompt's id is `{split}-{row index}`.

The reference response is the whole solution; the gold answer is the number after `####`, commas
removed. Prompts are plain text in the paper's format for base models (Rho-1B),
"[MATH_TASK] Problem:\\n{question}\\n\\nSolution:", followed by " " + solution for SFT; with
`chat=True` the question alone is the user's message.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from jaxrlhf.data.sources import first_rows, load_split, require_columns
from jaxrlhf.data.task_spec import TaskSpec, unseeded
from jaxrlhf.data.types import PromptExample, SFTExample

DEFAULT_SOURCE = "openai/gsm8k"
DEFAULT_CONFIG = "main"
PROMPT_TEMPLATE = "[MATH_TASK] Problem:\n{question}\n\nSolution:"

_COLUMNS = ("question", "answer")
# A minus sign only when it does not join two numbers ("10-15" is 10 and 15).
_NUMBER = r"(?:(?<!\d)-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_FINAL_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def gold_answer(solution: str) -> str:
    """The number after the last `####` of a GSM8k solution, commas removed."""
    if "####" not in solution:
        raise ValueError(f"GSM8k solution has no '#### <number>' line: {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def extract_final_answer(text: str) -> str | None:
    """The model's final answer: the number after `####`, else the last number; commas removed.

    None when the text has no number at all.
    """
    match = _FINAL_ANSWER.search(text)
    if match is None:
        numbers = _ANY_NUMBER.findall(text)
        if not numbers:
            return None
        return numbers[-1].replace(",", "")
    return match.group(1).replace(",", "")


def is_correct(text: str, answer: str) -> bool:
    """Whether the final answer in `text` equals `answer` as a number.

    Commas, a `$` sign and a trailing `.0` (or `.`) make no difference: "#### $1,200.0" is
    correct for "1200". A non-numeric gold answer is compared as stripped text.
    """
    predicted = extract_final_answer(text)
    if predicted is None:
        return False
    gold = _as_number(answer)
    if gold is None:
        return predicted.strip() == answer.strip()
    return _as_number(predicted) == gold


def verify(answer: str, text: str) -> float:
    """The verifiable reward: 1.0 when the final answer in `text` is `answer` (`is_correct`)."""
    return float(is_correct(text, answer))


def prompt_examples(
    source: str = DEFAULT_SOURCE,
    split: str = "train",
    limit: int | None = None,
    *,
    name: str | None = DEFAULT_CONFIG,
    chat: bool = False,
    template: str = PROMPT_TEMPLATE,
) -> list[PromptExample]:
    """Prompts with the full solution as reference and the `####` number as answer.

    `name` is the hub config ("main" or "socratic"); a local folder uses a subfolder of that name
    when it has one. `template` (with a `{question}` field) shapes plain-text prompts.
    """
    dataset = load_split(source, split, name=name)
    require_columns(dataset, _COLUMNS, source=source, split=split)
    examples = []
    for i, row in enumerate(first_rows(dataset, _COLUMNS, limit)):
        example_id = f"{split}-{i}"
        try:
            answer = gold_answer(row["answer"])
        except ValueError as error:
            raise ValueError(f"{source!r} {split} row {i}: {error}") from None
        question = row["question"]
        examples.append(
            PromptExample(
                id=example_id,
                messages=[{"role": "user", "content": question}] if chat else None,
                text=None if chat else template.format(question=question),
                reference=row["answer"],
                answer=answer,
            )
        )
    return examples


def sft_examples(
    source: str = DEFAULT_SOURCE,
    split: str = "train",
    limit: int | None = None,
    *,
    name: str | None = DEFAULT_CONFIG,
    chat: bool = False,
    template: str = PROMPT_TEMPLATE,
) -> list[SFTExample]:
    """Prompt and worked solution; after a plain-text prompt the solution gets a leading space."""
    prompts = prompt_examples(source, split, limit, name=name, chat=chat, template=template)
    return [SFTExample(p, p.reference if chat else " " + p.reference) for p in prompts]


def _as_number(text: str) -> Decimal | None:
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


SPEC = TaskSpec(
    name="gsm8k",
    description="GSM8k: SFT on worked solutions, verifiable reward (the `#### n` answer)",
    splits={"train": "train", "validation": None, "test": "test"},
    prompts=unseeded(prompt_examples),
    sft=unseeded(sft_examples),
    sources={"source": DEFAULT_SOURCE},
    verify=verify,
)

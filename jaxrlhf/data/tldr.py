"""TL;DR summarization (Stiennon et al. 2020), in the preprocessing of Huang et al. 2024.

SFT / prompt set (`DEFAULT_SOURCE`, splits train / validation / test): the Reddit fields `id`,
`subreddit`, `title`, `post`, `summary` plus pre-tokenized columns made with the Pythia tokenizer,
which are ignored: the prompt is rebuilt from the text fields as

    SUBREDDIT: r/{subreddit}\\n\\nTITLE: {title}\\n\\nPOST: {post}\\n\\nTL;DR:

and the response is " " + summary (the summaries carry no leading space).

Preference set (`DEFAULT_PREFERENCE_SOURCE`, splits train / validation / validation_cnndm): OpenAI's
comparisons, `info` {id, post, title, subreddit, site, article}, `summaries` [{text, policy, note}]
× 2 and `choice` (index of the preferred summary). Summary texts already start with a space.
Rows of CNN/DailyMail batches (split validation_cnndm) have an `article` instead of a post and get
the preprocessing's article prompt. Sets that only keep the flattened columns
(`query` or `prompt`, `chosen`, `rejected`, e.g. preferences relabelled by a gold reward model)
are read from those, with any trailing "<|endoftext|>" removed.

The original preprocessing truncates long posts so the prompt fits 512 Pythia tokens;
`fit_prompt` does the same with any tokenizer's counter.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxrlhf.data.sources import first_rows, load_split, require_columns
from jaxrlhf.data.task_spec import TaskSpec, unseeded
from jaxrlhf.data.types import PreferencePair, PromptExample, SFTExample, sft_from_references

DEFAULT_SOURCE = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
DEFAULT_PREFERENCE_SOURCE = "vwxyzjn/summarize_from_feedback_oai_preprocessing_1706381144"

PROMPT_TEMPLATE = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
ARTICLE_PROMPT_TEMPLATE = "Article:\n{article}\n\nTL;DR:\n"
_END_OF_TEXT = "<|endoftext|>"
_SFT_COLUMNS = ("id", "subreddit", "title", "post", "summary")
_COMPARISON_COLUMNS = ("info", "summaries", "choice")


def format_prompt(subreddit: str, title: str, post: str) -> str:
    return PROMPT_TEMPLATE.format(subreddit=subreddit, title=title, post=post)


def fit_prompt(
    subreddit: str, title: str, post: str, count_tokens: Callable[[str], int], max_tokens: int = 512
) -> str:
    """The prompt, with the post shortened until `count_tokens(prompt) <= max_tokens`.

    As OpenAI's preprocessing: cut the post at its last newline, or drop its last character when it
    has none, and retry.
    """
    prompt = format_prompt(subreddit, title, post)
    while count_tokens(prompt) > max_tokens:
        if not post:
            raise ValueError(
                f"TL;DR prompt for {title!r} needs more than {max_tokens} tokens "
                "even without a post"
            )
        cut = post.rfind("\n")
        post = post[:cut] if cut >= 0 else post[:-1]
        prompt = format_prompt(subreddit, title, post)
    return prompt


def as_response(summary: str) -> str:
    """A summary as the text that follows "TL;DR:": one leading space, no end-of-text marker."""
    summary = summary.removesuffix(_END_OF_TEXT)
    return summary if summary.startswith(" ") else " " + summary


def sft_examples(
    source: str = DEFAULT_SOURCE, split: str = "train", limit: int | None = None
) -> list[SFTExample]:
    return sft_from_references(prompt_examples(source, split, limit))


def prompt_examples(
    source: str = DEFAULT_SOURCE, split: str = "train", limit: int | None = None
) -> list[PromptExample]:
    dataset = load_split(source, split)
    require_columns(dataset, _SFT_COLUMNS, source=source, split=split)
    return [
        PromptExample(
            id=str(row["id"]),
            messages=None,
            text=format_prompt(row["subreddit"], row["title"], row["post"]),
            reference=as_response(row["summary"]),
        )
        for row in first_rows(dataset, _SFT_COLUMNS, limit)
    ]


def preference_pairs(
    source: str = DEFAULT_PREFERENCE_SOURCE, split: str = "train", limit: int | None = None
) -> list[PreferencePair]:
    """Human (or relabelled) comparisons; each prompt's `reference` is its chosen summary."""
    dataset = load_split(source, split)
    columns = dataset.column_names
    if "info" in columns:
        require_columns(dataset, _COMPARISON_COLUMNS, source=source, split=split)
        return [
            _comparison_pair(row, f"{source} {split} row {i}")
            for i, row in enumerate(first_rows(dataset, _COMPARISON_COLUMNS, limit))
        ]
    prompt_column = "query" if "query" in columns else "prompt"
    flat_columns = (prompt_column, "chosen", "rejected")
    require_columns(
        dataset,
        flat_columns,
        source=source,
        split=split,
        hint="A TL;DR preference set needs info + summaries + choice (OpenAI comparisons) "
        "or query (or prompt) + chosen + rejected",
    )
    id_columns = ("id",) if "id" in columns else ()
    pairs = []
    for i, row in enumerate(first_rows(dataset, flat_columns + id_columns, limit)):
        chosen = as_response(row["chosen"])
        prompt = PromptExample(
            id=str(row.get("id", f"{split}-{i}")),
            messages=None,
            text=row[prompt_column].strip(),
            reference=chosen,
        )
        pairs.append(PreferencePair(prompt, chosen, as_response(row["rejected"])))
    return pairs


def _comparison_pair(row: dict, where: str) -> PreferencePair:
    info, summaries, choice = row["info"], row["summaries"], row["choice"]
    if len(summaries) != 2 or choice not in (0, 1):
        raise ValueError(
            f"{where}: expected 2 summaries and choice 0 or 1, "
            f"got {len(summaries)} summaries and choice {choice!r}"
        )
    chosen, rejected = summaries[choice]["text"], summaries[1 - choice]["text"]
    if info.get("post") is None and info.get("article") is not None:
        text = ARTICLE_PROMPT_TEMPLATE.format(article=info["article"])
    else:
        text = format_prompt(info["subreddit"], info["title"], info["post"])
        chosen, rejected = as_response(chosen), as_response(rejected)
    prompt = PromptExample(id=str(info["id"]), messages=None, text=text, reference=chosen)
    return PreferencePair(prompt, chosen, rejected)


SPEC = TaskSpec(
    name="tldr",
    description="TL;DR summarisation: SFT set + OpenAI's preference set (reward model)",
    splits={"train": "train", "validation": "validation", "test": "test"},
    prompts=unseeded(prompt_examples),
    sft=unseeded(sft_examples),
    sources={"source": DEFAULT_SOURCE, "preference_source": DEFAULT_PREFERENCE_SOURCE},
    preferences=unseeded(preference_pairs),
)

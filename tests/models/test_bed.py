"""The test bed (`jaxrlhf.models.bed`): its names, its tokenizer on the arithmetic task, and
builds that are the same bytes every time."""

import dataclasses

import pytest
import transformers

from jaxrlhf.data.arithmetic import make_problems, score_answer
from jaxrlhf.data.types import PromptExample, prompt_ids, response_ids
from jaxrlhf.models import bed, paths
from jaxrlhf.models.built import COMPLETE
from jaxrlhf.models.paths import resolve_model

# A build in seconds: the smallest size, a few SFT steps of a few examples.
SMALL = bed.Recipe(size="bed", steps=3, batch_size=4)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bed-tokenizer")
    bed.make_tokenizer(folder)
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_resolve_model_names_each_size(monkeypatch):
    asked = []
    monkeypatch.setattr(bed, "bed_path", lambda name: asked.append(name) or name)
    names = ["bed", "bed-m", "bed-l"]
    assert [resolve_model(name) for name in names] == names == asked
    assert set(paths.BED_NAMES) == set(bed.SIZES)


def test_sizes_are_servable_llamas_spanning_8x_in_parameters():
    counts = {}
    for name in bed.SIZES:
        hf = bed.hf_config(name)
        assert hf["head_dim"] == 32 and hf["num_attention_heads"] * 32 == hf["hidden_size"]
        h, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
        counts[name] = layers * (4 * h * h + 3 * h * hf["intermediate_size"] + 2 * h) + (
            2 * vocab * h + h
        )
    assert counts["bed"] < counts["bed-m"] < counts["bed-l"]
    assert counts["bed-l"] >= 8 * counts["bed"]


def test_the_tokenizer_round_trips_every_prompt_and_answer(tokenizer):
    unknown = tokenizer.unk_token_id
    for problem in make_problems(0, "train")[:500] + make_problems(0, "test"):
        prompt = PromptExample(problem.id, [{"role": "user", "content": problem.question}],
                               None, str(problem.answer))  # fmt: skip
        ids = prompt_ids(tokenizer, prompt)
        assert len(ids) == 24 and unknown not in ids
        assert tokenizer.decode(ids) == (
            f"<|im_start|>user\n{problem.question}<|im_end|>\n<|im_start|>assistant\n"
        )
        answer = response_ids(tokenizer, str(problem.answer))
        assert len(answer) == len(str(problem.answer)) + 1  # a token per digit, then EOS
        assert answer[-1] == tokenizer.eos_token_id and unknown not in answer
        text = tokenizer.decode(answer, skip_special_tokens=True)
        assert text == str(problem.answer) and score_answer(text, problem.answer) == 1.0


def test_a_wrong_answer_decodes_to_a_wrong_number(tokenizer):
    ids = tokenizer.encode("the number 1 2.", add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
    assert score_answer(tokenizer.decode(ids), 12) == 0.0  # the digits are not glued together


def test_the_digest_names_every_setting_of_the_recipe():
    digests = {SMALL.digest()}
    for change in (dict(size="bed-m"), dict(seed=1), dict(steps=4), dict(batch_size=8),
                   dict(learning_rate=3e-3), dict(max_length=32)):  # fmt: skip
        digests.add(dataclasses.replace(SMALL, **change).digest())
    assert len(digests) == 7
    assert SMALL.digest() == bed.Recipe(size="bed", steps=3, batch_size=4).digest()
    with pytest.raises(ValueError, match="unknown bed size 'bed-xl'"):
        bed.Recipe(size="bed-xl")


def test_each_size_takes_its_own_sft_steps_unless_told():
    assert set(bed.STEPS) == set(bed.SIZES)
    for name, steps in bed.STEPS.items():
        recipe = bed.Recipe(size=name)
        assert recipe.steps == steps and dataclasses.asdict(recipe)["steps"] == steps
        assert recipe.digest() == bed.Recipe(size=name, steps=steps).digest()
    # The default size keeps the 350 steps every claim's runs were built with (same digest,
    # same cached build); an explicit count still wins.
    assert bed.Recipe().steps == 350 and bed.Recipe(size="bed-l", steps=7).steps == 7


def test_a_recipe_builds_the_same_bytes_twice(tmp_path):
    first = bed.bed_path("bed", SMALL, root=tmp_path / "a")
    second = bed.bed_path("bed", SMALL, root=tmp_path / "b")
    assert first.name == second.name == f"bed-{SMALL.digest()[:16]}"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "bed.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / COMPLETE).exists() and (first / ".build" / "sft_summary.json").exists()
    model = transformers.AutoConfig.from_pretrained(first)
    assert (model.hidden_size, model.head_dim, model.vocab_size) == (64, 32, 47)
    assert bed.bed_path("bed", SMALL, root=tmp_path / "a") == first  # built once

"""The test bed: small Llamas trained from scratch on the arithmetic task, for many seeds on CPU.

`model.path="bed"` (or the larger "bed-m", "bed-l": `SIZES`) names a policy small enough that
an RLHF run of 64 updates and a greedy evaluation of the whole test split take a minute or two
on 2 CPU cores, yet one that starts partly right on two-digit additions, so RL has room to
improve it.

- Tokenizer (`make_tokenizer`): word level. One token per digit, per word or symbol of the
  question (with the space before it), per other space or newline, and the special tokens and
  ChatML template of `jaxrlhf.models.tiny`: the task's prompts (`jaxrlhf.data.arithmetic`)
  render unchanged in 24 tokens, the answer "82" is the tokens "8", "2" and EOS, and decoding
  joins the tokens' text as it is (no spaces added between digits).
- Model: a Llama with head_dim 32 (vLLM's CPU attention needs head_dim >= 32), MLP 4x the
  hidden size, untied head. The sizes differ in width alone.
- Recipe (`Recipe`): random init (JAX, from the seed), then the project's own SFT stage
  (`jaxrlhf.stages.sft`) on the train split's additions (never validation or test) at a
  constant learning rate, stopped after a number of steps chosen on the validation split so
  that the default size is partly trained (38% of the validation split right). Every size
  gets the same data, learning rate and stopping rule: its steps (`STEPS`) are those whose
  model starts nearest the default's validation accuracy, so the sizes differ in capacity,
  not in how far along the task they start.

A build runs in a fresh `python -m jaxrlhf.stages.bed_build` process (the SFT stage is a layer
above this one, so it is run as a program, not imported) pinned to one core, on one CPU device
(`build`): the caller's JAX may see 8 fake devices (the tests) or be pinned to other
cores, and the bytes written depend on the recipe alone (on this machine's CPU). It is cached in
`$JAXRLHF_CACHE/models/bed/` under the name and a digest of the recipe (`Recipe.digest`: size,
seed, steps, batch, learning rate, the train split's examples, the tokenizer, the architecture,
`RECIPE_VERSION`) via `built_once`, so the next use of the same recipe is a lookup.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from jaxrlhf.models.built import COMPLETE, built_once, cache_dir
from jaxrlhf.models.tiny import SPECIAL_TOKENS, save_chat_tokenizer

# Raise when a change to this file or to the SFT stage changes what a build writes: every
# cached bed is then built again (the digest names the folder).
RECIPE_VERSION = 1

HEAD_DIM = 32
# Width and depth of each size; parameters with the 47-token vocabulary: 137k, 537k, 2.12M.
SIZES: dict[str, dict[str, int]] = {
    "bed": dict(hidden_size=64, num_hidden_layers=2),
    "bed-m": dict(hidden_size=128, num_hidden_layers=2),
    "bed-l": dict(hidden_size=256, num_hidden_layers=2),
}
# SFT steps per size, chosen on the validation split by `python bench/bed.py --cached
# --sizes S --choose-steps ...` (2026-12-06): greedy accuracy at the start on the whole split
# nearest the default's 37.5%. bed-m: 400 -> 10.9%, 425 -> 29.1%, 450 -> 42.1%, 475 -> 54.5%;
# bed-l: 175 -> 10.2%, 225 -> 16.1%, 275 -> 41.7%. At the default's 350 steps they started
# at 5.9% and 73.2% of the test split (until 2026-12-06 every size took 350 steps).
STEPS: dict[str, int] = {"bed": 350, "bed-m": 450, "bed-l": 275}
# The generator's default context (config.generator.max_model_len) fits; RoPE needs no table.
MAX_POSITIONS = 256

WORDS = ("What", "is", "Answer", "with", "just", "the", "number", "user", "assistant", "system")
SYMBOLS = ("+", "-", "=", "?", ".", ",")
_PIECES = r" ?[A-Za-z]+| ?[^A-Za-z\d\s]|\d|\s"  # how text is cut into tokens (docstring)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a bed is built: its `size`, the `seed` (of the init and of the order of the examples)
    and the SFT stage's settings; `steps` 0 means the size's (`STEPS`).

    The defaults were chosen on the validation split alone: at lr 1e-3 and 64 examples a step
    the default size learns the task in a sudden rise, from 8% of the validation split right
    (greedy) after 250 steps to 28% after 300, 38% after 350 and 48% after 400. Of the 300,
    325 and 350-step models, configs/bed.py's RL run added the most on validation to the
    350-step one (+24 and +26 points, seeds 0 and 1; +20 and +23 from 325 steps, +12 to +22
    over 3 seeds from 300). (A higher rate, 3e-3, rose later and then diverged.) The larger
    sizes rise at other steps: `STEPS`.
    """

    size: str = "bed"
    seed: int = 0
    steps: int = 0
    batch_size: int = 64
    learning_rate: float = 1e-3
    max_length: int = 28  # the 24-token prompt and the longest answer, 3 digits and EOS

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"unknown bed size {self.size!r}; known: {', '.join(SIZES)}")
        if not self.steps:
            object.__setattr__(self, "steps", STEPS[self.size])

    def digest(self) -> str:
        """SHA-256 of everything the built weights depend on (module docstring)."""
        record = {
            "recipe": dataclasses.asdict(self),
            "architecture": hf_config(self.size),
            "vocabulary": vocabulary(),
            "pieces": _PIECES,
            "train_data": train_data_digest(),
            "version": RECIPE_VERSION,
        }
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def bed_path(name: str = "bed", recipe: Recipe | None = None, root: Path | None = None) -> Path:
    """The folder of the bed `name` (a key of `SIZES`), built on first use (minutes)."""
    recipe = recipe or Recipe(size=name)
    if recipe.size != name:
        raise ValueError(f"a recipe of size {recipe.size!r} asked for as {name!r}")
    root = root if root is not None else cache_dir() / "models" / "bed"
    folder = root / f"{name}-{recipe.digest()[:16]}"
    if not (folder / COMPLETE).exists():
        print(f"[jaxrlhf] building the test bed {name!r} into {folder} (once; minutes)",
              file=sys.stderr, flush=True)  # fmt: skip
    return built_once(folder, lambda tmp: build(tmp, recipe))


def vocabulary() -> list[str]:
    """The tokens in id order: the special tokens, the digits, space and newline, the symbols
    and words, then each symbol and word after a space."""
    pieces = [*SYMBOLS, *WORDS]
    return [*SPECIAL_TOKENS, *(str(d) for d in range(10)), " ", "\n",
            *pieces, *(" " + piece for piece in pieces)]  # fmt: skip


def make_tokenizer(path: str | os.PathLike):
    """Writes the bed's tokenizer (module docstring) to `path` and returns it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECES), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # the tokens' text, concatenated
    return save_chat_tokenizer(tokenizer, path)


def token_id(token: str) -> int:
    return vocabulary().index(token)


def hf_config(size: str) -> dict[str, Any]:
    """The config.json of a bed of `size`."""
    shape = SIZES[size]
    hidden = shape["hidden_size"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(vocabulary()),
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": shape["num_hidden_layers"],
        "num_attention_heads": hidden // HEAD_DIM,
        "num_key_value_heads": hidden // HEAD_DIM,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": token_id("<|im_start|>"),
        "eos_token_id": token_id("<|im_end|>"),
        "pad_token_id": token_id("<|endoftext|>"),
    }


def train_data_digest() -> str:
    """SHA-256 of the train split's questions and answers (what the SFT stage reads)."""
    from jaxrlhf.data.arithmetic import make_problems

    digest = hashlib.sha256()
    for problem in sorted(make_problems(0, "train"), key=lambda p: p.id):
        digest.update(f"{problem.question}\0{problem.answer}\n".encode())
    return digest.hexdigest()


def build(folder: Path, recipe: Recipe) -> None:
    """Builds `recipe` into `folder` in a fresh process (module docstring) on one core, with no
    XLA flags of the caller's; its log is kept in `folder/.build/build.log`.

    One core, because XLA's CPU runtime splits its work by the number of cores the process may
    use: a build pinned to one core and one on two wrote different bytes (measured here), each
    the same every time."""
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    log_path = Path(folder) / ".build" / "build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    core = min(os.sched_getaffinity(0))
    command = ["taskset", "-c", str(core), sys.executable, "-m", "jaxrlhf.stages.bed_build",
               json.dumps(dataclasses.asdict(recipe)), str(folder)]  # fmt: skip
    with open(log_path, "w") as log:
        code = subprocess.call(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                               cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    if code:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"building the bed {recipe} failed (exit {code}):\n{tail}")

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
`$JAXRLHF_CACHE/models/bed/` under the name and a digest of the recipe (`Recipe.digest`) via
`built_once`, so the next use of the same recipe is a lookup.

The digest covers what the built bytes depend on, so that no change of them reuses an old bed:
- the recipe, the architecture, the tokenizer (vocabulary, pieces, chat template) and the train
  split's examples, by value;
- the SFT stage's config, whole (`sft_settings`): every key of its sections that the stage reads
  is set here, none is left to `base_config()`'s defaults. A default changed for other runs
  then changes no bed (the claims' committed builds stay the builds of their names), and
  `jaxrlhf.stages.bed_build` refuses to build while `base_config()` has a key of those sections
  that is neither set here nor named as unread (`SFT_UNREAD`): a new key cannot slip in unseen.
  (The config is a layer above this one: its values cannot be read here, only pinned.)
- the versions of the libraries that compute the update (`LIBRARIES`: jax, jaxlib, flax, optax,
  all pinned by requirements.txt, so the key is the same on every install of one commit);
- the code that trains it, through `RECIPE_VERSION`. The code itself is not hashed into the key:
  every edit of the SFT stage, even one that changes no byte (a summary field, a log line), would
  rebuild every cached bed and unname the claims' committed start models
  (`jaxrlhf.experiments.claims.start_models`, named by this digest). Instead
  `build_code_digest` (the modules of `BUILD_CODE`, comments and docstrings left out) is pinned
  by tests/models/test_bed_key.py, which fails on any edit of that code and says what to do:
  raise `RECIPE_VERSION` when the edit can change what a build writes (then rename the
  committed start models to the new digest), and update the pin either way. The model's own
  layers and the data loading are below the stage and shared with every run; they are left out.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import io
import json
import os
import subprocess
import sys
import tokenize
from importlib import metadata
from pathlib import Path
from typing import Any

from jaxrlhf.models import tiny
from jaxrlhf.models.built import COMPLETE, built_once, cache_dir
from jaxrlhf.models.tiny import SPECIAL_TOKENS, save_chat_tokenizer

# Raise when a change to this file or to the code that trains a bed (`BUILD_CODE`) changes what a
# build writes: every cached bed is then built again (the digest names the folder), and the
# claims' committed start models must be renamed to the new digest (module docstring).
RECIPE_VERSION = 1
# The modules whose code trains a bed (below the package), pinned by a test (module docstring).
BUILD_CODE = ("stages/bed_build.py", "stages/sft.py", "stages/supervised.py", "train_state.py")
# The libraries whose versions the built bytes depend on (module docstring).
LIBRARIES = ("jax", "jaxlib", "flax", "optax")

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

# The SFT stage's config of every build, but for the recipe's own settings (`sft_settings`):
# each key of `SFT_SECTIONS` that the stage reads, as `base_config()` set it when the committed
# start models were built (module docstring).
SFT_FIXED: dict[str, Any] = {
    "resume": False,
    "export": True,
    "mesh.shape": (1, 1, 1),  # one device
    "model.dtype": "float32",
    "model.param_dtype": "float32",
    "model.remat": False,
    "model.contraction_block": 0,
    "model.logprob_chunk": 0,
    "task.name": "arithmetic",
    "task.source": "",
    "task.train_split": "",
    "task.eval_split": "",
    "task.test_split": "",
    "task.validation_fraction": 0.05,
    "task.num_train": 0,  # the whole train split
    "task.num_eval": 0,  # held-out NLL before and after: the whole validation split
    "task.num_test": 0,
    "train.max_grad_norm": 1.0,
    "train.weight_decay": 0.0,
    "train.micro_batch_size": 0,
}
# The sections of the config the SFT stage reads, and their keys it does not read (left at
# `base_config()`'s defaults: they change no byte of a build).
SFT_SECTIONS = ("mesh", "model", "task", "train", "checkpoint")
SFT_UNREAD = ("model.path", "model.architecture", "model.lora", "task.preference_source",
              "task.reward_model",
              "task.reward_model_architecture", "train.updates_per_batch",
              "train.log_samples_returned")  # fmt: skip

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
            "sft": sft_settings(self),
            "architecture": hf_config(self.size),
            "vocabulary": vocabulary(),
            "pieces": _PIECES,
            "chat_template": tiny.CHAT_TEMPLATE,
            "train_data": train_data_digest(),
            "libraries": library_versions(),
            "version": RECIPE_VERSION,
        }
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def sft_settings(recipe: Recipe) -> dict[str, Any]:
    """The SFT stage's config of a build of `recipe`, whole ("section.key": value; module
    docstring): `SFT_FIXED` and the recipe's settings."""
    return {
        **SFT_FIXED,
        "seed": recipe.seed,
        "total_steps": recipe.steps,
        "train.batch_size": recipe.batch_size,
        "train.learning_rate": recipe.learning_rate,
        "train.max_length": recipe.max_length,
        "train.log_every": max(recipe.steps // 10, 1),
        "checkpoint.every": recipe.steps,  # a checkpoint only at the end
    }


def library_versions() -> dict[str, str | None]:
    """The installed version of each of `LIBRARIES` (None: not installed)."""
    versions: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def build_code_digest() -> str:
    """SHA-256 of the code of `BUILD_CODE`, without comments, docstrings and blank lines: what a
    test pins (module docstring). Read as text: the stages are a layer above this one."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in BUILD_CODE:
        digest.update(f"{name}\0{_code_of(package / name)}\0".encode())
    return digest.hexdigest()


def _code_of(path: Path) -> str:
    """The source at `path` without its comments, docstrings and blank lines, lines right-stripped
    (positions from `ast` and `tokenize`, the same on every Python the project supports)."""
    source = path.read_text()
    skipped: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        first = node.body[0] if node.body else None
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
                and first.lineno > getattr(node, "lineno", 0)):  # fmt: skip
            skipped.update(range(first.lineno, first.end_lineno + 1))
    comments = {token.start[0]: token.start[1]
                for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT}  # fmt: skip
    lines = []
    for number, line in enumerate(source.splitlines(), 1):
        line = line[: comments.get(number, len(line))].rstrip()
        if line and number not in skipped:
            lines.append(line)
    return "\n".join(lines)


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

"""Evaluate an Orbax checkpoint of any stage on the task's test (or validation) split.

    python -m jaxrlhf.evaluate --config=configs/x.py --checkpoint=runs/x [--step=N] [--output=DIR]
        [--split=test|validation]

`--split=test` (the default) is the split to report; choose hyper-parameters on
`--split=validation` instead (jaxrlhf.data.splits).

`--checkpoint` is a run's output dir, its `checkpoints/` dir or one step's dir; the policy's
parameters are restored from it (only them: no optimizer state) onto the architecture of
`config.model.path` (a LoRA run's adapters, with its `--config.model.lora.rank=R`, merged
into that base). Greedy responses to the split's prompts come from a generator service —
the configured `generator.addresses` (the weights are published to it) or one started here on
an exported copy. Reported (report.json, samples.jsonl, report.png in the output dir):

- win rate against the dataset's reference responses under `eval.gold_reward_model` (ties ½);
- the KL proxy: perplexity of `eval.sft_model` (default: `config.model.path`) on the responses;
- mean response length (tokens); pass@1 for tasks with a checkable answer (arithmetic, GSM8k).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from jaxrlhf import prerequisites
from jaxrlhf.config import checked, model_options, parse_flags
from jaxrlhf.distributed import broadcast, driven_streams, is_driver, shard_global, to_host

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Run dir, checkpoints/ dir or step dir.")
_STEP = flags.DEFINE_integer("step", -1, "Checkpoint step (-1 = the latest).")
_OUTPUT = flags.DEFINE_string(
    "output", "", "Report dir ('' = <run>/eval-step-<N>, plus -validation for that split)."
)
_SPLIT = flags.DEFINE_enum("split", "test", ["test", "validation"], "The prompts to answer.")

ROWS = 8  # rows per scoring call (one compile per sequence length)


def find_step_dir(path: str | Path, step: int = -1) -> Path:
    """The step folder (holding `state/`) for a run dir, a checkpoints dir or a step dir."""
    path = Path(path).expanduser().resolve()
    if (path / "state").is_dir():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = sorted(
        int(p.name) for p in root.glob("*") if p.name.isdigit() and (p / "state").is_dir()
    )
    if not steps:
        raise FileNotFoundError(f"no Orbax checkpoint under {path} (looked for <step>/state/)")
    if step < 0:
        return root / str(steps[-1])
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint of step {step} under {root}; steps: {steps}")
    return root / str(step)


def restore_policy(step_dir: Path, like_params):
    """The policy parameters of a checkpoint (RLHF: params.policy, SFT: params), restored with
    the shapes and shardings of `like_params` and nothing else (partial restore)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    saved = checkpointer.metadata(step_dir / "state").item_metadata
    params_meta = saved["params"]
    nested = isinstance(params_meta, dict) and "policy" in params_meta
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like_params
    )
    args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding), abstract)
    item = {"params": {"policy": abstract} if nested else abstract}
    restore_args = {"params": {"policy": args} if nested else args}
    try:
        restored = checkpointer.restore(
            step_dir / "state",
            args=ocp.args.PyTreeRestore(item, restore_args, partial_restore=True),
        )
    except Exception as err:  # noqa: BLE001 - Orbax raises several types; name the cause
        raise ValueError(
            f"{step_dir} does not hold parameters of config.model.path's architecture: {err}"
        ) from err
    return restored["params"]["policy"] if nested else restored["params"]


def checkpoint_policy(config, base: Path, step_dir: Path, mesh):
    """(the model of `base`, the checkpoint's policy parameters on it). A LoRA run's checkpoint
    (`config.model.lora.rank` > 0, as it was trained) holds its adapters: they are restored
    and merged into the base (W + (alpha / r) A B), the weights its generators served."""
    import functools

    from jaxrlhf.models import load_pretrained
    from jaxrlhf.models import lora as lora_lib

    model, like = load_pretrained(base, mesh=mesh, **model_options(config.model))
    if not config.model.lora.rank:
        return model, restore_policy(step_dir, like)
    from jaxrlhf.rl.learner import lora_policy

    policy, adapter_like = lora_policy(model, config.model.lora, config.seed, mesh)
    adapter = restore_policy(step_dir, adapter_like)
    merge = jax.jit(functools.partial(lora_lib.merged_on_device, policy.config))
    return model, merge(adapter, like)


def prompt_response_batches(tokenizer, prompts, responses):
    """Arrays for scoring: one row per (prompt, response text + EOS), padded to the longest."""
    from jaxrlhf.data.types import prompt_ids, response_ids
    from jaxrlhf.stages.supervised import prompt_response_arrays

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    p_ids = [prompt_ids(tokenizer, p) for p in prompts]
    r_ids = [response_ids(tokenizer, r) for r in responses]
    length = max(len(p) for p in p_ids) + max(len(r) for r in r_ids)
    return prompt_response_arrays(p_ids, r_ids, pad, length)


def in_chunks(fn, arrays: dict[str, np.ndarray]) -> np.ndarray:
    """fn over rows in chunks of ROWS (the last one wrapped around), concatenated."""
    n = len(arrays["input_ids"])
    out = []
    for start in range(0, n, ROWS):
        rows = np.arange(start, start + ROWS) % n
        out.append(to_host(fn({k: v[rows] for k, v in arrays.items()}))[: n - start])
    return np.concatenate(out)


def gold_scores(path: Path, mesh, options: dict, prompts, *response_sets) -> list[np.ndarray]:
    """The gold reward model's score of each response of each set (one load of the model;
    `options`: its `load_pretrained` keywords)."""
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.stages.reward import RewardScorer

    scorer = RewardScorer(path, mesh, options)
    tokenizer = load_tokenizer(path)
    return [
        in_chunks(
            lambda b: scorer(b["input_ids"], b["attention_mask"]),
            prompt_response_batches(tokenizer, prompts, responses),
        )  # fmt: skip
        for responses in response_sets
    ]


def response_logprobs(path: Path, mesh, options: dict, prompts, responses) -> list[np.ndarray]:
    """Each response's per-token log-probs (EOS included) under the model at `path`."""
    from jaxrlhf.models import load_pretrained, token_logprobs
    from jaxrlhf.models.tokenizer import load_tokenizer

    model, params = load_pretrained(path, mesh=mesh, **options)
    tokenizer = load_tokenizer(path)
    arrays = prompt_response_batches(tokenizer, prompts, responses)
    logp = jax.jit(lambda p, i, m: token_logprobs(model, p, i, m))

    def chunk_logprobs(chunk):
        placed = shard_global({"i": chunk["input_ids"], "m": chunk["attention_mask"]}, mesh)
        return logp(params, placed["i"], placed["m"])

    lp = in_chunks(chunk_logprobs, arrays)
    mask = arrays["loss_mask"].astype(bool)
    return [row[m] for row, m in zip(lp, mask, strict=True)]


def evaluate(config, step_dir: Path, out_dir: Path, log, split: str = "test") -> dict:
    """Generates greedy responses of the checkpoint's policy to the prompts of `split` ("test"
    or "validation") and writes the report."""
    from jaxrlhf.data import task_registry
    from jaxrlhf.models.paths import resolve_model
    from jaxrlhf.models.tokenizer import load_tokenizer
    from jaxrlhf.report import build_report, write_report
    from jaxrlhf.rl.tasks import tokenize_prompts
    from jaxrlhf.sharding import make_mesh

    out_dir.mkdir(parents=True, exist_ok=True)
    config = config.copy_and_resolve_references()
    config.output_dir = str(out_dir)  # a generator started here logs there
    base = resolve_model(config.model.path)
    mesh = make_mesh(tuple(config.mesh.shape))
    frozen = model_options(config.model, frozen=True)  # the gold and SFT models, scoring only
    model, params = checkpoint_policy(config, base, step_dir, mesh)
    log(f"restored the policy from {step_dir}")
    tokenizer = load_tokenizer(base)
    prompts = task_registry.prompt_examples(config.task, split, config.seed)
    items = tokenize_prompts(tokenizer, prompts, config.rollout.max_prompt_tokens, split)
    max_tokens = config.eval.max_tokens or config.rollout.max_response_tokens
    driver = is_driver()  # over several processes: the one that talks to the generators
    samples = greedy_samples(config, model, params, base, items, max_tokens, log)
    samples = sorted(samples, key=lambda s: s.prompt_index)
    texts = [tokenizer.decode(list(s.token_ids), skip_special_tokens=True) for s in samples]
    lengths = [len(s.token_ids) for s in samples]
    rows = [
        {"id": p.id, "response": t, "reference": p.reference, "response_length": n}
        for p, t, n in zip(prompts, texts, lengths, strict=True)
    ]
    kwargs: dict = {"response_lengths": lengths}
    if config.eval.gold_reward_model:
        gold = resolve_model(config.eval.gold_reward_model)
        policy_scores, reference_scores = gold_scores(
            gold, mesh, frozen, prompts, texts, [p.reference for p in prompts]
        )
        kwargs.update(policy_scores=policy_scores, reference_scores=reference_scores)
        for row, a, b in zip(rows, policy_scores, reference_scores, strict=True):
            row.update(policy_score=float(a), reference_score=float(b))
    sft = resolve_model(config.eval.sft_model or config.model.path)
    kwargs["sft_logprobs"] = response_logprobs(sft, mesh, frozen, prompts, texts)
    verify = task_registry.verifier(config.task)
    if verify is not None:
        kwargs["correct"] = [bool(verify(p.answer, t)) for p, t in zip(prompts, texts, strict=True)]
        for row, ok in zip(rows, kwargs["correct"], strict=True):
            row["correct"] = ok
    extra = {"checkpoint": str(step_dir), "task": config.task.name, "split": split,
             "max_tokens": max_tokens,
             "gold_reward_model": config.eval.gold_reward_model, "sft_model": str(sft)}  # fmt: skip
    report = build_report(**kwargs, extra=extra)
    if driver:
        paths = write_report(report, rows, out_dir)
        log(f"report: {paths['report']} (plot {paths['plot']})")
    return report


def greedy_samples(config, model, params, base: Path, items, max_tokens: int, log) -> list:
    """The greedy response of `params` to each of `items`, from a generator started for them
    (or the running one at `generator.addresses`, sent these weights as its next version);
    the driver generates, every process gets the samples."""
    from jaxrlhf.models import hf_tensor_specs, iter_hf_tensors, save_pretrained
    from jaxrlhf.stages.rlhf import generator_pool

    driver = is_driver()
    with tempfile.TemporaryDirectory(prefix="jaxrlhf-eval-") as tmp:
        folder = save_pretrained(model, params, Path(tmp) / "policy", tokenizer_from=base,
                                 write=driver)  # fmt: skip
        pools = generator_pool(config, folder, log) if driver else contextlib.nullcontext()
        with pools as pool:
            if config.generator.addresses:  # a running service: serve these weights on it
                version = None
                if driver:
                    version = max(s.policy_version for s in pool.wait_until_serving()) + 1
                version, specs = broadcast(version), hf_tensor_specs(model, params)

                def publish(tensors):
                    return pool.publish_weights(tensors, len(specs), version, specs=specs)

                driven_streams(lambda: iter_hf_tensors(model, params), publish)
            samples = None
            if driver:
                greedy = dict(n=1, temperature=0.0, max_tokens=max_tokens)
                samples = pool.generate([p.token_ids for p in items], greedy)
            return broadcast(samples)


def main(argv) -> None:
    del argv
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    if config is None or not _CHECKPOINT.value:
        raise app.UsageError("--config=configs/NAME.py and --checkpoint=DIR are required")
    checked(config)
    recipe = prerequisites.recipe_of(
        config, config_flags.get_config_filename(flags.FLAGS["config"])
    )
    found = prerequisites.problems(prerequisites.evaluate_needs(config), recipe=recipe)
    try:
        step_dir = find_step_dir(_CHECKPOINT.value, _STEP.value)
    except FileNotFoundError as err:
        stage = recipe.stage_of(_CHECKPOINT.value) if recipe else None
        hint = f"; make it with `{recipe.command(stage)}`" if stage else ""
        found.insert(0, prerequisites.Missing(f"--checkpoint={_CHECKPOINT.value}: {err}{hint}"))
    if found:
        prerequisites.refuse(found)
    out = (
        Path(_OUTPUT.value)
        if _OUTPUT.value
        else step_dir.parent.parent
        / f"eval-step-{step_dir.name}{'' if _SPLIT.value == 'test' else '-' + _SPLIT.value}"
    )

    if config.distributed.enabled:
        from jaxrlhf.distributed import return_freed_host_memory
        from jaxrlhf.sharding import initialize_distributed

        d = config.distributed
        initialize_distributed(d.coordinator_address, d.num_processes, d.process_id)
        return_freed_host_memory()  # weight publishing keeps host memory to one tensor's

    def log(message: str) -> None:
        if is_driver():
            print(f"[jaxrlhf.evaluate] {message}", flush=True)

    report = evaluate(config, step_dir, out, log, _SPLIT.value)
    log("summary: " + json.dumps(report))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

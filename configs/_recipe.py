"""Shared shape of the paper's recipe configs: one file per task, the stage picked after a colon.

    python -m jaxrlhf.main --config=configs/tldr.py            # the whole recipe
    python -m jaxrlhf.main --config=configs/tldr.py:sft        # one stage alone
    python -m jaxrlhf.main --config=configs/tldr.py:reward
    python -m jaxrlhf.main --config=configs/tldr.py:rlhf
    python -m jaxrlhf.evaluate --config=configs/tldr.py --checkpoint=runs/tldr/rlhf

Each stage starts from the previous stage's output dir (`runs/<task>/<stage>`; its `hf_export/`
is picked up). Without a stage, the config is the RLHF stage's and `recipe.whole` is set:
`jaxrlhf.main` then runs the stages it needs first (`jaxrlhf.stages.chain`). That config also
carries the SFT and reward stages' configs under `sft` and `reward` (`whole_recipe`), so that
`--config.sft.train.learning_rate=2e-5` is checked against the SFT stage's keys and reaches it
alone; a plain `--config.train.learning_rate` reaches the RLHF stage (docs/recipes.md).
"""

from jaxrlhf.config import STAGES, base_config


def recipe(task: str, stage: str, base_model: str):
    whole = not stage
    stage = stage or "rlhf"
    if stage not in STAGES:
        raise ValueError(f"stage {stage!r} after the colon: one of {STAGES}")
    config = base_config()
    config.stage = stage
    config.task.name = task
    config.task.num_train = config.task.num_eval = 0  # the whole splits
    root = f"runs/{task}"
    config.output_dir = f"{root}/{stage}"
    config.model.path = base_model if stage == "sft" else f"{root}/sft"
    config.model.architecture = base_model  # the shapes, before the SFT stage has run
    config.task.reward_model_architecture = base_model  # the reward stage starts from SFT
    config.eval.sft_model = f"{root}/sft"
    # Where the stages' folders are, whether `jaxrlhf.main` runs the whole recipe, and the first
    # stage it reruns whatever its folder holds ("" = none: jaxrlhf.stages.chain).
    config.recipe = dict(root=root, whole=whole, rerun_from="")
    return config, root


def whole_recipe(config, get_config, earlier=STAGES[:-1]):
    """`config`, and when it is a whole recipe's, the config of each stage of `earlier` (those
    the task has) under its name (`get_config(stage)`: the recipe file's own)."""
    if config.recipe.whole:
        for stage in earlier:
            config[stage] = get_config(stage)
    return config

"""Shared shape of the paper's recipe configs: one file per task, the stage picked after a colon.

    python -m jaxrlhf.main --config=configs/tldr.py            # the whole recipe
    python -m jaxrlhf.main --config=configs/tldr.py:sft        # one stage alone
    python -m jaxrlhf.main --config=configs/tldr.py:reward
    python -m jaxrlhf.main --config=configs/tldr.py:rlhf
    python -m jaxrlhf.evaluate --config=configs/tldr.py --checkpoint=runs/tldr/rlhf

Each stage starts from the previous stage's output dir (`runs/<task>/<stage>`; its `hf_export/`
is picked up). Without a stage, the config is the RLHF stage's and `recipe.whole` is set:
`jaxrlhf.main` then runs the stages it needs first (`jaxrlhf.stages.chain`).
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
    # Where the stages' folders are, and whether `jaxrlhf.main` runs the whole recipe.
    config.recipe = dict(root=root, whole=whole)
    return config, root

"""TL;DR summarisation (the paper's main test bed): Pythia SFT -> reward model -> async Online DPO.

`--config=configs/tldr.py` runs SFT, the reward model, then RLHF, skipping finished stages;
one stage alone: `:sft`, `:reward`, `:rlhf` (configs/_recipe.py, docs/recipes.md). Data: the
hub sets in jaxrlhf.data.tldr (or local copies via `--config.task.source=` /
`--config.task.preference_source=`). Model size: Pythia 410M / 1B (default) / 2.8B via
`--config.model.path=EleutherAI/pythia-2.8b-deduped` (the first stage's model).

Hardware (expected, not measured here): Pythia 1B on one 80 GB GPU for the learner in fp32 with
remat (FSDP over more GPUs: `--config.mesh.shape=(1,-1,1)`) plus one GPU for the generator
service (`python -m generator_service --model runs/tldr/sft/hf_export`, then
`--config.generator.addresses=HOST:PORT`). The paper's run: 512 prompts/step x 2 samples,
~230 updates (one epoch of 116k prompts), a few hours on 8 A100s.
Evaluation: win rate against the human reference summaries under a gold reward model — set
`--config.eval.gold_reward_model=` to a larger reward model than the trained one.
"""

from configs._recipe import recipe, whole_recipe


def get_config(stage: str = ""):
    config, root = recipe("tldr", stage, "EleutherAI/pythia-1b-deduped")
    # fp32 on one 80 GB GPU: remat, micro-batches of 32 sequences and log-probs 128 positions
    # at a time (`python -m jaxrlhf.plan --config=configs/tldr.py[:stage]` checks it fits).
    config.model.remat = True
    config.model.logprob_chunk = 128
    config.train.micro_batch_size = 32
    config.hardware.devices = 1
    config.hardware.device_memory_gib = 80.0
    config.train.max_length = 512 + 53
    config.train.batch_size = 64
    if config.stage == "sft":
        config.train.learning_rate = 3e-5  # our choice (the paper gives the RLHF settings)
        config.total_steps = 116_722 // 64  # one epoch
    elif config.stage == "reward":
        config.train.learning_rate = 3e-6
        config.total_steps = 92_858 // 64  # one epoch of the comparisons
    else:
        config.task.reward_model = f"{root}/reward"
        config.loss = "online_dpo"
        config.loss_params.beta = 0.1
        config.loss_params.kl_coef = 0.05
        config.loss_params.penalty_reward_value = -1.0
        config.train.learning_rate = 3e-6
        config.rollout.prompts_per_batch = 512
        config.rollout.samples_per_prompt = 2
        config.rollout.temperature = 0.7
        config.rollout.max_prompt_tokens = 512
        config.rollout.max_response_tokens = 53
        config.max_staleness = 1  # asynchronous, one step off-policy
        config.total_steps = 116_722 // 512
        config.generator.max_model_len = 1024
        config.checkpoint.every = 20
    return whole_recipe(config, get_config)

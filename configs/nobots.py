"""No Robots chat: Llama 3.1 8B SFT -> reward model -> async Online DPO (the paper's large run).

`--config=configs/nobots.py` runs SFT, the reward model, then RLHF, skipping finished stages;
one stage alone: `:sft`, `:reward`, `:rlhf` (configs/_recipe.py, docs/recipes.md). Data:
`HuggingFaceH4/no_robots` for SFT and prompts. The hub has no preference pairs for it: the
reward stage needs `--config.task.preference_source=PATH` (a file of `messages`/`prompt` +
`chosen` + `rejected`, e.g. SFT samples labelled by a judge; see jaxrlhf.data.nobots). The
paper used a judge for evaluation: pass a gold reward model with
`--config.eval.gold_reward_model=`.

Hardware (expected, not measured here): Llama 3.1 8B in bf16 with FSDP over 8 x 80 GB GPUs for
the learner (`mesh.shape=(1,-1,1)`, remat on) plus one or more GPUs running generator replicas
(`--config.generator.addresses=h1:p,h2:p`). Paper settings: lr 8e-7, beta 0.03, 256 prompts per
step, responses up to 1024 tokens, temperature 0.7, missing-EOS penalty -10.
"""

from configs._recipe import recipe, whole_recipe


def get_config(stage: str = ""):
    config, root = recipe("nobots", stage, "meta-llama/Llama-3.1-8B")
    # bfloat16 compute on float32 master weights and Adam state (lr 8e-7 rounds away in bf16),
    # remat, 16 sequences per forward/backward, log-probs 256 positions at a time: the plan
    # (`python -m jaxrlhf.plan --config=configs/nobots.py`) fits 8 x 80 GB with FSDP.
    config.model.dtype = "bfloat16"
    config.model.param_dtype = "float32"
    config.model.remat = True
    config.model.logprob_chunk = 256
    config.train.micro_batch_size = 16
    config.hardware.devices = 8
    config.hardware.device_memory_gib = 80.0
    config.train.max_length = 2048
    config.train.batch_size = 128
    if config.stage == "sft":
        config.train.learning_rate = 2e-5  # our choice
        config.total_steps = 2 * 9_500 // 128  # two epochs
    elif config.stage == "reward":
        config.train.learning_rate = 1e-6
        config.total_steps = 500
    else:
        config.task.reward_model = f"{root}/reward"
        config.loss = "online_dpo"
        config.loss_params.beta = 0.03
        config.loss_params.kl_coef = 0.0
        config.loss_params.penalty_reward_value = -10.0
        config.train.learning_rate = 8e-7
        config.rollout.prompts_per_batch = 256
        config.rollout.samples_per_prompt = 2
        config.rollout.temperature = 0.7
        config.rollout.max_prompt_tokens = 1024
        config.rollout.max_response_tokens = 1024
        config.rollout.weight_sync_dtype = "bfloat16"
        config.max_staleness = 1
        config.total_steps = 9_500 // 256 * 3  # ~3 epochs over the prompts
        config.generator.dtype = "bfloat16"
        config.generator.max_model_len = 2048
        config.checkpoint.every = 10
    return whole_recipe(config, get_config)

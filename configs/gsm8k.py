"""GSM8k maths: Rho-1B (already SFT-ed on GSM8k) -> async Online DPO on the verifiable reward.

No reward model: the reward is 1 when the response's final number (`#### n`, else the last
number) equals the answer. `configs/gsm8k.py:sft` fine-tunes a base model on the worked
solutions first if you start from one (`--config.model.path=`); the RLHF stage starts from the
SFT-ed Rho-1B on the hub, so `configs/gsm8k.py` (the whole recipe) runs RLHF alone. Evaluation
reports greedy pass@1 on the test split.

Hardware (expected, not measured here): one 80 GB GPU for the 1B learner in fp32 plus one for the
generator service. Paper settings: K = 4 samples per prompt, lr 3e-6, responses up to 512 tokens.
"""

from configs._recipe import recipe, whole_recipe

SFT_MODEL = "realtreetune/rho-1b-sft-GSM8K"


def get_config(stage: str = ""):
    config, root = recipe("gsm8k", stage, "microsoft/rho-math-1b-v0.1")
    # fp32 on one 80 GB GPU: remat, micro-batches of 32 sequences and log-probs 128 positions
    # at a time (`python -m jaxrlhf.plan --config=configs/gsm8k.py[:stage]` checks it fits).
    config.model.remat = True
    config.model.logprob_chunk = 128
    config.train.micro_batch_size = 32
    config.hardware.devices = 1
    config.hardware.device_memory_gib = 80.0
    config.train.max_length = 768
    config.train.batch_size = 64
    if config.stage == "sft":
        config.train.learning_rate = 1e-5  # our choice
        config.total_steps = 3 * 7_473 // 64
    elif config.stage == "reward":
        raise ValueError("gsm8k has a verifiable reward: no reward-model stage")
    else:
        config.model.path = SFT_MODEL
        config.eval.sft_model = SFT_MODEL
        config.loss = "online_dpo"
        config.loss_params.beta = 0.1
        config.loss_params.penalty_reward_value = 0.0
        config.train.learning_rate = 3e-6
        config.rollout.prompts_per_batch = 64
        config.rollout.samples_per_prompt = 4
        config.rollout.temperature = 0.7
        config.rollout.max_prompt_tokens = 256
        config.rollout.max_response_tokens = 512
        config.max_staleness = 1
        config.total_steps = 7_473 // 64 * 2
        config.generator.max_model_len = 1024
        config.checkpoint.every = 10
    return whole_recipe(config, get_config, earlier=("sft",))  # no reward stage: a checker

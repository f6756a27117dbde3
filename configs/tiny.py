"""A tiny random model on the arithmetic task: every loss end to end on CPU in about a minute.

python -m jaxrlhf.main --config=configs/tiny.py --config.loss=ppo --config.max_staleness=1
"""

from jaxrlhf.config import base_config


def get_config():
    config = base_config()
    config.model.path = "tiny"  # a tiny random Llama built locally (jaxrlhf.models.tiny)
    config.output_dir = "/tmp/jaxrlhf-tiny"
    config.task.num_train = 64
    config.task.num_eval = 8
    config.rollout.prompts_per_batch = 4
    config.rollout.samples_per_prompt = 2
    config.rollout.temperature = 1.0
    config.rollout.max_prompt_tokens = 48
    config.rollout.max_response_tokens = 8
    config.total_steps = 4
    config.train.learning_rate = 1e-4
    config.train.batch_size = 8
    config.checkpoint.every = 2
    config.generator.max_model_len = 128
    return config

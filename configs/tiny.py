"""A tiny random model on the arithmetic task: exercises the whole stage in seconds (tests, CI)."""

from configs.default import get_config as default_config


def get_config():
    config = default_config()
    config.model.path = "tiny"  # a tiny random Llama built locally (jaxrlhf.models.tiny)
    config.output_dir = "/tmp/jaxrlhf-tiny"
    config.train.total_steps = 4
    config.train.learning_rate = 1e-3
    config.task.num_train = 32
    config.task.num_eval = 8
    return config

"""The offline default (`make run`): SmolLM2-135M-Instruct (packaged) on two-digit additions.

Asynchronous Online DPO through a real generator service started locally; nothing is
downloaded. Runs on 2 CPU cores.
"""

from jaxrlhf.config import base_config


def get_config():
    config = base_config()
    config.output_dir = "runs/default"
    config.loss = "online_dpo"
    config.loss_params.beta = 0.1
    config.rollout.samples_per_prompt = 4
    config.rollout.prompts_per_batch = 8
    config.train.learning_rate = 1e-5
    config.total_steps = 8
    # The reported figure on 256 of the 832 test additions (a fixed draw of the seed), to keep
    # `make run` short, at a wider interval than the whole split's (num_test=0: all of them).
    config.task.num_test = 256
    return config

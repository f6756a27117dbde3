"""The offline default (`make run`): SmolLM2-135M-Instruct (packaged), two-digit additions.

Runs on 2 CPU cores in a few minutes with nothing downloaded. Stage "sft" fine-tunes the model on
the task's answers (NLL on response tokens) on a device mesh and exports a Hugging Face folder.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.stage = "sft"
    config.seed = 0
    config.output_dir = "runs/default"
    # "smollm2" = the packaged SmolLM2-135M-Instruct; otherwise a local HF folder or a hub name.
    config.model = ml_collections.ConfigDict(dict(path="smollm2", dtype="float32", remat=False))
    config.mesh = ml_collections.ConfigDict(dict(shape=(1, -1, 1)))
    config.distributed = ml_collections.ConfigDict(
        dict(enabled=False, coordinator_address="", num_processes=1, process_id=0)
    )
    config.task = ml_collections.ConfigDict(dict(name="arithmetic", num_train=256, num_eval=64))
    config.train = ml_collections.ConfigDict(
        dict(batch_size=8, total_steps=16, learning_rate=2e-5, max_length=64, log_every=1)
    )
    config.export = True
    return config

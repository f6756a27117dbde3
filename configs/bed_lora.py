"""The test bed's default run with LoRA: rank 8 adapters trained alone, each publish the adapter
alone to a generator serving it over the base (no pause).

    python -m jaxrlhf.main --config=configs/bed_lora.py
    make run ARGS="--config=configs/bed_lora.py"   # the same, after the install

Everything else is configs/bed.py's. The learning rate, 4.5e-4 (30 times full fine-tuning's
1.5e-5), is what claim lora-tuning chose on validation over LoRA's grid of 5e-5, 1.5e-4 and
4.5e-4 (the top of the grid: a larger rate may do better); claim lora-compare compares the two
on test over ten seeds (docs/lora.md, BENCHMARKS.md).
"""

from configs.bed import get_config as bed_config


def get_config():
    config = bed_config()
    config.output_dir = "runs/bed_lora"
    config.model.lora.rank = 8
    config.train.learning_rate = 4.5e-4
    config.generator.swap_mode = "lora"
    return config

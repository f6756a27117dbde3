"""The test bed's default run: asynchronous Online DPO on the bed model, 64 small updates.

    python -m jaxrlhf.main --config=configs/bed.py

The bed (`model.path="bed"`, `jaxrlhf.models.bed`) is a 137k-parameter Llama trained once
from scratch on the train split's additions (built on first use, about a minute, then cached).
One step off-policy like configs/default.py, through a generator service started locally;
greedy evaluations of the whole validation and test splits before and after training.

Chosen on the validation split alone (the whole split, 787 prompts; gains in points of greedy
accuracy after 64 updates; records and tables in results/bed/):
- 64 prompts x 8 samples (+24.8, +20.6, +12.7, +32.9 over seeds 0-3 at lr 1e-4, against
  +24.0, +26.2, +17.0, +11.3 for 32 x 16; 16 prompts gained about half); temperature 1.0 (0.7
  and 0.5 gained less); beta 0.1 (1.0 gained less; IPO less); 4-token responses (the longest
  answer, 3 digits, and EOS). (results/bed/selection.md)
- lr 1.5e-5, the per-update step. At 1e-4 (the first choice, by gain) the KL from the start
  model reached 0.3 within 8 updates and stayed there, and a first pilot of 3 seeds put the
  paired spread of one-step-off − sync at 10 points: over 100 seeds for a ±2-point interval.
  On validation, sync and one-step-off, seeds 0-2: at 3e-5 both gained +29 to +33, paired
  s.d. 2.6; at 1.5e-5 they gained +30.0 to +31.6, the KL rose through the run (about 0.08
  after 8 updates, 0.15 after 16, 0.3 after 32), paired s.d. 0.5. (results/bed/learning-rate.md)
"""

from jaxrlhf.config import base_config


def get_config():
    config = base_config()
    config.model.path = "bed"
    config.output_dir = "runs/bed"
    config.task.num_train = 0  # every train prompt
    config.task.num_eval = 0  # the whole validation split
    config.task.num_test = 0  # the whole test split
    config.loss = "online_dpo"
    config.loss_params.beta = 0.1
    config.max_staleness = 1  # one step off-policy (configs/default.py)
    config.rollout.prompts_per_batch = 64
    config.rollout.samples_per_prompt = 8
    config.rollout.temperature = 1.0
    config.rollout.max_prompt_tokens = 24  # every arithmetic prompt, in the bed's tokenizer
    config.rollout.max_response_tokens = 4
    config.train.learning_rate = 1.5e-5
    # How far the policy moved, at each validation evaluation: its KL from the start model on
    # its own samples of 256 validation prompts (policy_kl; 4 tokens each, a second or two).
    config.eval.kl_prompts = 256
    config.total_steps = 64
    config.checkpoint.every = 64
    config.generator.max_model_len = 64
    return config

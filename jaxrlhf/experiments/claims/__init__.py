"""The paper's claims, each settled on the test bed with one command.

    python -m jaxrlhf.experiments.claims --claim pilot --seeds 0-9   # sizes the seeds of (a)
    python -m jaxrlhf.experiments.claims --claim a --seeds 0-29      # runs or resumes a claim
    python -m jaxrlhf.experiments.claims --claim a --report-only     # redraws from the records
    python -m jaxrlhf.experiments.claims --report-only               # the claims table

Every run is `python -m jaxrlhf.main --config=configs/bed.py` (`jaxrlhf.models.bed`: a small
Llama trained from scratch on the arithmetic task, fast enough for tens of seeds on 2 CPU
cores) with the overrides of its arm (`plans`), in `{out}/{claim}/{arm}/seed{S}/` (default
`--out results/claims`): its metrics.jsonl, summary.json, experiment.json and run.log are the
records, committed packed into `{out}/{claim}/records.jsonl.xz` (`jaxrlhf.experiments.records`:
`python -m jaxrlhf.experiments.records pack results/claims/X`). A run whose folder holds a
finished run with the same overrides, loose or packed, is not run again, so the same command
resumes a claim in any clone. `--report-only` reads the
records alone and writes `{out}/{claim}/claim.json` (rows, comparisons, verdict), `claim.png`
and prints a markdown table; without `--claim`, the table of every claim
(`{out}/claims.md`).

The claims (arms; comparisons, one family each, corrected by Holm's procedure):

- pilot: sync and one-step-off; the paired spread, and the seeds a ±2-point interval needs.
- (a) one-step-off async is as good as sync: sync, one-step-off, continuous; each async − sync.
- (b) Online DPO is the most robust loss off-policy: Online DPO, PPO, RLOO, GRPO at N in
  {1, 4, 16, 64} (and each correction of the ratio losses at N = 16); the fall of test accuracy
  from N = 1, each loss's − Online DPO's, per N.
- (c) a larger policy is more robust: bed, bed-m, bed-l at N in {1, 16, 64}, Online DPO; the
  fall, smaller − larger, per N.
- (d) K = 4 samples per prompt reach a target sooner than 2, training-bound: K in {2, 4};
  updates to a target chosen on validation, and the KL there.
- (e) several updates per batch help, generation-bound: 1, 2, 4 updates per batch; each U − 1.
- (f) ours: off-policy corrections on samples that span a publish (continuous generation,
  in-flight swaps, generation-bound): GRPO with each correction, Online DPO; each − GRPO alone.
- b-tuning: each loss of (b) on its own on-policy arm over a grid of learning rates and its β
  or KL coefficient, on validation alone (`tuning`); the choice goes into (b)'s plan.

Pre-registration (`registration`): a claim with a registration spec (`SPECS`) runs only from
its committed `plan.json` (`--write-plan` writes it), and its report labels the verdict
"pre-registered" or "post hoc".

Statistics (`jaxrlhf.experiments.stats`): differences paired by seed, mean ± s.e. (n − 1), 95%
t intervals; a section's comparisons are corrected with Holm's procedure before a difference is
called beyond noise. Verdict rules: `verdicts`. Nothing is chosen on the test split: the one
choice a claim makes (the target of (d)) is made on validation.
"""

from jaxrlhf.experiments.claims.plans import PLANS, Settings

TITLES = {
    "pilot": "Pilot: the spread of one-step-off − sync",
    "a": "(a) Asynchronous RLHF is as good as synchronous",
    "b": "(b) Online DPO is the loss most robust to off-policy data",
    "c": "(c) A larger policy is more robust to off-policy data",
    "d": "(d) Training-bound, K = 4 samples per prompt reach a target sooner than K = 2",
    "e": "(e) Generation-bound, several updates per batch help",
    "f": "(f) Off-policy corrections on samples that span a publish (ours)",
    "b-tuning": "(b) tuning: each loss's learning rate and β or KL coefficient, on validation",
}
# What the paper reports for each (DESIGN of the project: No Robots, TLDR, GSM8k runs).
PAPER = {
    "a": "matched: 57.2% win rate sync and async (No Robots, Llama 3.1 8B); GSM8k accuracy matched",
    "b": "Online DPO still learns at N = 64; PPO and RLOO degrade (TLDR)",
    "c": "robustness grows with the policy's size (Pythia 410M to 2.8B, TLDR)",
    "d": "K = 4 reaches the target about 2.5x sooner, at a higher KL",
    "e": "more updates per batch speed learning up, at a cost in final performance",
    "f": "not studied",
    "b-tuning": "set per loss (Online DPO 3e-6 with β 0.05; PPO 1e-6)",
}

__all__ = ["PAPER", "PLANS", "TITLES", "Settings"]

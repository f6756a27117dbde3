"""The paper's claims, each settled on the test bed with one command.

    python -m jaxrlhf.experiments.claims --claim pilot --seeds 0-9   # sizes the seeds of (a)
    python -m jaxrlhf.experiments.claims --claim a --seeds 0-29      # runs or resumes a claim
    python -m jaxrlhf.experiments.claims --claim a --report-only     # redraws from the records
    python -m jaxrlhf.experiments.claims --report-only               # the claims table

Every run is `python -m jaxrlhf.main --config=configs/bed.py` (`jaxrlhf.models.bed`: a small
Llama trained from scratch on the arithmetic task, fast enough for tens of seeds on 2 CPU
cores; a claim about another workload names its own config file, `ClaimSpec.config`) with the
overrides of its arm (its claim's plan), in `{out}/{claim}/{arm}/seed{S}/`
(default `--out results/claims`): its metrics.jsonl, summary.json, experiment.json and run.log
are the records, committed packed into `{out}/{claim}/records.jsonl.xz`
(`jaxrlhf.experiments.records`: `python -m jaxrlhf.experiments.records pack
results/claims/X`). A run whose folder holds a finished run with the same overrides, loose or
packed, is not run again, so the same command resumes a claim in any clone. `--report-only`
reads the records alone and writes `{out}/{claim}/claim.json` (rows, comparisons, verdict),
`claim.png` and prints a markdown table; without `--claim`, the table of every claim
(`{out}/claims.md`).

The claims, one module each, named for its subject (`async_as_good` is (a), `tuning` is
b-tuning, ...): its docstring states the claim, its arms and its comparisons; it holds its plan,
its verdict rule and its `SPEC` (`claim_spec.ClaimSpec`: name, title, the paper's statement,
plan, rule or analysis, table row, registration, defaults). `claim_registry.CLAIMS` lists them
in the claims table's order; `claim_registry.claim(name)` finds one.

What they share: `plans` (`Settings`, `planned_run`), `analysis` (figures of a run, paired
comparisons, `Verdict`), `verdicts.analyse` (the record), `figures` (figure and tables).

To add a claim: write `claims/<subject>.py` with its plan (`plans.planned_run` per arm and
seed), its verdict rule (`(arms, settings) -> (findings, Verdict)`, one Holm family) and
`SPEC = ClaimSpec(name=..., title=..., paper=..., plan=..., rule=...)`; add `<subject>.SPEC`
to `claim_registry.CLAIMS` where its row goes. Nothing else names claims: `--claim`, the
report, the figure and the claims table read the spec.

Pre-registration (`registration`): a claim whose spec has a `registration` (its measure, rule
and families) runs only from its committed `plan.json` (`--write-plan` writes it), and its
report labels the verdict "pre-registered" or "post hoc".

Statistics (`jaxrlhf.experiments.stats`): differences paired by seed, mean ± s.e. (n − 1), 95%
t intervals; a section's comparisons are corrected with Holm's procedure before a difference is
called beyond noise. Verdict rules: each claim's module. Nothing is chosen on the test split:
the one choice a claim makes (the target of (d)) is made on validation.
"""

"""Claim f-replicated: (f)'s arms on new seeds in a folder of its own, and a family fixed in
its plan that is exactly the one its rule draws (else its verdict would read post hoc)."""

from __future__ import annotations

from jaxrlhf.experiments.claims.claim_registry import claim
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.claims.verdicts import analyse
from tests.experiments.test_claims import write_run


def test_the_rule_draws_the_registered_family_on_its_own_runs(tmp_path):
    spec = claim("f-replicated")
    settings = Settings(seeds=(10, 11, 12), steps=4, eval_every=2)
    runs = spec.plan(settings, tmp_path)
    assert {run.folder.relative_to(tmp_path).parts[0] for run in runs} == {"f-replicated"}
    original = claim("f").plan(settings, tmp_path)

    def arms(planned):
        return [{k: v for k, v in r.overrides.items() if k != "output_dir"} for r in planned]

    assert arms(runs) == arms(original)  # (f)'s very arms
    for run in runs:
        write_run(run.folder, 0.5 + 0.01 * run.labels["seed"], mixed=0.6)
    record = analyse("f-replicated", runs, settings)
    drawn = [c["name"] for c in record["comparisons"]]
    assert drawn == spec.registration["families"]["f"]
    assert record["verdict"]["word"] == "differences beyond noise: none"

"""Claim e-parts ((e) in its two parts) on hand-written run records: generation rounds to a
target chosen on validation, and final accuracy, each its own family and verdict."""

from __future__ import annotations

import pytest

from jaxrlhf.experiments.claims.claim_registry import claim
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.claims.verdicts import analyse
from tests.experiments.test_claims import write_run


def test_rounds_to_the_target_and_final_accuracy_are_judged_apart(tmp_path):
    settings = Settings(seeds=(0, 1, 2), steps=4, eval_every=2)
    runs = claim("e-parts").plan(settings, tmp_path)
    assert {r.folder.relative_to(tmp_path).parts[0] for r in runs} == {"e-parts"}
    # Validation ends at 50% everywhere: the target is 50% test. write_run evaluates test at
    # update 2 at half the final accuracy: U1 (final 60-62%) first reaches 50% at update 4,
    # 4 rounds; U2 and U4 (final 100-102%) at update 2: 1 round and half a round.
    for run in runs:
        u, seed = run.labels["updates_per_batch"], run.labels["seed"]
        write_run(run.folder, (0.6 if u == 1 else 1.0) + 0.01 * seed)
    record = analyse("e-parts", runs, settings)
    by_name = {c["name"]: c for c in record["comparisons"]}
    assert by_name["rounds to the target: U2 − U1"]["mean"] == pytest.approx(-3.0)
    assert by_name["rounds to the target: U4 − U1"]["mean"] == pytest.approx(-3.5)
    assert by_name["final test: U4 − U1"]["mean"] == pytest.approx(40.0)
    assert [c["name"] for c in record["comparisons"]] == [
        name for names in claim("e-parts").registration["families"].values() for name in names
    ]
    # Fewer rounds beyond noise: the speed-up holds; higher final accuracy: no cost.
    assert record["verdict"]["word"] == "speed-up: supported; cost: contradicted"
    assert record["verdict"]["detail"].startswith("target 50.0% test; ")

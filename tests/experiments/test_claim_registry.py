"""Claims registered as losses are (issue 61): one module per claim holds its `ClaimSpec`, one
registry lists them, and a claim added there alone plans, reports and has its row."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
from pathlib import Path

import pytest

from jaxrlhf.experiments import claims as claims_package
from jaxrlhf.experiments.claims import claim_registry
from jaxrlhf.experiments.claims.__main__ import main
from jaxrlhf.experiments.claims.analysis import Finding, Verdict, family, interval, paired
from jaxrlhf.experiments.claims.claim_spec import ClaimSpec
from jaxrlhf.experiments.claims.plans import Settings, planned_run
from tests.experiments.test_claims import write_run


def test_every_registered_claim_has_a_complete_spec_in_its_own_module(tmp_path):
    names = claim_registry.names()
    assert names == (
        "pilot",
        "a",
        "a-steps",
        "b",
        "b-rounds",
        "c",
        "d",
        "d-pilot",
        "d-bound",
        "e",
        "e-parts",
        "f",
        "f-replicated",
        "b-tuning",
        "lora-tuning",
        "lora-compare",
        "lora-smollm2-tuning",
        "lora-smollm2-compare",
    )
    # the current rows, then the first runs that a pre-registered claim runs again
    in_table = ["a-steps", "b-rounds", "c", "d-bound", "e-parts", "f-replicated",
                "a", "b", "d", "e", "f"]  # fmt: skip
    assert [s.name for s in claim_registry.table()] == in_table
    for spec in claim_registry.table():
        if spec.rerun_by is not None:
            again = claim_registry.claim(spec.rerun_by)
            assert again.registration is not None and again.table_row, spec.name
            assert again.title.split()[0] == spec.title.split(",")[0], spec.name  # same letter
    for spec in claim_registry.CLAIMS:
        assert spec.title and spec.paper and callable(spec.plan), spec.name
        judged = spec.rule if spec.rule is not None else spec.analysis
        assert callable(judged) and (spec.rule is None) != (spec.analysis is None), spec.name
        # the module that holds the SPEC holds the claim's plan or its rule
        modules = [importlib.import_module(f.__module__) for f in (spec.plan, judged)]
        assert any(module.SPEC is spec for module in modules), spec.name
        if spec.table_row:  # a row states the paper's figure and judges it
            assert spec.paper != "-" and spec.rule is not None, spec.name
        if spec.registration is not None:
            assert {"measure", "rule", "families"} <= set(spec.registration), spec.name
        runs = spec.plan(Settings(seeds=(0,), steps=8, eval_every=4), tmp_path)
        assert runs and all(r.labels["arm"] and r.labels["seed"] == 0 for r in runs), spec.name
    # every claim module's SPEC is registered (a module with no registry line shows here)
    specs = []
    for info in pkgutil.iter_modules(claims_package.__path__):
        module = importlib.import_module(f"{claims_package.__name__}.{info.name}")
        if isinstance(getattr(module, "SPEC", None), ClaimSpec):
            specs.append(module.SPEC)
    assert sorted(s.name for s in specs) == sorted(names)


def test_unknown_claims_are_refused_with_the_known_ones(capsys):
    known = r"unknown claim 'g'; known claims: pilot, a, a-steps, b, .*f-replicated, b-tuning, lora"
    with pytest.raises(ValueError, match=known):
        claim_registry.claim("g")
    with pytest.raises(SystemExit):
        main(["--claim", "g", "--report-only"])
    assert "invalid choice: 'g'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="registered twice: a"):
        claim_registry.check((*claim_registry.CLAIMS, claim_registry.claim("a")))
    with pytest.raises(ValueError, match="a verdict rule or an analysis"):
        ClaimSpec(name="z", title="(z)", plan=lambda settings, out: [])
    with pytest.raises(ValueError, match="defaults of unknown settings"):
        dataclasses.replace(claim_registry.claim("a"), defaults={"losses": ("ppo",)})


def plan_z(settings: Settings, out: Path):
    return [planned_run(out, "z", arm, seed, settings, {"train.learning_rate": lr}, {})
            for seed in settings.seeds for arm, lr in (("low", 1e-5), ("high", 3e-5))]  # fmt: skip


def high_is_better(arms, settings: Settings) -> tuple[list[Finding], Verdict]:
    findings = family([Finding("high − low", paired(arms, "high", "low"))])
    word = "supported" if findings[0].beyond_noise else "unresolved at this power"
    return findings, Verdict(word, interval(findings[0].comparison))


Z = ClaimSpec(name="z", title="(z) A throwaway claim", paper="high beats low", plan=plan_z,
              rule=high_is_better, defaults={"seeds": "0-2", "steps": 4})  # fmt: skip


def test_a_claim_added_to_the_registry_alone_plans_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(claim_registry, "CLAIMS", (*claim_registry.CLAIMS, Z))
    out = tmp_path / "claims"
    for run in plan_z(Settings(seeds=(0, 1, 2), steps=4), out):  # high 10, 11, 12 points up
        seed = run.labels["seed"]
        write_run(run.folder, 0.5 + (0.10 + 0.01 * seed if run.labels["arm"] == "high" else 0))
    main(["--claim", "z", "--report-only", "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("## (z) A throwaway claim\n") and "| high | 3/3 |" in printed
    record = json.loads((out / "z" / "claim.json").read_text())
    assert record["title"] == Z.title and record["paper"] == "high beats low"
    assert record["settings"]["seeds"] == [0, 1, 2] and record["settings"]["steps"] == 4
    assert record["verdict"]["word"] == "supported" and record["family_size"] == 1
    assert (out / "z" / "claim.png").stat().st_size > 0
    main(["--report-only", "--out", str(out)])
    table = (out / "claims.md").read_text().splitlines()
    row = table[2 + 6]  # after the six current rows, before the first runs run again
    assert row.startswith("| (z) A throwaway claim | high beats low | high − low: +11.0")
    assert row.endswith("| supported |") and len(table) == 2 + 12  # the others not run
    # with a registration, the same claim writes its plan first
    rule = {"measure": "test accuracy", "rule": "high_is_better", "families": {"z": ["high − low"]}}
    registered = dataclasses.replace(Z, registration=rule)
    monkeypatch.setattr(claim_registry, "CLAIMS", (*claim_registry.CLAIMS[:-1], registered))
    main(["--claim", "z", "--write-plan", "--out", str(out)])
    plan = json.loads((out / "z" / "plan.json").read_text())
    assert sorted(plan["arms"]) == ["high", "low"] and plan["seeds"] == [0, 1, 2]
    with pytest.raises(SystemExit, match="claim a has no registration"):
        main(["--claim", "a", "--write-plan", "--out", str(out)])

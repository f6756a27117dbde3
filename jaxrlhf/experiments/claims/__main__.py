"""`python -m jaxrlhf.experiments.claims`: runs, resumes or reports a claim (package docstring)."""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxrlhf.experiments import CONFIGS
from jaxrlhf.experiments.claims import claim_registry, registration, start_models
from jaxrlhf.experiments.claims.analysis import by_arm
from jaxrlhf.experiments.claims.figures import claims_table, markdown, plot_claim
from jaxrlhf.experiments.claims.plans import Settings
from jaxrlhf.experiments.claims.verdicts import analyse
from jaxrlhf.experiments.runner import Runner, parse_passthrough, parse_seeds

# The command line's settings unless the claim's spec says otherwise (`ClaimSpec.defaults`).
DEFAULTS = {"seeds": "0-9", "steps": 64, "eval_every": 16}


def parse_args(argv: Sequence[str] | None):
    parser = argparse.ArgumentParser(prog="python -m jaxrlhf.experiments.claims",
                                     description=__doc__)  # fmt: skip
    parser.add_argument("--claim", choices=claim_registry.names(),
                        help="the claim to run or report")  # fmt: skip
    parser.add_argument("--seeds", default=None,
                        help='e.g. "0-19" or "0,1,2" (default 0-9, or the claim\'s own; with '
                             "--report-only, the seeds the claim last recorded)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="updates per run (default 64)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="updates between evaluations (default 16)")  # fmt: skip
    parser.add_argument("--write-plan", action="store_true",
                        help="write the claim's plan.json (commit it before the runs)")  # fmt: skip
    parser.add_argument("--out", default="results/claims")
    parser.add_argument("--report-only", action="store_true", help="read the records only")
    parser.add_argument("--generator-addresses", default="",
                        help="running services (as the other experiments' flag)")  # fmt: skip
    parser.add_argument("--rerun", action="store_true", help="rerun runs already finished")
    parser.add_argument("--rerun-other-starts", action="store_true",
                        help="rerun the finished runs that began from another build of "
                             "their start model than the committed one "
                             "(start_models.other_start)")  # fmt: skip
    parser.add_argument("--arms", default="",
                        help='run only the arms matching these patterns, e.g. "sync,grpo*/N16" '
                             "(the report still reads every arm's records)")  # fmt: skip
    args, extra = parser.parse_known_args(argv)
    args.passthrough = parse_passthrough(parser, extra)
    if args.claim is None and not args.report_only:
        parser.error("--claim is needed to run (without it, --report-only prints every claim)")
    return args


def settings_of(args, claim: str) -> Settings:
    """The command line's settings; with --report-only and no --seeds, those the claim's last
    report recorded (its seeds, steps and pass-throughs)."""
    recorded = Path(args.out) / claim / "claim.json"
    if args.seeds is None and args.report_only and recorded.exists():
        saved = json.loads(recorded.read_text())["settings"]
        return Settings(seeds=tuple(saved["seeds"]), steps=saved["steps"],
                        eval_every=saved["eval_every"],
                        passthrough=tuple(saved["passthrough"].items()))  # fmt: skip
    defaults = {**DEFAULTS, **claim_registry.claim(claim).defaults}
    return Settings(seeds=tuple(parse_seeds(args.seeds or defaults["seeds"])),
                    steps=args.steps or defaults["steps"],
                    eval_every=args.eval_every or defaults["eval_every"],
                    passthrough=tuple(args.passthrough.items()))  # fmt: skip


def run_claim(claim: str, args) -> dict:
    """Runs the claim's missing runs (unless `--report-only`), then analyses its records."""
    spec = claim_registry.claim(claim)
    settings = settings_of(args, claim)
    out = Path(args.out).resolve()
    runs = spec.plan(settings, out)
    planned = None
    if spec.registration is not None:
        planned = registration.build_plan(claim, settings, runs, spec.registration)
    if args.write_plan:
        if planned is None:
            sys.exit(f"claim {claim} has no registration (ClaimSpec.registration): its plan is "
                     "its code")  # fmt: skip
        path = registration.write_plan(out / claim, planned)
        print(f"[claim {claim}] wrote {path}: commit it before the first run", flush=True)
        return {}
    if planned is not None and not args.report_only:
        command = " ".join(["python -m jaxrlhf.experiments.claims", *sys.argv[1:]])
        problem = registration.check_before_running(out / claim, planned, command)
        if problem:
            sys.exit(f"claim {claim}: {problem}")
    if not args.report_only:
        for line in start_models.install():
            print(f"[claim {claim}] start model {line}", flush=True)
        runner = Runner(CONFIGS / spec.config, out / claim, f"claim {claim}",
                        args.generator_addresses, rerun=args.rerun)  # fmt: skip
        if args.rerun_other_starts:
            runner.stale = lambda run: start_models.other_start(
                run.folder, start_models.model_of(run.overrides))  # fmt: skip
        patterns = [p for p in args.arms.split(",") if p]
        chosen = [run for run in runs if not patterns
                  or any(fnmatch.fnmatch(run.labels["arm"], p) for p in patterns)]  # fmt: skip
        if not chosen:
            sys.exit(f"--arms {args.arms!r} matches no arm of claim {claim}: "
                     f"{', '.join(sorted({r.labels['arm'] for r in runs}))}")  # fmt: skip
        runner.run_all(chosen, last=5)
    record = analyse(claim, runs, settings)
    if planned is not None and "verdict" in record:
        names = [c["name"] for c in record.get("comparisons", [])]
        record["verdict"]["registration"] = registration.registration(out / claim, planned, names)
    record |= {"title": spec.title, "paper": spec.paper,
               "settings": {"seeds": list(settings.seeds), "steps": settings.steps,
                            "eval_every": settings.eval_every,
                            "passthrough": dict(settings.passthrough)}}  # fmt: skip
    folder = out / claim
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "claim.json").write_text(json.dumps(record, indent=2))
    curves = {arm: [f["curve"] for f in seeds.values()] for arm, seeds in by_arm(runs).items()}
    plot_claim(record, curves, folder / "claim.png", spec.title)
    return record


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.claim is not None:
        record = run_claim(args.claim, args)
        if args.write_plan:
            return
        print(f"## {claim_registry.claim(args.claim).title}\n")
        print(markdown(record))
        print(f"\nrecords: {Path(args.out) / args.claim}; figure: claim.png there")
        return
    out = Path(args.out)
    recorded = {s.name: out / s.name / "claim.json" for s in claim_registry.table()}
    if not any(path.exists() for path in recorded.values()):
        sys.exit(f"no claim recorded in {out}: run one with --claim")
    rows = [(spec, json.loads(recorded[spec.name].read_text()) if recorded[spec.name].exists()
             else {"verdict": {"word": "not run yet"}})  # a claim not run yet keeps its row
            for spec in claim_registry.table()]  # fmt: skip
    table = claims_table(rows)
    (out / "claims.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()

"""The test bed's targets, measured: build time and determinism, start accuracy of every size,
and the default RL run's gain, learner time per update and wall time.

    python bench/bed.py --out /tmp/bed-bench            # every size, the default run on "bed"

For each size (`--sizes`), the bed is built from its recipe (`jaxrlhf.models.bed.Recipe`) into
a fresh folder (timed: `build_s`, the whole subprocess) and, with `--twice`, built again into a
second one, its files compared byte for byte (`same_bytes`). Its parameters are counted from the
safetensors file. Then `python -m jaxrlhf.main --config=configs/bed.py` runs on it as a user
runs it (a generator service started by the run itself, as on a fresh machine):
- on the sizes of `--full` (default "bed"), the whole default run (64 updates, greedy
  evaluations of the whole test split before and after): `wall_s` of the process,
  `test_before`/`test_after` (%), `gain` (points), `learner_s_median` (the median over updates of
  `step_s - wait_for_generation_s`: the learner's own time) and `kl_end`;
- on the other sizes, one update with the evaluation before it only: `test_before`.

`--choose-steps K1,K2,...` measures instead how each size's SFT length was chosen
(`jaxrlhf.models.bed.STEPS`), on the validation split alone: the default bed as built, then each
other size of `--sizes` built for K1, K2, ... SFT steps, each evaluated greedily on the whole
validation split before one update (`val_before`, %; the test split is not evaluated). One JSON
line per build, then one per size with `chosen`: the steps whose `val_before` is nearest the
default bed's (the rule that chose `STEPS`).

`--config.KEY=VALUE` arguments pass through to every run. One JSON line per size. Nothing
else should run on the machine meanwhile (timings).
`--sft-steps` and `--steps` shrink everything for the smoke test (tests/bench/test_bench.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxrlhf.experiments import CONFIGS, main_command, read_run, run_main  # noqa: E402
from jaxrlhf.experiments.runner import parse_passthrough  # noqa: E402
from jaxrlhf.models import bed  # noqa: E402

FILES = ("model.safetensors", "config.json", "tokenizer.json", "bed.json")


def parameters(folder: Path) -> int:
    from safetensors.numpy import load_file

    return sum(int(t.size) for t in load_file(folder / "model.safetensors").values())


def built(name: str, recipe: bed.Recipe, root: Path) -> tuple[Path, float]:
    started = time.perf_counter()
    folder = bed.bed_path(name, recipe, root=root)
    return folder, time.perf_counter() - started


def run(folder: Path, model: Path, steps: int, full: bool, extra: dict) -> dict:
    """The default run on `model` (`full`), or one update after the evaluations before it."""
    overrides = {**extra, "model.path": str(model), "output_dir": str(folder), "export": False}
    if steps:
        overrides |= {"total_steps": steps, "checkpoint.every": steps}
    if not full:
        overrides |= {"total_steps": 1, "checkpoint.every": 1, "eval.at_end": False}
    code, seconds = run_main(main_command(CONFIGS / "bed.py", overrides), folder / "run.log")
    if code:
        raise SystemExit(f"the run in {folder} failed (exit {code}); see {folder / 'run.log'}")
    records, summary = read_run(folder)
    before = {"test_before": "test_accuracy_start", "val_before": "eval_accuracy_start"}
    row = {name: 100 * summary[key] for name, key in before.items() if key in summary}
    if full:
        learner = [r["step_s"] - r["wait_for_generation_s"] for r in records]
        row |= {
            "updates": len(records),
            "test_after": 100 * summary["test_accuracy_end"],
            "gain": 100 * (summary["test_accuracy_end"] - summary["test_accuracy_start"]),
            "learner_s_median": statistics.median(learner),
            "kl_end": records[-1]["kl"],
            "wall_s": seconds,
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(bed.SIZES))
    parser.add_argument("--full", default="bed", help="sizes that get the whole default run")
    parser.add_argument("--twice", action="store_true", help="build each size twice, compare")
    parser.add_argument(
        "--cached", action="store_true", help="the builds in $JAXRLHF_CACHE (made if missing)"
    )
    parser.add_argument("--sft-steps", type=int, default=0, help="0 = the recipe's")
    parser.add_argument("--steps", type=int, default=0, help="RL updates; 0 = configs/bed.py's")
    parser.add_argument("--out", default="", help="folder for builds and runs (default: temp)")
    parser.add_argument("--choose-steps", default="", help="SFT steps to try per size (docstring)")
    args, extra = parser.parse_known_args()
    passthrough = parse_passthrough(parser, extra)
    out = Path(args.out or tempfile.mkdtemp(prefix="bed-bench-"))
    if args.choose_steps:
        root = bed.cache_dir() / "models" / "bed" if args.cached else out / "builds-1"
        grid = [int(k) for k in args.choose_steps.split(",")]
        choose_steps(args.sizes.split(","), grid, root, out, args.sft_steps, passthrough)
        return
    for name in args.sizes.split(","):
        recipe = bed.Recipe(size=name)
        if args.sft_steps:
            recipe = dataclasses.replace(recipe, steps=args.sft_steps)
        root = bed.cache_dir() / "models" / "bed" if args.cached else out / "builds-1"
        model, seconds = built(name, recipe, root)
        row = {"size": name, "parameters": parameters(model), "sft_steps": recipe.steps}
        if not args.cached:
            row["build_s"] = seconds
        if args.twice:
            again, row["build_s_again"] = built(name, recipe, out / "builds-2")
            row["same_bytes"] = all(
                (model / f).read_bytes() == (again / f).read_bytes() for f in FILES
            )
        full = name in args.full.split(",")
        row |= run(out / "runs" / name, model, args.steps, full, passthrough)
        print(json.dumps(row), flush=True)


def choose_steps(sizes, grid, root: Path, out: Path, bed_steps: int, extra: dict) -> None:
    """`--choose-steps` (module docstring): validation accuracy at the start per size and SFT
    length, and the length nearest the default bed's."""
    extra = {**extra, "eval.test": False}

    def measured(name: str, steps: int) -> dict:
        recipe = dataclasses.replace(bed.Recipe(size=name), **({"steps": steps} if steps else {}))
        model, seconds = built(name, recipe, root)
        row = {"size": name, "sft_steps": recipe.steps, "build_s": seconds}
        row |= run(out / "choose" / f"{name}-{recipe.steps}", model, 0, False, extra)
        print(json.dumps(row), flush=True)
        return row

    target = measured("bed", bed_steps)["val_before"]
    for name in (size for size in sizes if size != "bed"):
        rows = [measured(name, steps) for steps in grid]
        best = min(rows, key=lambda row: abs(row["val_before"] - target))
        print(json.dumps({"size": name, "target_val": target, "chosen": best["sft_steps"],
                          "val_before": best["val_before"]}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""How results/bed/learning-rate.md's table was made from the records beside it:

python results/bed/learning_rate_table.py
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from jaxrlhf.experiments import records  # noqa: E402

ROOT = Path(__file__).resolve().parent / "learning-rate"
HEADER = (
    "| lr | arm | seed | val before -> after | gain | val at 16 / 32 / 48 "
    "| KL at 8 / 16 / 32 / 64 (mean of 4 steps) |\n|---|---|---|---|---|---|---|"
)


def rate(folder: Path) -> str:
    return folder.name[2:].split("-first")[0]


def row(folder: Path, lr: str, arm: str, seed: int) -> tuple[str, float]:
    files = records.files(folder)
    summary = json.loads(files["summary.json"])
    lines = files["metrics.jsonl"].splitlines()
    by_step = {r["step"]: r for r in map(json.loads, lines)}
    kl = [statistics.mean(by_step[k]["kl"] for k in range(t - 3, t + 1)) for t in (8, 16, 32, 64)]
    val = " / ".join(f"{100 * by_step[t]['eval_accuracy']:.1f}" for t in (16, 32, 48))
    before, after = 100 * summary["eval_accuracy_start"], 100 * summary["eval_accuracy_end"]
    text = (f"| {lr} | {arm} | {seed} | {before:.1f} -> {after:.1f} | {after - before:+.1f} "
            f"| {val} | {' / '.join(f'{k:.2f}' for k in kl)} |")  # fmt: skip
    return text, after


def final_test(run: Path) -> float:
    return json.loads(records.text(run, "summary.json"))["test_accuracy_end"]


def main() -> None:
    print(HEADER)
    finals: dict[str, dict[int, dict[str, float]]] = {}
    rates = {ROOT / run.relative_to(ROOT).parts[0] for run in records.runs(ROOT)}
    for folder in sorted(rates, key=lambda p: float(rate(p))):
        for arm in ("sync", "one-step-off"):
            for seed in range(3):
                run = folder / arm / f"seed{seed}"
                if records.text(run, "summary.json") is not None:
                    text, after = row(run, rate(folder), arm, seed)
                    print(text)
                    finals.setdefault(rate(folder), {}).setdefault(seed, {})[arm] = after
    for lr, seeds in finals.items():
        diffs = [v["one-step-off"] - v["sync"] for v in seeds.values() if len(v) == 2]
        if len(diffs) > 1:
            print(f"\n{lr}: one-step-off − sync on validation, paired: "
                  f"{statistics.mean(diffs):+.1f}, s.d. {statistics.stdev(diffs):.1f} "
                  f"({len(diffs)} seeds)")  # fmt: skip
    first = next(folder for folder in rates if folder.name.endswith("-first-pilot"))
    test = {arm: [final_test(first / arm / f"seed{seed}") for seed in range(3)]
            for arm in ("sync", "one-step-off")}  # fmt: skip
    diffs = [100 * (a - s) for a, s in zip(test["one-step-off"], test["sync"], strict=True)]
    print(f"\nThe first pilot at {rate(first)} (the test split on): one-step-off − sync on test, "
          f"paired: {statistics.mean(diffs):+.1f}, s.d. {statistics.stdev(diffs):.1f} "
          f"({len(diffs)} seeds)")  # fmt: skip


if __name__ == "__main__":
    main()

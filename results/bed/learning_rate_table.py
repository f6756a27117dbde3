"""How results/bed/learning-rate.md's table was made from the records beside it:
    python results/bed/learning_rate_table.py"""
import json, sys, statistics
from pathlib import Path
root = Path(__file__).resolve().parent / "learning-rate"
print("| lr | arm | seed | val before -> after | gain | val at 16 / 32 / 48 | KL at 8 / 16 / 32 / 64 (mean of 4 steps) |")
print("|---|---|---|---|---|---|---|")
diffs = {}
for lrdir in sorted(root.iterdir(), key=lambda p: float(p.name[2:].split("-first")[0])):
    for arm in ("sync", "one-step-off"):
        for s in range(3):
            d = lrdir / arm / f"seed{s}"
            if not (d / "summary.json").exists(): continue
            sm = json.loads((d / "summary.json").read_text())
            rs = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()]
            by = {r["step"]: r for r in rs}
            kl = lambda t: statistics.mean(by[k]["kl"] for k in range(t - 3, t + 1))
            val = " / ".join(f"{100*by[t]['eval_accuracy']:.1f}" for t in (16, 32, 48))
            a, b = 100 * sm["eval_accuracy_start"], 100 * sm["eval_accuracy_end"]
            diffs.setdefault(lrdir.name, {}).setdefault(s, {})[arm] = b
            print(f"| {lrdir.name[2:].split('-first')[0]} | {arm} | {s} | {a:.1f} -> {b:.1f} | {b-a:+.1f} | {val} | "
                  + " / ".join(f"{kl(t):.2f}" for t in (8, 16, 32, 64)) + " |")
for lr, seeds in diffs.items():
    d = [v["one-step-off"] - v["sync"] for v in seeds.values() if len(v) == 2]
    if len(d) > 1:
        print(f"\n{lr[2:].split('-first')[0]}: one-step-off − sync on validation, paired: {statistics.mean(d):+.1f}, s.d. {statistics.stdev(d):.1f} ({len(d)} seeds)")

"""Claim (c), an exploratory look (chosen after seeing the interim results, so no verdict rests
on it): how much of its own on-policy gain each size keeps off-policy, per seed.

    python results/claims/c_kept.py

The claim's measure, the fall from N = 1, also grows with what a size gains on-policy; the sizes
start 15 points apart. Here the gain at N is divided by the gain at N = 1 (test accuracy minus
the start, per seed), so a size that learns less on-policy is not counted more robust for it.
`after 16` is the evaluation after update 16 of the N = 16 runs: 16 updates on the start
model's samples, as the first 16 of an N = 64 run are (its own evaluations then measure the
start model: the generators serve the last publish's weights). Comparisons pair by seed over
the seeds where all of the claim's arms finished, with Holm's correction over the six.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from jaxrlhf.experiments import records  # noqa: E402
from jaxrlhf.experiments.stats import compare, holm  # noqa: E402

HERE = Path(__file__).resolve().parent / "c"
SIZES, NS = ("bed", "bed-m", "bed-l"), (1, 16, 64)


def run(size: str, n: int, seed: int) -> dict | None:
    folder = HERE / size / f"N{n}" / f"seed{seed}"
    files = records.files(folder)
    if "summary.json" not in files:
        return None
    summary = json.loads(files["summary.json"])
    lines = [json.loads(line) for line in files["metrics.jsonl"].splitlines()]
    after16 = [r["test_accuracy"] for r in lines if r["step"] == 16 and "test_accuracy" in r]
    return {"start": 100 * summary["test_accuracy_start"],
            "end": 100 * summary["test_accuracy_end"],
            "after16": 100 * after16[0] if after16 else None}  # fmt: skip


def main() -> None:
    seeds = sorted(int(p.name[4:]) for p in records.runs(HERE / "bed" / "N1"))
    runs = {s: {(z, n): run(z, n, s) for z in SIZES for n in NS} for s in seeds}
    seeds = [s for s in seeds if all(runs[s].values())]
    kept = {(z, n): [100 * (runs[s][z, n]["end"] - runs[s][z, n]["start"])
                     / (runs[s][z, 1]["end"] - runs[s][z, 1]["start"]) for s in seeds]
            for z in SIZES for n in NS[1:]}  # fmt: skip

    def mean(values) -> float:
        return sum(values) / len(values)

    print(f"Seeds: {len(seeds)} ({', '.join(map(str, seeds))})\n")
    print("| size | start % | N = 1, end | N = 16, after 16 | N = 16, end | N = 64, end | "
          "kept at N = 16 | kept at N = 64 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for z in SIZES:
        start = mean([runs[s][z, 1]["start"] for s in seeds])
        cells = [mean([runs[s][z, n][key] for s in seeds])
                 for n, key in ((1, "end"), (16, "after16"), (16, "end"), (64, "end"))]  # fmt: skip
        kept_cells = [f"{compare(kept[z, n]).mean:.0f}% ± {compare(kept[z, n]).stderr:.0f}"
                      for n in NS[1:]]  # fmt: skip
        print(f"| {z} | {start:.1f} | " + " | ".join(f"{c:.1f}" for c in cells)
              + " | " + " | ".join(kept_cells) + " |")  # fmt: skip
    pairs = [(a, b, n) for n in NS[1:] for i, a in enumerate(SIZES) for b in SIZES[i + 1 :]]
    found = [compare([kb - ka for ka, kb in zip(kept[a, n], kept[b, n], strict=True)])
             for a, b, n in pairs]  # fmt: skip
    rejected = holm([c.p for c in found])
    print("\n| larger − smaller, share kept (points of %) | mean ± s.e. | 95% CI | p | "
          "beyond noise (Holm over 6) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for (a, b, n), c, beyond in zip(pairs, found, rejected, strict=True):
        print(
            f"| {b} − {a}, N = {n} | {c.mean:+.1f} ± {c.stderr:.1f} | "
            f"[{c.low:+.1f}, {c.high:+.1f}] | {c.p:.3g} | {'yes' if beyond else 'no'} |"
        )


if __name__ == "__main__":
    main()

"""The four-round exploration of claim (b) at N = 64, by generation round: means over the
seeds of each round's 64 updates (from each run's metrics.jsonl).

    python results/claims-rounds/by_round.py

`sampler's KL` is the `kl` a run logs, that of the policy that generated the batch against the
reference; `sample reward` the mean reward of the samples trained on; `pairs right` Online
DPO's share of pairs its policy ranks right (`loss/accuracy`).
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from jaxrlhf.experiments import records  # noqa: E402

HERE = Path(__file__).resolve().parent / "b"
ROUND = 64


def rounds(arm: str) -> list[list[list[dict]]]:
    """Per seed, its update records split into rounds of ROUND updates."""
    runs = []
    for seed in records.runs(HERE / arm):
        files = records.files(seed)
        if "summary.json" not in files:
            continue
        lines = [json.loads(line) for line in files["metrics.jsonl"].splitlines()]
        updates = [r for r in lines if "step" in r and "reward_mean" in r]
        last = max(r["step"] for r in updates)
        runs.append([[r for r in updates if lo <= r["step"] < lo + ROUND]
                     for lo in range(1, last + 1, ROUND)])  # fmt: skip
    return runs


def mean(runs: list[list[list[dict]]], index: int, key: str) -> float:
    return statistics.mean(statistics.mean(r[key] for r in run[index]) for run in runs)


def main() -> None:
    dpo, grpo = rounds("online_dpo/N64"), rounds("grpo/N64")
    print(
        "| N = 64, updates | Online DPO: sampler's KL | sample reward | pairs right "
        "| GRPO: sampler's KL | sample reward |"
    )
    print("|---|---|---|---|---|---|")
    for index in range(len(dpo[0])):
        first = ROUND * index + 1
        print(
            f"| {first}-{first + ROUND - 1} | {mean(dpo, index, 'kl'):.2f} "
            f"| {mean(dpo, index, 'reward_mean'):.3f} "
            f"| {100 * mean(dpo, index, 'loss/accuracy'):.0f}% "
            f"| {mean(grpo, index, 'kl'):.2f} | {mean(grpo, index, 'reward_mean'):.3f} |"
        )


if __name__ == "__main__":
    main()

"""Claim b-rounds, exploratory: Online DPO against GRPO at N = 64, round by round (a round is
the 64 updates trained on one generation; means over every finished seed).

    python results/claims/b_rounds_by_round.py

Per round: `sampler KL`, the KL to the reference of the policy that generated the round's
samples (`kl`); `pairs right`, the share of Online DPO's pairs its policy ranks right, and
`chosen` / `rejected`, its implicit rewards β·log(π/π_ref) of each pair's better and worse
response (`loss/*`), over the round's updates; `test %`, the test accuracy at the round's end
(the evaluation every 64 updates; the last is the run's final one). Then Online DPO's sampler
KL at N = 1, where the policy samples its own pairs after every update, at the same points.
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from jaxrlhf.experiments import records  # noqa: E402

HERE = Path(__file__).resolve().parent / "b-rounds"
ROUND = 64


def rounds(arm: str) -> list[tuple[list[list[dict]], list[float]]]:
    """Per finished seed: its update records split into rounds, and the test accuracy at the
    end of each round."""
    out = []
    for seed in records.runs(HERE / arm):
        files = records.files(seed)
        if "summary.json" not in files:
            continue
        lines = [json.loads(line) for line in files["metrics.jsonl"].splitlines()]
        updates = [r for r in lines if "reward_mean" in r]
        split = [[r for r in updates if lo <= r["step"] < lo + ROUND]
                 for lo in range(1, updates[-1]["step"] + 1, ROUND)]  # fmt: skip
        tests = {r["step"]: r["test_accuracy"] for r in lines if "test_accuracy" in r}
        ends = [tests.get(ROUND * (i + 1)) for i in range(len(split))]
        ends[-1] = json.loads(files["summary.json"])["test_accuracy_end"]
        out.append((split, ends))
    return out


def mean(runs, index: int, key: str) -> float:
    return statistics.mean(statistics.mean(r[key] for r in split[index]) for split, _ in runs)


def test_at(runs, index: int) -> float:
    return 100 * statistics.mean(ends[index] for _, ends in runs)


def main() -> None:
    dpo, grpo = rounds("online_dpo/N64"), rounds("grpo/N64")
    print("| N = 64, updates | Online DPO: sampler KL | pairs right | chosen | rejected | test % "
          "| GRPO: sampler KL | test % |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for index in range(len(dpo[0][0])):
        first = ROUND * index + 1
        print(
            f"| {first}-{first + ROUND - 1} | {mean(dpo, index, 'kl'):.2f} "
            f"| {100 * mean(dpo, index, 'loss/accuracy'):.0f}% "
            f"| {mean(dpo, index, 'loss/chosen_rewards'):+.3f} "
            f"| {mean(dpo, index, 'loss/rejected_rewards'):+.3f} | {test_at(dpo, index):.1f} "
            f"| {mean(grpo, index, 'kl'):.2f} | {test_at(grpo, index):.1f} |"
        )
    on_policy = rounds("online_dpo/N1")
    at_end = statistics.mean(r["kl"] for split, _ in on_policy for r in split[0][-1:])
    print(f"\nOnline DPO at N = 1 (a publish every update), for comparison: sampler KL "
          f"{at_end:.2f} at update {ROUND}, {mean(on_policy, 1, 'kl'):.2f} over updates "
          f"{ROUND + 1}-{2 * ROUND}.")  # fmt: skip


if __name__ == "__main__":
    main()

"""Claim (b)'s check on Online DPO's fall at large N: what its loss did to the pairs it trained
on, per N, over the last 8 updates of every finished seed (means over seeds).

    python results/claims/b_dpo_pairs.py

`chosen` and `rejected` are the loss's implicit rewards, β·log(π/π_ref) of the pair's better and
worse response, `margin` their difference and `pairs right` the share of pairs the policy ranks
right (`loss/*` in each run's metrics.jsonl); `sample reward` is the mean reward of the samples
trained on, which at N = 64 are all the start model's.
"""

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from jaxrlhf.experiments import records  # noqa: E402

HERE = Path(__file__).resolve().parent / "b" / "online_dpo"
KEYS = ("loss/chosen_rewards", "loss/rejected_rewards", "loss/margins", "loss/accuracy")


def last_updates(metrics: str, count: int = 8) -> list[dict]:
    lines = [json.loads(line) for line in metrics.splitlines()]
    return [r for r in lines if "step" in r and KEYS[0] in r][-count:]


def over_seeds(runs: list[list[dict]], key: str) -> float:
    return statistics.mean(statistics.mean(update[key] for update in run) for run in runs)


def main() -> None:
    print("| N | seeds | chosen | rejected | margin | pairs right | sample reward |")
    print("|---|---|---|---|---|---|---|")
    arms = sorted({run.parent for run in records.runs(HERE)}, key=lambda p: int(p.name[1:]))
    for arm in arms:
        finished = [records.files(s) for s in records.runs(arm)]
        runs = [last_updates(files["metrics.jsonl"]) for files in finished
                if "summary.json" in files]  # fmt: skip
        cells = [f"{over_seeds(runs, key):+.3f}" for key in KEYS[:3]]
        cells.append(f"{100 * over_seeds(runs, KEYS[3]):.0f}%")
        cells.append(f"{over_seeds(runs, 'reward_mean'):.3f}")
        print(f"| {arm.name[1:]} | {len(runs)} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()

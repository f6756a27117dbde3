"""The table of results/claims/f-workload.md: each candidate workload of claim (f), its
overrides (from the run's command line) and the share of its samples that mixed versions.

    python results/claims/f_workload_table.py
"""

import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent / "f-workload"
# The keys a candidate set; the rest of each command is claim (f)'s plan for Online DPO.
KEYS = ("loss", "generator.max_num_seqs", "max_staleness", "rollout.prompts_per_batch")


def overrides(run_log: Path) -> dict[str, str]:
    command = run_log.read_text().splitlines()[0]
    found = dict(re.findall(r"--config\.([\w.]+)=(\S+)", command))
    return {key: found.get(key, "") for key in KEYS}


def main() -> None:
    print(
        "| candidate | loss | max_num_seqs | max_staleness | prompts a batch | updates | "
        "mixed-version samples | validation % after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for folder in sorted(p for p in HERE.iterdir() if p.is_dir()):
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        mixed = [r.get("mixed_version_fraction", 0.0) for r in records if "step" in r]
        summary = folder / "summary.json"
        test = None
        if summary.exists():
            test = json.loads(summary.read_text()).get("eval_accuracy_end")
        keys = overrides(folder / "run.log")
        rows.append((sum(mixed) / len(mixed), folder.name, keys, len(mixed), test))
    for share, name, keys, steps, test in sorted(rows, key=lambda row: (row[2]["loss"], row[0])):
        after = "-" if test is None else f"{100 * test:.1f}"
        print(
            f"| {name} | {keys['loss']} | {keys[KEYS[1]]} | {keys[KEYS[2]] or 1} | "
            f"{keys[KEYS[3]] or 64} | {steps} | {100 * share:.1f}% | {after} |"
        )


if __name__ == "__main__":
    sys.exit(main())

"""The table of results/claims/f-workload.md: each candidate workload of claim (f), its
overrides (from the run's command line) and the share of its samples that mixed versions.

    python results/claims/f_workload_table.py
"""

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from jaxrlhf.experiments import records  # noqa: E402

HERE = Path(__file__).resolve().parent / "f-workload"
# The keys a candidate set; the rest of each command is claim (f)'s plan for Online DPO.
KEYS = ("loss", "generator.max_num_seqs", "max_staleness", "rollout.prompts_per_batch")


def overrides(run_log: str) -> dict[str, str]:
    command = run_log.splitlines()[0]
    found = dict(re.findall(r"--config\.([\w.]+)=(\S+)", command))
    return {key: found.get(key, "") for key in KEYS}


def main() -> None:
    print(
        "| candidate | loss | max_num_seqs | max_staleness | prompts a batch | updates | "
        "mixed-version samples | validation % after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for folder in records.runs(HERE):
        files = records.files(folder)
        lines = [json.loads(line) for line in files["metrics.jsonl"].splitlines()]
        mixed = [r.get("mixed_version_fraction", 0.0) for r in lines if "step" in r]
        test = None
        if "summary.json" in files:
            test = json.loads(files["summary.json"]).get("eval_accuracy_end")
        keys = overrides(files["run.log"])
        rows.append((sum(mixed) / len(mixed), folder.name, keys, len(mixed), test))
    for share, name, keys, steps, test in sorted(rows, key=lambda row: (row[2]["loss"], row[0])):
        after = "-" if test is None else f"{100 * test:.1f}"
        print(
            f"| {name} | {keys['loss']} | {keys[KEYS[1]]} | {keys[KEYS[2]] or 1} | "
            f"{keys[KEYS[3]] or 64} | {steps} | {100 * share:.1f}% | {after} |"
        )


if __name__ == "__main__":
    sys.exit(main())

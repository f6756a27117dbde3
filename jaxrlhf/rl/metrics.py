"""Run metrics: one JSON line per step in {output_dir}/metrics.jsonl, TensorBoard scalars, and a
progress bar with the figures a user watches (reward, KL, staleness, throughput)."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

PROGRESS_KEYS = (
    ("reward_mean", "reward"),
    ("kl", "kl"),
    ("staleness_mean", "stale"),
    ("eval_accuracy", "eval_acc"),
    ("generation_tokens_per_s", "gen_tok/s"),
)


class MetricsWriter:
    def __init__(self, output_dir: str | Path, total_steps: int, start_step: int, resume: bool):
        from tqdm import tqdm

        SummaryWriter = summary_writer_class()

        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume and self.path.exists():
            # Drop lines of steps after the checkpoint: they are trained again.
            kept = [
                line
                for line in self.path.read_text().splitlines()
                if line and json.loads(line).get("step", 0) <= start_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif self.path.exists():
            self.path.unlink()
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
        self._bar = tqdm(total=total_steps, initial=start_step, desc="rlhf", dynamic_ncols=True)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for key, value in record.items():
            if isinstance(value, (int, float)) and key != "step":
                self._tb.add_scalar(key, value, step)
        shown = {label: f"{record[k]:.3g}" for k, label in PROGRESS_KEYS if k in record}
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(1)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leaves the time spent inside out of the progress bar's elapsed time, rate and ETA:
        evaluations (927 greedy prompts before training in the default job) are not steps, and
        counted as one they made the first ETA several times the run's real length."""
        began = self._bar._time()
        try:
            yield
        finally:
            # tqdm's own `unpause` shifts its clock the same way (start and last print).
            spent = self._bar._time() - began
            self._bar.start_t += spent
            self._bar.last_print_t += spent

    def close(self) -> None:
        self._bar.close()
        self._tb.close()
        self._file.close()


_IMPORT_LOCK = threading.Lock()


def summary_writer_class() -> type:
    """tensorboardX's `SummaryWriter`, imported without torch where torch is not loaded yet.

    Its writer module imports torch, if installed, only to accept torch tensors as values; this
    learner logs Python numbers alone. Importing torch took 2 s of every run's start on 2 cores
    (`python -X importtime -m jaxrlhf.main ...`). `sys.modules["torch"] = None` makes that one
    import fail as "not installed" for the moment tensorboardX's modules load; torch imports
    normally afterwards. Where torch is loaded already, nothing is blocked."""
    with _IMPORT_LOCK:
        block = "tensorboardX" not in sys.modules and "torch" not in sys.modules
        if block:
            sys.modules["torch"] = None  # type: ignore[assignment]
        try:
            from tensorboardX import SummaryWriter
        finally:
            if block and sys.modules.get("torch", 0) is None:
                del sys.modules["torch"]
        return SummaryWriter


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value

"""The run's metrics writer (jaxrlhf/rl/metrics.py): metrics.jsonl and TensorBoard scalars,
with tensorboardX imported without torch."""

import json
import struct
import subprocess
import sys

from tests.conftest import REPO


def event_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the TensorBoard event files in `folder` (TFRecord frames of Event protos:
    length, its CRC, the record, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_the_writer_logs_each_step_to_jsonl_and_tensorboard_without_importing_torch(tmp_path):
    code = (
        "import sys; from jaxrlhf.rl.metrics import MetricsWriter; "
        f"w = MetricsWriter({str(tmp_path)!r}, total_steps=2, start_step=0, resume=False); "
        "w.write(1, {'reward_mean': 0.25, 'note': 'a'}); w.write(2, {'reward_mean': 0.5}); "
        "w.close(); print('torch' in sys.modules); import torch"  # and torch imports after
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "reward_mean": 0.25, "note": "a"},
        {"step": 2, "reward_mean": 0.5},
    ]
    assert event_scalars(tmp_path / "tensorboard") == {"reward_mean": [(1, 0.25), (2, 0.5)]}


def test_where_torch_is_loaded_the_writer_imports_as_ever():
    code = (
        "import torch, sys; from jaxrlhf.rl.metrics import summary_writer_class; "
        "summary_writer_class(); import tensorboardX.writer as w; print(w.numpy_compatible)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    assert "torch.Tensor" in out.stdout

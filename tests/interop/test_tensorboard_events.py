"""The trainer's TensorBoard event files, read back by TensorBoard's own event reader: every record's CRC-32C checks,
and the scalars Megatron writes ("lm loss", "learning-rate", "grad-norm", and the "vs samples" forms) come back with
their steps and values."""
import os
import subprocess

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

TOOL = os.environ["TRESTLE_TENSORBOARD_TOOL"]


def test_event_file_reads_back(tmp_path):
    path = subprocess.run([TOOL, str(tmp_path), "5"], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.basename(path).startswith("events.out.tfevents.")
    # The loader drops a record whose CRC-32C does not check, so the count proves every record's checksums.
    events = list(EventFileLoader(path).Load())
    assert len(events) == 1 + 5 * 14
    assert events[0].file_version == "brain.Event:2"
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"lm loss", "lm loss vs samples", "learning-rate", "grad-norm", "batch-size", "world-size",
            "iteration-time"} <= tags
    assert [e.value for e in acc.Scalars("world-size vs samples")] == [4.0] * 5
    loss = acc.Scalars("lm loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    assert [e.value for e in loss] == [11.0 - 0.25 * i for i in range(1, 6)]
    assert [e.step for e in acc.Scalars("lm loss vs samples")] == [8, 16, 24, 32, 40]
    assert abs(acc.Scalars("learning-rate")[2].value - 3e-4) < 1e-9
    assert acc.Scalars("grad-norm")[4].value == 2.5

"""Fault injection: the I/O steps of conversions and saves fail (ENOSPC, EIO) or hang, reads and writes come back
short, and a real file system fills up.

Injected faults use the fault points of ckpt/fault_point.h (TRESTLE_TEST_FAIL_POINT=N fails the Nth write, sync,
rename or commit step as its system call would). Every case must end with a clear error naming the file and the OS
reason, no hang, no torn output and the previous checkpoint intact:
- a conversion failing at any step exits 1 with the error, leaves its destination absent (or whole, when only the
  final directory sync failed) and no partial output behind;
- short reads and writes (TRESTLE_TEST_MAX_TRANSFER) change no output; reads and writes that make no progress fail;
- a save failing at any step keeps the tracker and the previous iteration, and the next save succeeds;
- a training worker hanging mid-save ends the job within --distributed-timeout-seconds;
- a real full disk (a small tmpfs, in a private mount namespace) during convert, reshard and save.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from models import save_tiny_model  # noqa: E402
from test_crash_consistency import (CONVERSIONS, CORPUS, LLAMA, PythonSaver, check_complete,  # noqa: E402,F401
                                    conversion_args, kill_points, run_killed, sources, verified)

MESSAGES = {"ENOSPC": "No space left on device (injected fault)", "EIO": "Input/output error (injected fault)"}


def failing(trestle_bin, args, n, name):
    return run_killed(trestle_bin, args, env_extra={"TRESTLE_TEST_FAIL_POINT": str(n), "TRESTLE_TEST_FAIL_ERRNO": name})


@pytest.mark.parametrize("case", list(CONVERSIONS))
def test_failing_conversion_step_reports_and_leaves_nothing(sources, trestle_bin, tmp_path, case):
    dst = tmp_path / "out"
    args = conversion_args(trestle_bin, case, sources, dst)
    points = kill_points(trestle_bin, args, tmp_path, lambda: shutil.rmtree(dst))
    for n, point in enumerate(points, start=1):
        name = "ENOSPC" if n % 2 else "EIO"
        result = failing(trestle_bin, args, n, name)
        assert result.returncode == 1, f"{point}: exit {result.returncode}\n{result.stderr}"
        # (writer threads pass their points in varying order: the failing step is one of the command's steps)
        assert any(f": {step}: {MESSAGES[name]}" in result.stderr for step in set(points)), result.stderr
        if dst.exists():  # only a sync after the rename into place failed: then the output must be whole
            assert "fsync directory" in result.stderr or "output committed" in result.stderr, result.stderr
            check_complete(trestle_bin, case, sources, dst)
            shutil.rmtree(dst)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == [], point


@pytest.mark.parametrize("case", list(CONVERSIONS))
def test_short_transfers_change_nothing_and_no_progress_fails(sources, trestle_bin, tmp_path, case):
    """Every file read and write call moving at most 1000 bytes (4096 for O_DIRECT files), as a kernel returning short
    counts would: the conversion's output is whole and reads back the same way. Calls that move nothing at all end
    the conversion with a clear error (never a loop without progress) and leave nothing behind."""
    dst = tmp_path / "out"
    args = conversion_args(trestle_bin, case, sources, dst)
    result = run_killed(trestle_bin, args, env_extra={"TRESTLE_TEST_MAX_TRANSFER": "1000"})
    assert result.returncode == 0, result.stderr
    check_complete(trestle_bin, case, sources, dst)
    if CONVERSIONS[case][1] == "verify":  # and read back through short reads
        again = run_killed(trestle_bin, [trestle_bin, "verify", dst, "--against", sources / "hf"],
                           env_extra={"TRESTLE_TEST_MAX_TRANSFER": "1000"})
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr
    shutil.rmtree(dst)
    stuck = run_killed(trestle_bin, args, env_extra={"TRESTLE_TEST_MAX_TRANSFER": "0"})
    assert stuck.returncode == 1, stuck.stderr
    assert any(m in stuck.stderr for m in ("nothing written", "unexpected end of file", "file shrank while read",
                                           "runs past the end of the file")), stuck.stderr
    assert not dst.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_failing_save_step_keeps_the_previous_checkpoint(trestle_bin, tmp_path):
    root = tmp_path / "root"
    save = PythonSaver(trestle_bin, tmp_path, root)
    assert save(1, 1).returncode == 0
    trace = tmp_path / "trace.txt"
    before = tmp_path / "before"
    shutil.copytree(root, before)
    assert save(2, 2, trace=trace).returncode == 0
    points = trace.read_text().splitlines()
    for n, point in enumerate(points, start=1):
        shutil.rmtree(root)
        shutil.copytree(before, root)
        name = "ENOSPC" if n % 2 else "EIO"
        result = save(2, 2, env_extra={"TRESTLE_TEST_FAIL_POINT": str(n), "TRESTLE_TEST_FAIL_ERRNO": name})
        assert result.returncode != 0 and MESSAGES[name] in result.stderr, f"{point}: {result.stderr[-2000:]}"
        tracked = (root / "latest_checkpointed_iteration.txt").read_text().strip()
        # only a failure after the tracker's rename (its directory sync, or the step after it) leaves the new one
        assert tracked == "1" or (tracked == "2" and point in ("fsync directory", "committed")), (point, tracked)
        assert verified(trestle_bin, root, int(tracked)) and verified(trestle_bin, root, 1), point
        assert save(2, 2).returncode == 0
        assert [p.name for p in root.iterdir() if p.name.startswith(".")] == [], point
    assert len(points) >= 8


def test_short_transfers_during_a_save(trestle_bin, tmp_path):
    """trestle.save through short writes (at most 1000 bytes a call, whole 4096-byte blocks for O_DIRECT) commits a
    checkpoint that verifies; a save whose writes make no progress fails and keeps the previous iteration."""
    root = tmp_path / "root"
    save = PythonSaver(trestle_bin, tmp_path, root)
    short = save(1, 1, env_extra={"TRESTLE_TEST_MAX_TRANSFER": "1000"})
    assert short.returncode == 0, short.stderr
    assert verified(trestle_bin, root, 1)
    stuck = save(2, 2, env_extra={"TRESTLE_TEST_MAX_TRANSFER": "0"})
    assert stuck.returncode != 0 and "nothing written" in stuck.stderr, stuck.stderr[-2000:]
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert verified(trestle_bin, root, 1)
    assert save(2, 2).returncode == 0 and verified(trestle_bin, root, 2)


def test_hung_worker_ends_the_job_within_the_timeout(sources, trestle, trestle_bin, tmp_path):
    """Rank 1 of a two-worker training job never returns from a write of its save: rank 0's commit times out after
    --distributed-timeout-seconds, the job ends with an error, and the checkpoint saved before stays the tracked one."""
    data = tmp_path / "data"
    data.mkdir()
    trestle.run("preprocess", "--input", CORPUS / "kjv.jsonl", "--output-prefix", data / "kjv", "--tokenizer-type",
                "HuggingFaceTokenizer", "--tokenizer-model", CORPUS / "tokenizer.json", "--append-eod", "--quiet")
    save_tiny_model(tmp_path / "hf", "LlamaConfig", dict(LLAMA, vocab_size=4096, num_hidden_layers=2), seed=5)
    trestle.run("convert", "--from", "hf", tmp_path / "hf", "--to", "trestle", tmp_path / "start", "-q")
    root = tmp_path / "root"
    args = [trestle_bin, "train", "--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--data-path",
            data / "kjv_text_document", "--split", "98,2,0", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--seq-length", "16", "--lr", "1e-3", "--eval-iters", "0", "--save", root, "--save-interval", "2",
            "--log-interval", "100", "--distributed-timeout-seconds", "10"]
    assert run_killed(trestle_bin, args + ["--train-iters", "2", "--load", tmp_path / "start"]).returncode == 0
    start = time.monotonic()
    result = run_killed(trestle_bin, args + ["--train-iters", "4", "--load", root],
                        env_extra={"TRESTLE_TEST_HANG_POINT": "1", "TRESTLE_TEST_FAULT_RANK": "1"})
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-3000:]
    assert elapsed < 90, f"the job took {elapsed:.0f} s to end"
    assert "rank" in result.stderr, result.stderr[-3000:]
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert verified(trestle_bin, root, 2)


FULL_DISK = textwrap.dedent("""
    set -u
    mount -t tmpfs -o size=$SIZE tmpfs "$DISK" || exit 90
    "$@" > "$DISK.stdout" 2> "$DISK.stderr"
    echo $? > "$DISK.rc"
    ls -A "$DISK" > "$DISK.listing"
    df -k "$DISK" | tail -1 > "$DISK.df"
""")


def on_full_disk(tmp_path, size, *command):
    """Runs command with a `size` tmpfs mounted at tmp_path/disk (a private mount namespace: nothing is left mounted);
    returns its exit code, stderr and what the file system held afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    script = tmp_path / "full_disk.sh"
    script.write_text(FULL_DISK)
    env = dict(os.environ, SIZE=size, DISK=str(disk))
    wrapper = [] if os.geteuid() == 0 else ["unshare", "-r"]
    result = subprocess.run([*wrapper, "unshare", "-m", "--propagation", "private", "sh", str(script),
                             *map(str, command)], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, f"could not mount a tmpfs: {result.stderr}"
    read = lambda suffix: pathlib.Path(f"{disk}.{suffix}").read_text()  # noqa: E731
    return int(read("rc")), read("stderr"), read("listing").split()


def test_full_disk_during_convert_and_reshard(sources, trestle_bin, tmp_path):
    for args in (["convert", "--from", "hf", sources / "hf", "--to", "trestle", tmp_path / "disk" / "out", "-q"],
                 ["reshard", sources / "t22", tmp_path / "disk" / "out", "--tp", "1", "--pp", "1", "-q"],
                 ["convert", "--from", "trestle", sources / "t22", "--to", "hf", tmp_path / "disk" / "out", "-q"]):
        rc, stderr, listing = on_full_disk(tmp_path, "96k", trestle_bin, *args)
        assert rc == 1, stderr
        assert "No space left on device" in stderr and str(tmp_path / "disk") in stderr, stderr
        assert listing == [], f"{args[0]} left {listing} on the full file system"


def test_full_disk_during_save_keeps_the_previous_checkpoint(trestle_bin, tmp_path):
    root = tmp_path / "disk" / "root"
    save = PythonSaver(trestle_bin, tmp_path, root)
    # One save (6 x 64 x 48 fp32 = 72 KiB) fits in 128 KiB, a second does not; the check runs inside the namespace.
    check = tmp_path / "check.sh"
    check.write_text(textwrap.dedent(f"""
        {" ".join(save.command(1, 1))} || exit 11
        {" ".join(save.command(2, 2))}
        rc=$?
        cat {root}/latest_checkpointed_iteration.txt
        {trestle_bin} verify {root} --iteration 1 >&2 || exit 12
        ls -A {root}
        exit $rc
    """))
    rc, stderr, _ = on_full_disk(tmp_path, "128k", "sh", check)
    out = pathlib.Path(f"{tmp_path / 'disk'}.stdout").read_text().split()
    assert rc not in (0, 11, 12), stderr
    assert "No space left on device" in stderr, stderr
    assert out[0] == "1", out  # the tracker still names iteration 1, which verified
    assert sorted(out[1:]) == ["iter_0000001", "latest_checkpointed_iteration.txt"], out  # the failed save is gone

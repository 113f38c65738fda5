"""Interrupted runs leave nothing behind: conversions, a reshard, an HDF5 export and import and a preprocess stopped by
SIGINT (Ctrl-C), SIGTERM (a scheduler's or `kill`'s) or SIGHUP (a closed terminal) remove their staging directory, its
lock file and their temporary files before they die, and die by that signal (so shells and schedulers see it).

Each case runs once with TRESTLE_TEST_KILL_TRACE to list the fault points it passes (ckpt/fault_point.h), then with
TRESTLE_TEST_HANG_POINT=N for a few N, which parks the process at its Nth point; once the trace shows it there, the
test sends the signal. Afterwards the output directory holds what it held before, plus the destination only if the
run had already committed it (then it is whole), and the same command succeeds again.
"""
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from models import save_tiny_model  # noqa: E402

CORPUS = pathlib.Path(__file__).resolve().parents[2] / "train" / "data" / "corpus"
LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]


@pytest.fixture(scope="module")
def sources(tmp_path_factory, trestle):
    root = tmp_path_factory.mktemp("sources")
    save_tiny_model(root / "hf", "LlamaConfig", LLAMA, seed=7)
    trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "t22", "--tp", 2, "--pp", 2, "-q")
    trestle.run("export", "--to", "hdf5", root / "t22", root / "t22.h5")
    return root


CASES = {
    # name: (arguments with {hf}, {t22} and OUT for the output directory, the destination's name in it)
    "hf_to_trestle": (["convert", "--from", "hf", "{hf}", "--to", "trestle", "OUT/dst", "--tp", "2", "--pp", "2",
                       "--codec", "zstd", "-q"], "dst"),
    "hf_to_megatron_dist": (["convert", "--from", "hf", "{hf}", "--to", "megatron-dist", "OUT/dst", "--tp", "2", "-q"],
                            "dst"),
    "trestle_to_hf": (["convert", "--from", "trestle", "{t22}", "--to", "hf", "OUT/dst", "-q"], "dst"),
    "reshard": (["reshard", "{t22}", "OUT/dst", "--tp", "1", "--pp", "1", "--dp", "2", "-q"], "dst"),
    "export_hdf5": (["export", "--to", "hdf5", "{t22}", "OUT/dst.h5"], "dst.h5"),
    # (the import runs in a child process: the signal, sent to trestle, is passed on to it)
    "import_hdf5": (["import", "--from", "hdf5", "{t22}.h5", "OUT/dst"], "dst"),
    "preprocess": (["preprocess", "--input", str(CORPUS / "kjv.jsonl"), "--output-prefix", "OUT/kjv", "--tokenizer-type",
                    "HuggingFaceTokenizer", "--tokenizer-model", str(CORPUS / "tokenizer.json"), "--append-eod",
                    "--quiet"], "kjv_text_document.bin"),
}


def command(trestle_bin, case, sources, out):
    return [trestle_bin] + [a.replace("{hf}", str(sources / "hf")).replace("{t22}", str(sources / "t22"))
                            .replace("OUT", str(out)) for a in CASES[case][0]]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRESTLE_TEST_")}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def listing(out):
    """Every path under `out`, relative to it (a staging directory left inside the destination shows)."""
    return sorted(str(p.relative_to(out)) for p in out.rglob("*"))


def wait_parked(process, trace, point):
    """Returns once the trace shows `process` at fault point `point`, where TRESTLE_TEST_HANG_POINT parks it."""
    deadline = time.monotonic() + 120
    while not (trace.exists() and len(trace.read_text().splitlines()) >= point):
        assert process.poll() is None, f"ended before point {point}: {process.communicate()}"
        assert time.monotonic() < deadline, f"point {point} not reached in 120 s"
        time.sleep(0.02)
    time.sleep(0.1)  # the trace line is written just before the process parks


def interrupt_at(args, point, sig, trace):
    """Runs `args` parked at fault point `point`, sends `sig` once it is there; returns the finished process."""
    trace.unlink(missing_ok=True)
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=clean_env(TRESTLE_TEST_HANG_POINT=point, TRESTLE_TEST_KILL_TRACE=trace))
    try:
        wait_parked(process, trace, point)
        process.send_signal(sig)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, stderr


@pytest.mark.parametrize("case", list(CASES))
def test_an_interrupted_run_removes_what_it_was_writing(sources, trestle_bin, tmp_path, case):
    out = tmp_path / "out"
    out.mkdir()
    (out / "unrelated").write_text("kept")
    trace = tmp_path / "trace.txt"
    args = command(trestle_bin, case, sources, out)
    dst = out / CASES[case][1]

    first = subprocess.run(args, capture_output=True, text=True, timeout=300,
                           env=clean_env(TRESTLE_TEST_KILL_TRACE=trace))
    assert first.returncode == 0, first.stderr
    complete = listing(out)
    points = trace.read_text().splitlines()
    assert points, "the run passes no fault point"
    for p in out.iterdir():
        if p.name != "unrelated":
            subprocess.run(["rm", "-rf", p], check=True)

    # The first point, one in the middle and the last (after the commit, for most cases): each ended by a signal.
    chosen = sorted({1, (len(points) + 1) // 2, len(points)})
    for i, point in enumerate(chosen):
        sig = SIGNALS[i % len(SIGNALS)]
        returncode, stderr = interrupt_at(args, point, sig, trace)
        where = f"{sig.name} at point {point} of {len(points)} ({points[point - 1]})"
        assert returncode == -sig, f"{where}: exit {returncode}, expected death by the signal\n{stderr}"
        left = listing(out)
        if dst.exists():  # committed before the signal: the whole output, and nothing else
            assert left == complete, f"{where}: {left}"
        else:
            assert left == ["unrelated"], f"{where}: left behind {left}"
        for p in out.iterdir():
            if p.name != "unrelated":
                subprocess.run(["rm", "-rf", p], check=True)

    again = subprocess.run(args, capture_output=True, text=True, timeout=300, env=clean_env())
    assert again.returncode == 0, again.stderr
    assert listing(out) == complete
    assert (out / "unrelated").read_text() == "kept"


def test_a_handled_sigint_is_left_to_its_handler(sources, trestle_bin, tmp_path):
    """A parent that ignores SIGINT (nohup-style jobs, `trap '' INT`) passes that on; the conversion keeps running and
    finishes, instead of being ended or cleaned up by a signal it was told to ignore."""
    out = tmp_path / "out"
    out.mkdir()
    trace = tmp_path / "trace.txt"
    args = command(trestle_bin, "hf_to_trestle", sources, out)
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=clean_env(TRESTLE_TEST_KILL_TRACE=trace, TRESTLE_TEST_HANG_POINT=3),
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_parked(process, trace, 3)
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert process.poll() is None, "an ignored SIGINT ended the run"
        assert any(p.name.startswith(".dst.partial.") for p in out.iterdir()), "the staging was removed"
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGTERM
    assert listing(out) == []

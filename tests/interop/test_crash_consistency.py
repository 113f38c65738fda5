"""Crash consistency: saves, conversions and reshards SIGKILLed at every write, sync, rename and commit step.

Each case first runs its command once with TRESTLE_TEST_KILL_TRACE to list the kill points it passes (ckpt/fault_point.h),
then once per point with TRESTLE_TEST_KILL_POINT=N, which makes the process kill itself there. After every kill:
- a conversion's destination is either absent or a whole, verified conversion (never a torn one), and running the
  same command again removes the dead run's partial output and succeeds;
- a save into an existing checkpoint root leaves the tracker on the previous iteration or on the new one, whichever
  it names loads and verifies, the previous one stays intact, and the next save cleans up the leftovers.
The number of kill points exercised is printed (pytest -s) and asserted to reach 200 in all.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import safetensors.torch
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from models import save_tiny_model  # noqa: E402

LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
EXERCISED = {}


@pytest.fixture(scope="module")
def sources(tmp_path_factory, trestle):
    root = tmp_path_factory.mktemp("crash")
    save_tiny_model(root / "hf", "LlamaConfig", LLAMA, seed=5)
    trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "t22", "--tp", 2, "--pp", 2, "-q")
    return root


def run_killed(trestle_bin, args, kill_at=None, trace=None, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    env.pop("TRESTLE_TEST_KILL_POINT", None)
    env.pop("TRESTLE_TEST_KILL_TRACE", None)
    if kill_at is not None:
        env["TRESTLE_TEST_KILL_POINT"] = str(kill_at)
    if trace is not None:
        env["TRESTLE_TEST_KILL_TRACE"] = str(trace)
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)


def kill_points(trestle_bin, args, tmp_path, cleanup):
    trace = tmp_path / "trace.txt"
    result = run_killed(trestle_bin, args, trace=trace)
    assert result.returncode == 0, result.stderr
    points = trace.read_text().splitlines()
    cleanup()
    return points


def leftovers(parent, name):
    return sorted(p.name for p in pathlib.Path(parent).iterdir() if p.name.startswith(f".{name}.partial."))


def same_tensors(a_dir, b_dir):
    def load(d):
        out = {}
        for f in sorted(pathlib.Path(d).glob("*.safetensors")):
            out.update(safetensors.torch.load_file(f))
        return out
    a, b = load(a_dir), load(b_dir)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


CONVERSIONS = {
    # name: (arguments after the trestle binary with DST for the destination, how a complete output is checked)
    "hf_to_trestle": (["convert", "--from", "hf", "{hf}", "--to", "trestle", "DST", "--tp", "2", "--pp", "2",
                       "--codec", "zstd", "-q"], "verify"),
    "hf_to_megatron_dist": (["convert", "--from", "hf", "{hf}", "--to", "megatron-dist", "DST", "--tp", "2", "-q"],
                            "verify"),
    "trestle_to_hf": (["convert", "--from", "trestle", "{t22}", "--to", "hf", "DST", "-q"], "hf"),
    "reshard": (["reshard", "{t22}", "DST", "--tp", "1", "--pp", "1", "--dp", "2", "-q"], "verify"),
    "hf_to_hf_shards": (["convert", "--from", "hf", "{hf}", "--to", "hf", "DST", "--max-shard-size", "40KB", "-q"],
                        "hf"),
}


def conversion_args(trestle_bin, case, sources, dst):
    return [trestle_bin] + [a.replace("{hf}", str(sources / "hf")).replace("{t22}", str(sources / "t22"))
                            .replace("DST", str(dst)) for a in CONVERSIONS[case][0]]


def check_complete(trestle_bin, case, sources, dst):
    """The conversion's output is whole: every tensor equals the Hugging Face source's."""
    if CONVERSIONS[case][1] == "verify":
        result = subprocess.run([trestle_bin, "verify", dst, "--against", sources / "hf"], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    else:
        assert same_tensors(dst, sources / "hf")
        assert json.loads((dst / "config.json").read_text())["num_hidden_layers"] == 4


@pytest.mark.parametrize("case", list(CONVERSIONS))
def test_killed_conversion_leaves_nothing_torn(sources, trestle_bin, tmp_path, case):
    dst = tmp_path / "out"
    args = conversion_args(trestle_bin, case, sources, dst)

    def check_complete_output():
        check_complete(trestle_bin, case, sources, dst)

    points = kill_points(trestle_bin, args, tmp_path, lambda: shutil.rmtree(dst))
    assert len(points) >= 10, points
    for n in range(1, len(points) + 1):
        killed = run_killed(trestle_bin, args, kill_at=n)
        assert killed.returncode == -9, f"point {n} ({points[n - 1]}): {killed.returncode} {killed.stderr}"
        if dst.exists():  # the rename into place happened before the kill: it must be whole
            check_complete_output()
            # and its writer's lock went with the staging's name: nothing is left that only a rerun into the same
            # (now full) destination would clear
            assert not list(tmp_path.glob(".out.partial.*")), f"a lock file beside the output after {points[n - 1]}"
            shutil.rmtree(dst)
        again = run_killed(trestle_bin, args)
        assert again.returncode == 0, f"after a kill at {points[n - 1]}: {again.stderr}"
        check_complete_output()
        assert leftovers(tmp_path, "out") == [], f"after a kill at {points[n - 1]}"
        assert not list(tmp_path.glob(".out.partial.*")), f"lock files left after a kill at {points[n - 1]}"
        shutil.rmtree(dst)
    EXERCISED[case] = len(points)


def test_second_writer_of_a_destination_is_refused(sources, trestle, tmp_path):
    """A conversion into a destination another live process is writing fails naming it, and touches nothing."""
    import fcntl
    staging = tmp_path / ".out.partial.99999"
    staging.mkdir()
    (staging / "marker").write_text("live")
    with open(tmp_path / ".out.partial.99999.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = trestle.run_raw("convert", "--from", "hf", sources / "hf", "--to", "trestle", tmp_path / "out", "-q")
        assert result.returncode == 1
        assert "another process is writing" in result.stderr and ".out.partial.99999" in result.stderr, result.stderr
        assert (staging / "marker").read_text() == "live" and not (tmp_path / "out").exists()
    # Once its writer is gone (the lock is free), the next conversion removes the abandoned staging and succeeds.
    trestle.run("convert", "--from", "hf", sources / "hf", "--to", "trestle", tmp_path / "out", "-q")
    assert not staging.exists() and not (tmp_path / ".out.partial.99999.lock").exists()


def test_conversion_refuses_a_symlinked_destination(sources, trestle, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    result = trestle.run_raw("convert", "--from", "hf", sources / "hf", "--to", "trestle", tmp_path / "link", "-q")
    assert result.returncode == 1 and "symbolic link" in result.stderr, result.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []


SAVER_SERVER = """
import json, os, sys, traceback
import torch
sys.path.insert(0, sys.argv[1])
import trestle


def save(root, iteration, seed):
    torch.manual_seed(seed)
    state = {f"layer{i}.weight": torch.randn(64, 48) for i in range(6)}
    trestle.save(state, root, iteration=iteration, overwrite=True)


if len(sys.argv) > 2:  # one save: ROOT ITERATION SEED
    save(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    sys.exit(0)
for line in sys.stdin:  # one save per line, each in a forked child: a kill ends the child, not the server
    root, iteration, seed, env, stderr = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            out = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)  # stdout carries the server's answers: the child's output goes with its stderr
            os.dup2(out, 2)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            os.environ.update(env)
            save(root, iteration, seed)
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    print(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status), flush=True)
"""


class PythonSaver:
    """trestle.save of six random tensors (overwrite allowed) through the built Python package, each save in a child
    forked from one server process that imported torch and trestle once (a process per save spent seconds importing
    them). The fault variables (kill point, trace, env_extra) reach only the child, which reads them at its first
    fault point; its stderr comes back in the result."""

    def __init__(self, trestle_bin, tmp_path, root):
        python_path = os.environ.get("TRESTLE_PYTHON_PATH")
        if not python_path:
            pytest.fail("set TRESTLE_PYTHON_PATH to <build>/python (ctest does this)")
        self.script = tmp_path / "saver.py"
        self.script.write_text(SAVER_SERVER)
        self.python_path, self.root, self.server = python_path, root, None
        self.stderr = tmp_path / "save.stderr"

    def command(self, iteration, seed):
        """A command line that runs one save on its own (no server)."""
        return [sys.executable, str(self.script), self.python_path, str(self.root), str(iteration), str(seed)]

    def __call__(self, iteration, seed, kill_at=None, trace=None, env_extra=None):
        if self.server is None:
            env = {k: v for k, v in os.environ.items() if not k.startswith("TRESTLE_TEST_")}
            self.server = subprocess.Popen([sys.executable, str(self.script), self.python_path],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        env = dict(env_extra or {})
        if kill_at is not None:
            env["TRESTLE_TEST_KILL_POINT"] = str(kill_at)
        if trace is not None:
            env["TRESTLE_TEST_KILL_TRACE"] = str(trace)
        self.server.stdin.write(json.dumps([str(self.root), iteration, seed, env, str(self.stderr)]) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        assert line, f"the save server died (exit code {self.server.poll()})"
        return subprocess.CompletedProcess([], int(line), "", self.stderr.read_text())

    def close(self):
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()
            self.server.wait(timeout=60)

    def __del__(self):
        self.close()


def verified(trestle_bin, root, iteration):
    result = subprocess.run([trestle_bin, "verify", root, "--iteration", str(iteration)], capture_output=True,
                            text=True, timeout=60)
    return result.returncode == 0


def test_killed_save_keeps_the_previous_checkpoint(trestle_bin, tmp_path):
    """Python's trestle.save into a root that holds iteration 1: a new iteration 2, then an overwrite of 2 (the
    swap path). Whatever the kill, the tracker names a complete iteration that verifies and iteration 1 survives."""
    root = tmp_path / "root"
    save = PythonSaver(trestle_bin, tmp_path, root)
    try:
        assert save(1, 1).returncode == 0
        total = 0
        for iteration, seed in [(2, 2), (2, 3)]:  # a new iteration; then replacing it
            trace = tmp_path / f"trace{iteration}{seed}.txt"
            before = root.with_name("before")
            shutil.copytree(root, before)
            assert save(iteration, seed, trace=trace).returncode == 0
            points = trace.read_text().splitlines()
            assert len(points) >= 5 and "committed" in points, points
            for n in range(1, len(points) + 1):
                shutil.rmtree(root)
                shutil.copytree(before, root)
                previous = (root / "latest_checkpointed_iteration.txt").read_text().strip()
                killed = save(iteration, seed, kill_at=n)
                assert killed.returncode == -9, f"point {n} ({points[n - 1]}): {killed.returncode} {killed.stderr}"
                tracked = (root / "latest_checkpointed_iteration.txt").read_text().strip()
                assert tracked in (previous, str(iteration)), (points[n - 1], tracked)
                assert verified(trestle_bin, root, int(tracked)), f"tracked iteration broken after {points[n - 1]}"
                assert verified(trestle_bin, root, 1), f"iteration 1 lost after a kill at {points[n - 1]}"
                if (root / "iter_0000002" / "manifest.json").exists():
                    assert verified(trestle_bin, root, 2), f"iteration 2 torn after a kill at {points[n - 1]}"
                assert save(iteration, seed).returncode == 0
                assert [p.name for p in root.iterdir() if p.name.startswith(".")] == [], points[n - 1]
                assert verified(trestle_bin, root, iteration)
            total += len(points)
            shutil.rmtree(before)
    finally:
        save.close()
    EXERCISED["python_save"] = total


CORPUS = pathlib.Path(__file__).resolve().parents[2] / "train" / "data" / "corpus"


def test_killed_multi_process_training_save_keeps_the_previous_checkpoint(sources, trestle, trestle_bin, tmp_path):
    """`trestle train` at tp 2 (two worker processes) resumes from iteration 2 and saves iteration 4 into the same
    root; every worker kills itself at its Nth kill point. The tracker then names iteration 2 or 4, which verifies,
    iteration 2 survives, and the next run's save leaves nothing behind."""
    data = tmp_path / "data"
    data.mkdir()
    trestle.run("preprocess", "--input", CORPUS / "kjv.jsonl", "--output-prefix", data / "kjv", "--tokenizer-type",
                "HuggingFaceTokenizer", "--tokenizer-model", CORPUS / "tokenizer.json", "--append-eod", "--quiet")
    hf = tmp_path / "hf4096"
    save_tiny_model(hf, "LlamaConfig", dict(LLAMA, vocab_size=4096, num_hidden_layers=2), seed=5)
    root = tmp_path / "root"

    def train(iterations, load, **kw):
        return run_killed(trestle_bin, [trestle_bin, "train", "--nproc-per-node", "2", "--tensor-model-parallel-size",
                                        "2", "--data-path", data / "kjv_text_document", "--micro-batch-size", "2",
                                        "--global-batch-size", "2", "--seq-length", "16", "--split", "98,2,0", "--train-iters",
                                        str(iterations), "--lr", "1e-3", "--eval-iters", "0", "--save", root,
                                        "--save-interval", "2", "--load", load, "--log-interval", "100"], **kw)

    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "start", "-q")
    first = train(2, tmp_path / "start")
    assert first.returncode == 0, first.stderr
    before = tmp_path / "before"
    shutil.copytree(root, before)
    assert train(4, root, trace=tmp_path / "trace.%p").returncode == 0
    traces = [t.read_text().splitlines() for t in tmp_path.glob("trace.*")]
    assert len(traces) == 2, "one trace per worker"
    count = max(len(t) for t in traces)
    assert count >= 5 and any("committed" in t for t in traces), traces
    for n in range(1, count + 1):
        shutil.rmtree(root)
        shutil.copytree(before, root)
        killed = train(4, root, kill_at=n)
        assert killed.returncode != 0, f"point {n}: the job survived"
        tracked = (root / "latest_checkpointed_iteration.txt").read_text().strip()
        assert tracked in ("2", "4"), (n, tracked)
        assert verified(trestle_bin, root, int(tracked)), f"tracked iteration broken after point {n}"
        assert verified(trestle_bin, root, 2), f"iteration 2 lost after point {n}"
        again = train(6, root)  # always saves (iteration 6), which is what cleans up
        assert again.returncode == 0, again.stderr[-3000:]
        assert [p.name for p in root.iterdir() if p.name.startswith(".")] == [], n
        assert verified(trestle_bin, root, 6)
    EXERCISED["train_save"] = sum(len(t) for t in traces)


def test_kill_points_reach_200():
    total = sum(EXERCISED.values())
    print(f"\nkill points exercised: {total} ({EXERCISED})")
    assert total >= 200, EXERCISED

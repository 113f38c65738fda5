"""Training under faults (`trestle train` with two worker processes):
- a save whose write, sync or commit fails (fault points, TRESTLE_TEST_FAIL_POINT): the job exits 1 with the error
  naming the file, the tracker still names the previous checkpoint, which verifies, and nothing of the failed one is
  loadable; with --no-exit-on-save-failure training goes on and the next save succeeds;
- a NaN in one rank's loss or gradients (--test-nan): every rank ends, naming the iteration, the rank and what held
  it (Megatron's --check-for-nan-in-loss-and-grad, on by default); off, the run goes on;
- SIGTERM (to the launcher, or to the whole process group as Slurm sends it; or twice in a row) with
  --exit-signal-handler: the step finishes, the checkpoint is saved and committed, the job exits 0, and a resumed run
  continues with the losses of an uninterrupted one; a SIGTERM while the model loads ends the job after its first step;
- the launcher killed (SIGKILL, SIGHUP): its workers die with it, and the same job starts again;
- an asynchronous save is committed as soon as every rank has written it: a SIGKILL before the next save keeps it;
- a rank that stops answering: the others end within the timeout, naming it;
- SIGKILL of the whole job at 50 random moments: every restart resumes from the tracked checkpoint with the losses
  of an uninterrupted run.
"""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ci_scope import FULL  # noqa: E402
from models import save_tiny_model  # noqa: E402
from test_crash_consistency import CORPUS, LLAMA, run_killed, verified  # noqa: E402

SAVE_LOCK = ".trestle_save.lock"
INJECTED = {"ENOSPC": "No space left on device (injected fault)", "EIO": "Input/output error (injected fault)"}


def tiny_training_setup(root, trestle, seed):
    """The bundled corpus preprocessed into root/data and a tiny two-layer Llama converted into root/start."""
    (root / "data").mkdir()
    trestle.run("preprocess", "--input", CORPUS / "kjv.jsonl", "--output-prefix", root / "data" / "kjv",
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", CORPUS / "tokenizer.json",
                "--append-eod", "--quiet")
    save_tiny_model(root / "hf", "LlamaConfig", dict(LLAMA, vocab_size=4096, num_hidden_layers=2), seed=seed)
    trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "start", "-q")
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    return tiny_training_setup(tmp_path_factory.mktemp("faults"), trestle, seed=5)


def train_args(trestle_bin, setup, save, iterations, *extra, load=None, layout=("--tensor-model-parallel-size", "2")):
    return [trestle_bin, "train", "--nproc-per-node", "2", *layout, "--data-path", setup / "data" / "kjv_text_document",
            "--split", "98,2,0", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "16",
            "--train-iters", str(iterations), "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1",
            "--save", save, "--save-interval", "2", "--load", load or setup / "start", *map(str, extra)]


def tracked(root):
    return int((root / "latest_checkpointed_iteration.txt").read_text())


def records(log):
    """The log's whole records: a running job may be inside a write, so the text after the last newline is left."""
    return [json.loads(line) for line in log.read_text().split("\n")[:-1]]


def losses(log):
    return {r["iteration"]: r["lm_loss"] for r in records(log) if "lm_loss" in r}


def assert_ran(result):
    assert result.returncode == 0, result.stderr[-3000:]


def assert_nothing_incomplete(trestle_bin, root, good):
    """Every iteration directory under `root` verifies, the tracked one is `good`, and no staging is left."""
    assert tracked(root) == good
    names = sorted(p.name for p in root.iterdir())
    assert not [n for n in names if n.startswith(".")], names
    for name in names:
        if name.startswith("iter_"):
            assert verified(trestle_bin, root, int(name[5:])), f"{name} is incomplete but loadable-looking"


def test_failed_save_ends_the_job_naming_the_file(setup, trestle_bin, tmp_path):
    """Iteration 2 saved; the save of iteration 4 fails at a write, a sync or the commit on one rank: the job exits 1,
    the error names the file and the OS reason, the tracker still names iteration 2 and nothing of 4 is left."""
    first = tmp_path / "first"
    assert_ran(run_killed(trestle_bin, train_args(trestle_bin, setup, first, 2)))
    trace = tmp_path / "trace.%p"
    assert_ran(run_killed(trestle_bin, train_args(trestle_bin, setup, tmp_path / "traced", 4, load=first), trace=trace))
    # Rank 0 creates the directories and commits; rank 1 writes its own file.
    traces = sorted((t.read_text().splitlines() for t in tmp_path.glob("trace.*")), key=len, reverse=True)
    assert len(traces) == 2 and "committed" in traces[0] and traces[1][0] == "write", traces
    # rank 0's first step, rank 1's sync of its data, rank 0's sync of a carried file, its commit and its update of
    # the tracker.
    cases = [(0, 1, "ENOSPC"), (1, traces[1].index("fdatasync") + 1, "EIO"), (0, traces[0].index("fsync") + 1, "EIO"),
             (0, traces[0].index("commit") + 1, "ENOSPC"), (0, traces[0].index("update tracker") + 1, "EIO")]
    for k, (rank, n, errno_name) in enumerate(cases):
        # The saves of iterations 4 and 6; the first fails, and its error comes at the first iteration after its
        # background write ended (or at the commit). Once, the run ends at 4, whose save is the last.
        last = k == len(cases) - 1
        root = tmp_path / f"root{rank}_{n}"
        assert_ran(run_killed(trestle_bin, train_args(trestle_bin, setup, root, 2)))
        result = run_killed(trestle_bin, train_args(trestle_bin, setup, root, 4 if last else 6, load=root),
                            env_extra={"TRESTLE_TEST_FAIL_POINT": str(n), "TRESTLE_TEST_FAIL_ERRNO": errno_name,
                                       "TRESTLE_TEST_FAULT_RANK": str(rank)})
        assert result.returncode == 1, (n, result.returncode, result.stderr[-3000:])
        for r in (0, 1):
            line = next((ln for ln in result.stderr.splitlines() if f"trestle train: rank {r}: " in ln), "")
            assert f"the checkpoint of iteration 4 in {root} was not saved: " in line, result.stderr[-3000:]
            assert INJECTED[errno_name] in line and "The tracker still names the last complete checkpoint" in line
            assert last or "(--exit-on-save-failure)" in line, line
        assert_nothing_incomplete(trestle_bin, root, 2)
        # Past the commit's rename (the tracker's update failed) iteration 4 is whole (it verified above) but untracked.
        renamed = rank == 0 and n > traces[0].index("commit") + 2
        kept = sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))
        assert kept == ["iter_0000002"] + (["iter_0000004"] if renamed else []), (n, kept)


def test_failed_save_without_exit_trains_on_and_saves_at_the_next_interval(setup, trestle_bin, tmp_path):
    """--no-exit-on-save-failure: the save of iteration 2, the run's first, fails at its first write; the job warns
    (saying that no checkpoint has been committed yet), trains on with the losses of an undisturbed run, saves
    iterations 4 and 6 and exits 0."""
    plain = tmp_path / "plain"
    result = run_killed(trestle_bin, train_args(trestle_bin, setup, plain, 6, "--log-json", tmp_path / "plain.jsonl"))
    assert result.returncode == 0, result.stderr[-3000:]
    root = tmp_path / "root"
    result = run_killed(trestle_bin, train_args(trestle_bin, setup, root, 6, "--no-exit-on-save-failure", "--log-json",
                                                tmp_path / "log.jsonl"),
                        env_extra={"TRESTLE_TEST_FAIL_POINT": "1", "TRESTLE_TEST_FAIL_ERRNO": "ENOSPC",
                                   "TRESTLE_TEST_FAULT_RANK": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING: the checkpoint of iteration 2" in result.stderr and INJECTED["ENOSPC"] in result.stderr
    assert "training goes on" in result.stderr, result.stderr[-3000:]
    # The first save of the run: there is no tracker to name.
    assert ". No checkpoint has been committed yet; training goes on" in result.stderr, result.stderr[-3000:]
    assert "tracker still names" not in result.stderr, result.stderr[-3000:]
    assert losses(tmp_path / "log.jsonl") == losses(tmp_path / "plain.jsonl")
    assert_nothing_incomplete(trestle_bin, root, 6)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("iter_")) == ["iter_0000004", "iter_0000006"]


@pytest.mark.parametrize("where,layout,rank", [("loss", ("--use-distributed-optimizer",), 1),
                                               ("grad", ("--tensor-model-parallel-size", "2"), 0)])
def test_nan_ends_every_rank_naming_iteration_and_rank(setup, trestle_bin, tmp_path, where, layout, rank):
    """A NaN in rank 1's loss (dp 2) or rank 0's gradients (tp 2) at iteration 3: the job exits 1, each rank's error
    names the iteration, the rank and what held the NaN; the tracker names iteration 2. With
    --no-check-for-nan-in-loss-and-grad the same run goes on to its end."""
    root = tmp_path / "root"
    args = train_args(trestle_bin, setup, root, 4, "--test-nan", f"{rank}:3:{where}", layout=layout)
    result = run_killed(trestle_bin, args)
    assert result.returncode == 1, result.stderr[-3000:]
    what = "the local forward loss" if where == "loss" else "the local gradients before the data-parallel reduction"
    for r in (0, 1):
        line = next((ln for ln in result.stderr.splitlines() if f"trestle train: rank {r}: iteration 3:" in ln), None)
        assert line is not None, result.stderr[-3000:]
        assert f"found NaN or Inf in rank {rank}: {what}" in line, line
    assert "(bucket 0)" in result.stderr, result.stderr[-3000:]  # the rank that found it names its bucket
    assert_nothing_incomplete(trestle_bin, root, 2)
    unchecked = run_killed(trestle_bin, train_args(trestle_bin, setup, tmp_path / "unchecked", 4, "--test-nan",
                                                   f"{rank}:3:{where}", "--no-check-for-nan-in-loss-and-grad",
                                                   layout=layout))
    assert unchecked.returncode == 0, unchecked.stderr[-3000:]


def test_a_second_job_saving_into_the_same_root_is_refused(setup, trestle_bin, tmp_path):
    """Two jobs saving into one --save root (a requeued job while the first still runs) interleaved their checkpoints
    and moved the tracker back and forth. The first holds the root's lock (here: a process holding it as the trainer
    does); the second ends at once naming the holder, and writes nothing; once the holder is gone, training runs."""
    import fcntl
    root = tmp_path / "ckpt"
    root.mkdir()
    with open(root / SAVE_LOCK, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("host elsewhere, pid 4242\n")
        held.flush()
        result = subprocess.run(train_args(trestle_bin, setup, root, 2), capture_output=True, text=True, timeout=300)
        assert result.returncode == 1, result.stderr[-3000:]
        assert f"{root}: another job is saving checkpoints here (host elsewhere, pid 4242, holding {root / SAVE_LOCK})" \
            in result.stderr, result.stderr[-3000:]
        assert sorted(p.name for p in root.iterdir()) == [SAVE_LOCK]
    # The holder gone without removing its lock file (killed): the file is taken over, and removed at the end.
    assert_ran(subprocess.run(train_args(trestle_bin, setup, root, 2), capture_output=True, text=True, timeout=300))
    assert_nothing_incomplete(trestle_bin, root, 2)


def test_converted_torch_dist_loads_of_dead_jobs_are_removed(setup, trestle_bin, tmp_path):
    """A job killed while it trains from a torch_dist --load leaves the node's converted copy in $TMPDIR; the launcher
    removes it when its workers end, and so does the next job, but only copies whose job no longer holds their lock."""
    import fcntl
    tmp = tmp_path / "tmp"
    for name in ("trestle_load_127.0.0.1_1111_node0", "trestle_load_127.0.0.1_2222_node0"):
        (tmp / name / "iter_0000000").mkdir(parents=True)
        (tmp / f"{name}.lock").write_text("")
    with open(tmp / "trestle_load_127.0.0.1_2222_node0.lock", "w") as live:
        fcntl.flock(live, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a job still running
        result = subprocess.run(train_args(trestle_bin, setup, tmp_path / "ckpt", 2), capture_output=True, text=True,
                                timeout=300, env=dict(os.environ, TMPDIR=str(tmp)))
        assert_ran(result)
        assert sorted(p.name for p in tmp.iterdir()) == ["trestle_load_127.0.0.1_2222_node0",
                                                         "trestle_load_127.0.0.1_2222_node0.lock"]


def test_a_rank_that_stops_answering_is_named_within_the_timeout(setup, trestle_bin, tmp_path):
    """tp 2 x dp 2: rank 1 stops answering at iteration 3. Within --distributed-timeout-seconds (plus the ranks'
    exchange of who saw the failure) the job ends with exit 1, and the error names the iteration, the collective, its
    group and rank 1 as the one that stopped."""
    args = train_args(trestle_bin, setup, tmp_path / "root", 6, "--distributed-timeout-seconds", 10, "--test-hang", "1:3",
                      layout=("--tensor-model-parallel-size", "2"))
    args[args.index("--nproc-per-node") + 1] = "4"
    args[args.index("--global-batch-size") + 1] = "8"
    start = time.monotonic()
    result = run_killed(trestle_bin, args)
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-3000:]
    assert elapsed < 90, f"the job took {elapsed:.0f} s to end"
    named = [ln for ln in result.stderr.splitlines() if "trestle train: rank " in ln and ": iteration 3: " in ln]
    assert named, result.stderr[-3000:]
    for line in named:
        # the collective and its group: one in the model (tensor parallel) or the data-parallel gradient reduction
        assert "failed (a peer died or hung)" in line, line
        assert "all-reduce in the model's group of 2 ranks" in line or "group of ranks [" in line, line
        assert line.endswith("rank(s) 1 stopped answering or died (every other rank saw the failure)"), line


def run_until_signalled(trestle_bin, args, log, kill, min_logged=3):
    """Starts the job in its own process group, waits until `log` holds min_logged iterations, signals it with
    `kill(process)` and returns (exit code, stdout, stderr)."""
    process = subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (log.exists() and len(records(log)) >= min_logged):
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job logged nothing for 240 s"
            time.sleep(0.02)
        kill(process)
        stdout, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, stdout, stderr


@pytest.mark.parametrize("target", ["launcher", "process-group"])
def test_sigterm_saves_commits_and_exits_0(setup, trestle_bin, tmp_path, target):
    """--exit-signal-handler: SIGTERM to the launcher (which passes it on) or to every process (Slurm's preemption
    signal): the job finishes its step, saves that iteration, commits and exits 0; resumed, it logs the losses of an
    uninterrupted run."""
    root, log = tmp_path / "root", tmp_path / "log.jsonl"
    args = train_args(trestle_bin, setup, root, 1000, "--exit-signal-handler", "--save-interval", 1000, "--log-json",
                      log)
    kill = (lambda p: os.kill(p.pid, signal.SIGTERM)) if target == "launcher" else \
        (lambda p: os.killpg(p.pid, signal.SIGTERM))
    code, stdout, stderr = run_until_signalled(trestle_bin, args, log, kill)
    assert code == 0, stderr[-3000:]
    stopped = max(losses(log))
    assert f"exiting at iteration {stopped} after receiving a termination signal" in stdout, stdout[-2000:]
    assert f"committed checkpoint of iteration {stopped}" in stdout, stdout[-2000:]
    assert_nothing_incomplete(trestle_bin, root, stopped)
    # The same 1000-iteration schedule and data, stopped by --exit-interval two iterations on.
    resumed = run_killed(trestle_bin, train_args(trestle_bin, setup, root, 1000, "--exit-interval", stopped + 2,
                                                 "--log-json", tmp_path / "resumed.jsonl", load=root))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = run_killed(trestle_bin, train_args(trestle_bin, setup, tmp_path / "whole", 1000, "--exit-interval",
                                               stopped + 2, "--log-json", tmp_path / "whole.jsonl"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = losses(tmp_path / "whole.jsonl")
    assert losses(log) == {i: expected[i] for i in range(1, stopped + 1)}
    assert losses(tmp_path / "resumed.jsonl") == {i: expected[i] for i in (stopped + 1, stopped + 2)}


def children(pid):
    """The pids whose parent is `pid` (from /proc)."""
    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid):
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_before_the_model_is_built_saves_after_the_first_step(setup, trestle_bin, tmp_path):
    """--exit-signal-handler is in place before the model is built and loaded (minutes for a large one), as Megatron's
    is at initialisation: a SIGTERM then ends the job after its first step, saved and committed, exit 0 (it used to
    kill the workers, the job failing with 143 and nothing saved). Both workers are held right after installing it
    (TRESTLE_TEST_HOLD_AT) while the job's process group is signalled, so that no step can have run; signalling when
    the "loaded" line came by raced the first steps on a busy machine."""
    root, go = tmp_path / "root", tmp_path / "go"
    args = train_args(trestle_bin, setup, root, 1000, "--exit-signal-handler", "--save-interval", 1000)
    held = dict(os.environ, TRESTLE_TEST_HOLD_AT="signal handler installed", TRESTLE_TEST_HOLD_FILE=str(go),
                TRESTLE_TEST_KILL_TRACE=str(tmp_path / "trace.%p"))
    process = subprocess.Popen([str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env=held)
    try:
        deadline = time.monotonic() + 120
        while sum(t.read_text() == "hold signal handler installed\n" for t in tmp_path.glob("trace.*")) < 2:
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the workers were not held in 120 s"
            time.sleep(0.02)
        os.killpg(process.pid, signal.SIGTERM)
        go.touch()
        stdout, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, stderr[-3000:]
    assert "exiting at iteration 1 after receiving a termination signal" in stdout, stdout[-2000:]
    # Rank 0's lines reach the launcher as they are printed (its stdout, a pipe, is line-buffered): its bucket line,
    # printed as the model is built, came after the last rank's iterations, at its exit.
    assert stdout.index("[rank 0]  Number of buckets") < stdout.index("iteration        1/"), stdout[-2000:]
    assert_nothing_incomplete(trestle_bin, root, 1)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_workers_die_with_their_launcher(setup, trestle_bin, tmp_path, sig):
    """The launcher ended by a signal it cannot pass on (SIGKILL, or SIGHUP, which it does not handle): its workers
    die with it instead of training on as orphans holding the save lock; the same job then starts again."""
    root, log = tmp_path / "root", tmp_path / "log.jsonl"
    args = train_args(trestle_bin, setup, root, 1000, "--save-interval", 1000, "--log-json", log)
    process = subprocess.Popen([str(a) for a in args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (log.exists() and log.read_text().count("\n") >= 2):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        workers = children(process.pid)
        assert len(workers) == 2, workers
        os.kill(process.pid, sig)
        process.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(w) for w in workers), "workers trained on after their launcher died"
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    again = run_killed(trestle_bin, train_args(trestle_bin, setup, root, 2))
    assert again.returncode == 0, again.stderr[-3000:]


def test_the_exit_signal_chosen_saves_commits_and_exits_0(setup, trestle_bin, tmp_path):
    """--exit-signal SIGUSR1 (Megatron's, for sbatch --signal=USR1@120): SIGUSR1 to every process of the job does what
    SIGTERM does with --exit-signal-handler (the launcher passes it on and waits; the workers finish the step, save,
    commit and exit 0). A name that is not a signal a job can be stopped with is refused."""
    root, log = tmp_path / "root", tmp_path / "log.jsonl"
    args = train_args(trestle_bin, setup, root, 1000, "--exit-signal-handler", "--exit-signal", "SIGUSR1",
                      "--save-interval", 1000, "--log-json", log)
    code, stdout, stderr = run_until_signalled(trestle_bin, args, log, lambda p: os.killpg(p.pid, signal.SIGUSR1))
    assert code == 0, stderr[-3000:]
    stopped = max(losses(log))
    assert f"exiting at iteration {stopped} after receiving a termination signal" in stdout, stdout[-2000:]
    assert f"committed checkpoint of iteration {stopped}" in stdout, stdout[-2000:]
    assert_nothing_incomplete(trestle_bin, root, stopped)
    refused = run_killed(trestle_bin, train_args(trestle_bin, setup, root, 4, "--exit-signal-handler", "--exit-signal",
                                                 "SIGKILL"))
    assert refused.returncode == 2 and "--exit-signal SIGKILL: not one of SIGTERM" in refused.stderr, \
        refused.stderr[-2000:]


def test_two_sigterms_close_together_are_one_request_and_the_job_exits_0(setup, trestle_bin, tmp_path):
    """--exit-signal-handler: SIGTERM to the launcher and, 0.1 s later, to the whole process group (a scheduler's kill
    plus `timeout` passing on its own copy): the launcher takes the second as the same request, the workers finish the
    step, save and commit, and the job exits 0 without a FAILED line."""
    root, log = tmp_path / "root", tmp_path / "log.jsonl"
    args = train_args(trestle_bin, setup, root, 1000, "--exit-signal-handler", "--save-interval", 1000, "--log-json",
                      log)

    def twice(process):
        os.kill(process.pid, signal.SIGTERM)
        time.sleep(0.1)
        os.killpg(process.pid, signal.SIGTERM)

    code, stdout, stderr = run_until_signalled(trestle_bin, args, log, twice)
    assert code == 0, stderr[-3000:]
    assert "again right after the first: the same request" in stderr and "FAILED" not in stderr, stderr[-3000:]
    stopped = max(losses(log))
    assert f"committed checkpoint of iteration {stopped}" in stdout, stdout[-2000:]
    assert_nothing_incomplete(trestle_bin, root, stopped)


def test_sigterm_without_the_handler_stops_the_job_and_keeps_the_last_checkpoint(setup, trestle_bin, tmp_path):
    """Without --exit-signal-handler, SIGTERM to the launcher stops the workers: exit 143, and the tracker still names
    the last committed save."""
    root, log = tmp_path / "root", tmp_path / "log.jsonl"
    args = train_args(trestle_bin, setup, root, 1000, "--log-json", log)
    code, _, stderr = run_until_signalled(trestle_bin, args, log, lambda p: os.kill(p.pid, signal.SIGTERM),
                                          min_logged=5)
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "the launcher received signal 15" in stderr, stderr[-3000:]
    assert tracked(root) >= 2 and tracked(root) % 2 == 0
    assert verified(trestle_bin, root, tracked(root))


def test_a_written_save_is_committed_before_the_next_one_begins(setup, trestle_bin, tmp_path):
    """The save of iteration 120 (two workers, --save-interval 120) is committed at the first iteration after both
    ranks' background writes end, as Megatron-LM's non-blocking finalize does, not when the save of 240 begins: a
    SIGKILL of the whole job a few iterations later keeps it tracked; it verifies and resumes with the losses the
    killed run logged. (The interval leaves the background writes 119 iterations: at 40, a CI run whose disk was busy
    with the tests beside it did not commit by iteration 79, while alone it commits about 11 iterations after.)"""
    interval, root, log, out = 120, tmp_path / "root", tmp_path / "log.jsonl", tmp_path / "out.txt"
    args = train_args(trestle_bin, setup, root, 1000, "--save-interval", interval, "--log-json", log)
    committed = f"committed checkpoint of iteration {interval} in {root}"
    with open(out, "w") as stdout:
        process = subprocess.Popen([str(a) for a in args], stdout=stdout, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
    try:
        deadline, seen_at = time.monotonic() + 240, None
        while True:
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the job logged nothing for 240 s"
            logged = max(losses(log), default=0) if log.exists() else 0
            if seen_at is None and committed in out.read_text():
                seen_at = logged
            # Two more iterations after the commit; without it, the last iteration before the next save.
            if (seen_at is not None and logged >= seen_at + 2) or logged >= 2 * interval - 1:
                break
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert seen_at is not None and seen_at < 2 * interval - 1, f"not committed by iteration {logged}"
    assert (root / "latest_checkpointed_iteration.txt").exists(), sorted(p.name for p in root.iterdir())
    assert tracked(root) == interval and verified(trestle_bin, root, interval)
    killed = losses(log)
    resumed = run_killed(trestle_bin, train_args(trestle_bin, setup, root, 1000, "--exit-interval", interval + 2,
                                                 "--log-json", tmp_path / "resumed.jsonl", load=root))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(tmp_path / "resumed.jsonl") == {i: killed[i] for i in (interval + 1, interval + 2)}


KILLS = 50 if FULL else 30  # CI's share of the long run's kills


def staging(root):
    """Staging directories and their locks (not the job's lock on the root, which a killed job leaves behind)."""
    if not root.exists():
        return set()
    return {p.name for p in root.iterdir() if p.name.startswith(".") and p.name != SAVE_LOCK}


def test_jobs_killed_at_random_points_resume_with_the_uninterrupted_losses(setup, trestle_bin, tmp_path):
    """A two-worker job (saving every 3 iterations, asynchronously) is SIGKILLed, launcher and workers together as a
    scheduler kills a process group, at 50 random moments (30 in CI) after it has logged a new iteration: in steps
    before any save, with a save writing in the background, and in commits. After every kill the tracker names a
    checkpoint that verifies; the restarted job resumes right after it, and every iteration any attempt logs has the
    uninterrupted run's loss exactly. A job that reaches its end starts over in a fresh directory."""
    import random
    iterations = 30
    reference = tmp_path / "reference.jsonl"
    whole = run_killed(trestle_bin, train_args(trestle_bin, setup, tmp_path / "whole", iterations, "--save-interval", 3,
                                               "--log-json", reference))
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = losses(reference)
    assert sorted(expected) == list(range(1, iterations + 1))
    rng = random.Random(36)
    kills, attempt, landed, completed = 0, 0, {"step": 0, "save": 0}, 0
    root = tmp_path / "run0"
    while kills < KILLS or root.exists():
        attempt += 1
        log = tmp_path / f"attempt{attempt}.jsonl"
        start = tracked(root) if (root / "latest_checkpointed_iteration.txt").exists() else 0
        if start == iterations:  # killed after its last save committed: complete
            assert verified(trestle_bin, root, iterations)
            completed += 1
            root = tmp_path / f"run{completed}"
            start = 0
        staged_before = staging(root)
        args = train_args(trestle_bin, setup, root, iterations, "--save-interval", 3, "--log-json", log,
                          load=root if start else None)
        if kills >= KILLS:  # the last attempt runs to the end
            result = run_killed(trestle_bin, args)
            assert result.returncode == 0, result.stderr[-3000:]
            code = 0
        else:
            # Every fifth kill comes as the first iteration is logged, before the attempt's first save.
            delay = 0.0 if kills % 5 == 0 else rng.uniform(0.0, 0.5)

            def kill(process):
                time.sleep(delay)
                os.killpg(process.pid, signal.SIGKILL)

            code, _, stderr = run_until_signalled(trestle_bin, args, log, kill, min_logged=1)
        logged = losses(log) if log.exists() else {}
        assert logged and min(logged) == start + 1, (attempt, start, sorted(logged))
        bad = {i: (v, expected[i]) for i, v in logged.items() if v != expected[i]}
        assert not bad, f"attempt {attempt} (resumed at {start}): losses differ from the uninterrupted run's: {bad}"
        if code == 0:  # it reached its end before the kill: start over
            assert tracked(root) == iterations and verified(trestle_bin, root, iterations)
            completed += 1
            root = tmp_path / f"run{completed}"
            if kills >= KILLS:
                break
            continue
        assert code == -signal.SIGKILL, (attempt, code, stderr[-2000:])
        kills += 1
        # A save this attempt began and did not commit (each is written in the background and committed at the first
        # iteration after every rank's write ended) leaves its staging directory; the next save removes it.
        landed["save" if staging(root) - staged_before else "step"] += 1
        if (root / "latest_checkpointed_iteration.txt").exists():
            assert verified(trestle_bin, root, tracked(root)), f"after kill {kills} the tracked checkpoint is broken"
    print(f"\n{kills} kills over {attempt} attempts ({landed['save']} with a save of theirs in flight or committing, "
          f"{landed['step']} before their first save), {completed} runs completed")
    assert landed["save"] >= KILLS // 5 and landed["step"] >= KILLS // 10, landed



def test_a_first_save_killed_before_its_tracker_resumes_from_the_commit(setup, trestle_bin, tmp_path):
    """Megatron's idiom (--load and --save one directory, --model-config to start there): the job's first save is
    SIGKILLed (rank 0, in its commit) after iter_2 was renamed into place and before the tracker was written. The
    restart (torchrun --max-restarts, a requeued Slurm job) loads that complete iteration, saying so, and continues with
    the uninterrupted run's losses; it failed on the missing tracker at every restart before."""
    root = tmp_path / "run"
    reference = tmp_path / "reference.jsonl"
    config = setup / "hf" / "config.json"
    assert_ran(subprocess.run(train_args(trestle_bin, setup, tmp_path / "whole", 4, "--model-config", config,
                                         "--log-json", reference, load=tmp_path / "whole"),
                              capture_output=True, text=True, timeout=300))
    args = train_args(trestle_bin, setup, root, 4, "--model-config", config, load=root)
    faults = dict(os.environ, TRESTLE_TEST_FAULT_RANK="0")
    assert_ran(subprocess.run(args, capture_output=True, text=True, timeout=300,
                              env=dict(faults, TRESTLE_TEST_KILL_TRACE=str(tmp_path / "trace.%p"))))
    points = [t.read_text().splitlines() for t in tmp_path.glob("trace.*")]
    rank0 = next(p for p in points if "update tracker" in p)
    shutil.rmtree(root)
    killed = subprocess.run(args, capture_output=True, text=True, timeout=300,
                            env=dict(faults, TRESTLE_TEST_KILL_POINT=str(rank0.index("update tracker") + 1)))
    assert killed.returncode != 0
    assert (root / "iter_0000002").is_dir() and not (root / "latest_checkpointed_iteration.txt").exists()
    assert verified(trestle_bin, root, 2)
    log = tmp_path / "restart.jsonl"
    restart = subprocess.run(args + ["--log-json", log], capture_output=True, text=True, timeout=300)
    assert_ran(restart)
    assert "has no latest_checkpointed_iteration.txt but committed iter_0000002" in restart.stdout, restart.stdout
    assert losses(log) == {i: v for i, v in losses(reference).items() if i > 2}
    assert tracked(root) == 4


def test_a_save_past_the_file_size_limit_fails_naming_the_file(setup, trestle_bin, tmp_path):
    """`ulimit -f` (RLIMIT_FSIZE) below a checkpoint file's size: the write fails with EFBIG, which ends the job through
    the save-failure path (exit 1, the file named, nothing of the save left) as a full disk does; SIGXFSZ, whose
    default action killed the rank ("exited with signal 25") and left the staging behind, is ignored as Python's
    workers (and so Megatron's) ignore it."""
    import resource
    root = tmp_path / "root"
    assert_ran(run_killed(trestle_bin, train_args(trestle_bin, setup, root, 2)))
    biggest = max(p.stat().st_size for p in (root / "iter_0000002").iterdir())
    bound = biggest // 2 // 4096 * 4096  # (block-aligned: a short O_DIRECT write ends there, and the rest gets EFBIG)

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (bound, bound))

    result = subprocess.run(train_args(trestle_bin, setup, root, 4, load=root), capture_output=True, text=True,
                            timeout=300, preexec_fn=limit)
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    assert "signal" not in result.stderr, result.stderr[-3000:]
    assert f"the checkpoint of iteration 4 in {root} was not saved: " in result.stderr, result.stderr[-3000:]
    assert "File too large" in result.stderr and str(root) in result.stderr, result.stderr[-3000:]
    assert_nothing_incomplete(trestle_bin, root, 2)

"""Multi-node training on the launchers clusters have, run on one machine as two nodes of two workers each
(tp 2 x dp 2, a tiny Llama), against `trestle train --nproc-per-node 4` with the same flags:
- torchrun: two agents joined by its c10d rendezvous start `trestle-train train` (--no-python) with torchrun's
  variables; the agent serves the job's store, so no worker may start one;
- Slurm: four processes with the variables srun sets (SLURM_PROCID, SLURM_STEP_ID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, the
  step's node list "127.0.0.[1-2]" and SLURM_JOB_ID), no MASTER_ADDR, MASTER_PORT or RANK: the store is on the list's
  first host at the port derived from the job id. They load a Megatron torch_dist checkpoint, which each node's first
  worker converts for its node (two nodes on one machine must not share the conversion);
- torchrun --max-restarts 1: a worker SIGKILLed mid-run, the agent restarts the job, which resumes from the newest
  complete checkpoint (--load and --save the same directory, as in Megatron's scripts) with the losses of an
  uninterrupted run and exits 0.
All must log exactly the reference run's losses.
"""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_crash_consistency import verified  # noqa: E402
from ports import free_port  # noqa: E402
from test_train_faults import tiny_training_setup  # noqa: E402

ITERS = 4
# Variables of the launchers a test's own environment may hold; each test sets only its launcher's.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    return tiny_training_setup(tmp_path_factory.mktemp("multinode"), trestle, seed=7)


@pytest.fixture(scope="module")
def torchrun():
    path = shutil.which("torchrun", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("torchrun")
    if not path:
        pytest.fail("torchrun not found beside this Python or on PATH (the venv's torch provides it)")
    return path


@pytest.fixture(scope="module")
def trainer(trestle_bin):
    return str(pathlib.Path(trestle_bin).parent / "trestle-train")


def flags(setup, log, iterations=ITERS, load=None, extra=()):
    return [str(a) for a in ["--tensor-model-parallel-size", "2", "--data-path", setup / "data" / "kjv_text_document",
                             "--split", "98,2,0", "--micro-batch-size", "1", "--global-batch-size", "4",
                             "--seq-length", "16", "--train-iters", iterations, "--lr", "1e-3", "--eval-iters", "0",
                             "--log-interval", "1", "--distributed-timeout-minutes", "2", "--load",
                             load or setup / "start", "--log-json", log, *extra]]


def records(log):
    """The log's whole loss records: a running job may be inside a write, so the text after the last newline is
    left."""
    return [r for r in map(json.loads, log.read_text().split("\n")[:-1]) if "lm_loss" in r]


def losses(log):
    return {r["iteration"]: r["lm_loss"] for r in records(log)}


def tracked(root):
    return int((root / "latest_checkpointed_iteration.txt").read_text())


def worker_environment(**variables):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
    return dict(env, OMP_NUM_THREADS="1", **variables)


def finish(processes, timeout=120):
    """Waits for every process; kills the rest on a timeout. Returns [(exit code, stdout + stderr)]."""
    out = []
    try:
        for p in processes:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


@pytest.fixture(scope="module")
def reference(setup, trestle_bin, tmp_path_factory):
    """The uninterrupted run on Trestle's own launcher: losses by iteration."""
    log = tmp_path_factory.mktemp("reference") / "log.jsonl"
    result = subprocess.run([trestle_bin, "train", "--nproc-per-node", "4", *flags(setup, log)], capture_output=True,
                            text=True, timeout=300, env=worker_environment())
    assert result.returncode == 0, result.stderr[-3000:]
    out = losses(log)
    assert sorted(out) == list(range(1, ITERS + 1))
    return out


def test_two_torchrun_agents_train_as_one_job(setup, torchrun, trainer, reference, tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d` twice (the two nodes' agents, one rendezvous):
    both exit 0 and the job logs the reference losses exactly."""
    log = tmp_path / "log.jsonl"
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen(
        [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
         "--rdzv-id", f"multinode-{os.getpid()}", "--local-addr", "127.0.0.1", "--monitor-interval", "0.2",
         "--no-python", trainer, "train", *flags(setup, log)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=worker_environment())
        for _ in range(2)]
    for code, text in finish(agents):
        assert code == 0, text[-4000:]
    assert losses(log) == reference


def test_slurm_variables_without_master_address(setup, trestle, trainer, reference, tmp_path):
    """Four tasks as srun starts them on two nodes: no MASTER_ADDR/MASTER_PORT/RANK, the store on the first host of
    SLURM_STEP_NODELIST="127.0.0.[1-2]" at 15000 + the job id's last four digits. They --load the torch_dist form of
    the start checkpoint, converted by each node's first task into a directory of its node: the reference losses
    exactly."""
    torch_dist = tmp_path / "torch_dist"
    trestle.run("convert", "--from", "trestle", setup / "start", "--to", "megatron-dist", torch_dist, "--quiet")
    port = free_port(15000, 25000)
    job_id = str(360000 + port - 15000)  # 15000 + its last four digits = port
    log = tmp_path / "log.jsonl"
    tasks = []
    for rank in range(4):
        env = worker_environment(SLURM_PROCID=str(rank), SLURM_STEP_ID="0", SLURM_NTASKS="4", SLURM_LOCALID=str(rank % 2),
                                 SLURM_NODEID=str(rank // 2), SLURM_NNODES="2", SLURM_JOB_ID=job_id,
                                 SLURM_STEP_NODELIST="127.0.0.[1-2]", SLURM_JOB_NODELIST="127.0.0.[1-2]",
                                 SLURM_NODELIST="127.0.0.[1-2]")
        tasks.append(subprocess.Popen(
            [trainer, "train", *flags(setup, log, load=torch_dist, extra=["--hf-config", setup / "hf" / "config.json"])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env))
    results = finish(tasks)
    for code, text in results:
        assert code == 0, text[-4000:]
    conversions = [line for _, text in results for line in text.splitlines() if "converting the Megatron" in line]
    assert len(conversions) == 2, conversions  # one per node, each into its own directory
    assert conversions[0].split("(into ")[1] != conversions[1].split("(into ")[1], conversions
    assert losses(log) == reference


def test_torchrun_restarts_a_killed_job_from_its_last_checkpoint(setup, trestle_bin, torchrun, trainer, tmp_path):
    """`torchrun --standalone --nproc-per-node 2 --max-restarts 1`, --load and --save the same directory (seeded with
    the start checkpoint), a save every 2 iterations: once iteration 3 is logged the logging worker is SIGKILLed; the
    agent restarts the job, which resumes right after its newest complete checkpoint, logs an uninterrupted run's
    losses exactly to the end and exits 0."""
    iterations = 8
    whole_log = tmp_path / "whole.jsonl"
    whole = subprocess.run([trestle_bin, "train", "--nproc-per-node", "2", *flags(
        setup, whole_log, iterations, extra=["--save", tmp_path / "whole", "--save-interval", "2"])],
        capture_output=True, text=True, timeout=300, env=worker_environment())
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = losses(whole_log)
    assert sorted(expected) == list(range(1, iterations + 1))

    root, log = tmp_path / "root", tmp_path / "log.jsonl"
    shutil.copytree(setup / "start", root)
    agent = subprocess.Popen(
        [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
         "--no-python", trainer, "train",
         *flags(setup, log, iterations, root, ["--save", root, "--save-interval", "2"])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=worker_environment())
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and any(r["iteration"] >= 3 for r in records(log)) and tracked(root) >= 2):
            assert agent.poll() is None, agent.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "the job neither logged iteration 3 nor committed 2 within 120 s"
            time.sleep(0.1)
        committed = tracked(root)
        # The last rank logs: once it is dead, every line after those already there is the restarted job's.
        workers = [p for p in psutil.Process(agent.pid).children(recursive=True) if p.name() == "trestle-train"]
        last = [p for p in workers if p.environ().get("RANK") == "1"]
        assert len(workers) == 2 and len(last) == 1, [(p.pid, p.name()) for p in workers]
        last[0].send_signal(signal.SIGKILL)
        psutil.wait_procs(last, timeout=30)
        before = len(records(log))
        (code, text), = finish([agent])
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    assert code == 0, text[-4000:]
    logged = records(log)
    first_attempt = {r["iteration"]: r["lm_loss"] for r in logged[:before]}
    restarted = {r["iteration"]: r["lm_loss"] for r in logged[before:]}
    assert first_attempt and restarted, (before, text[-4000:])
    assert first_attempt == {i: expected[i] for i in range(1, max(first_attempt) + 1)}
    # Resumed right after the newest checkpoint the first attempt committed: the one tracked when it was killed, or a
    # later one whose save committed in between.
    resumed_at = min(restarted) - 1
    assert resumed_at % 2 == 0 and committed <= resumed_at <= max(first_attempt), \
        (committed, sorted(first_attempt), sorted(restarted))
    assert [r["iteration"] for r in logged[before:]] == list(range(resumed_at + 1, iterations + 1))
    assert restarted == {i: expected[i] for i in range(resumed_at + 1, iterations + 1)}
    assert tracked(root) == iterations
    assert verified(trestle_bin, root, iterations)


def slurm_task(trainer, arguments, rank, tasks, job_id, nodes="127.0.0.1", **variables):
    """One task of a Slurm job of `tasks` tasks on two nodes (two a node), as srun starts it (with `variables` too)."""
    env = worker_environment(SLURM_PROCID=str(rank), SLURM_STEP_ID="0", SLURM_NTASKS=str(tasks), SLURM_LOCALID=str(rank % 2),
                             SLURM_NODEID=str(rank // 2), SLURM_JOB_ID=str(job_id), SLURM_STEP_NODELIST=nodes,
                             **variables)
    return subprocess.Popen([trainer, "train", *arguments], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)


def test_nodes_whose_trackers_disagree_load_the_newest_iteration(setup, trestle_bin, trainer, tmp_path):
    """Node 1's view of --load names an older iteration than node 0's (a stale shared file system, or node-local
    copies): they trained out of step, pairing iteration k with k - 2, and committed checkpoints that verified. Now
    every rank loads the newest iteration any rank found, as Megatron's read_metadata takes the maximum, saying so;
    a node that cannot read it, or reads another checkpoint, ends the job naming the rank before any step."""
    saved, whole_log = tmp_path / "saved", tmp_path / "whole.jsonl"
    whole = subprocess.run([trestle_bin, "train", "--nproc-per-node", "4", *flags(
        setup, whole_log, 6, extra=["--save", saved, "--save-interval", "2", "--exit-interval", "4"])],
        capture_output=True, text=True, timeout=300, env=worker_environment())
    assert whole.returncode == 0, whole.stderr[-3000:]
    resumed_log = tmp_path / "resumed.jsonl"
    result = subprocess.run([trestle_bin, "train", "--nproc-per-node", "4", *flags(setup, resumed_log, 6, saved)],
                            capture_output=True, text=True, timeout=300, env=worker_environment())
    assert result.returncode == 0, result.stderr[-3000:]
    expected = losses(resumed_log)
    assert sorted(expected) == [5, 6]
    stale = tmp_path / "stale"
    shutil.copytree(saved, stale)
    (stale / "latest_checkpointed_iteration.txt").write_text("2")
    port = free_port(15000, 25000)
    job_id = 370000 + port - 15000

    def run(node1_load, log):
        tasks = [slurm_task(trainer, flags(setup, log, 6, saved if rank < 2 else node1_load,
                                           ["--distributed-timeout-seconds", "60"]), rank, 4, job_id)
                 for rank in range(4)]
        return finish(tasks)
    results = run(stale, tmp_path / "log.jsonl")
    for code, text in results:
        assert code == 0, text[-4000:]
    assert "names iteration 2, another rank's names 4: loading 4" in results[2][1], results[2][1][-3000:]
    assert losses(tmp_path / "log.jsonl") == expected
    # Node 1 without iteration 4, then with another checkpoint under the same iteration: refused before any step.
    shutil.rmtree(stale / "iter_0000004")
    results = run(stale, tmp_path / "missing.jsonl")
    for rank, (code, text) in enumerate(results):
        says = "rank 2 cannot read iteration 4 of its --load" if rank < 2 else "iteration 4 is not a committed"
        assert code == 1 and says in text, text[-3000:]
    other = tmp_path / "other"
    other_log = tmp_path / "other.jsonl"
    made = subprocess.run([trestle_bin, "train", "--nproc-per-node", "4", *flags(
        setup, other_log, 6, extra=["--save", other, "--save-interval", "4", "--exit-interval", "4", "--seed", "9"])],
        capture_output=True, text=True, timeout=300, env=worker_environment())
    assert made.returncode == 0, made.stderr[-3000:]
    for code, text in run(other, tmp_path / "other_run.jsonl"):
        assert code == 1 and "loaded another checkpoint than rank 0" in text, text[-3000:]
    assert not (tmp_path / "missing.jsonl").exists() or not records(tmp_path / "missing.jsonl")
    assert not (tmp_path / "other_run.jsonl").exists() or not records(tmp_path / "other_run.jsonl")


def test_slurm_jobs_whose_ports_collide_stay_apart(setup, trainer, tmp_path):
    """Two 2-task Slurm jobs whose ids end in the same four digits derive one store port: job B's task 0 cannot serve
    it, and its task 1 used to join job A, the two training as one job into A's directory. Each job's keys are now its
    own: job A trains alone and finishes; job B's task 1 waits for its own task 0 and fails."""
    port = free_port(15000, 25000)
    job_a, job_b = 380000 + port - 15000, 390000 + port - 15000
    # Job A waits up to 60 s for its task 1, which starts once job B's task 0 has failed to serve the port; job B's
    # task 1 waits 20 s for its own task 0.
    args = {job: flags(setup, tmp_path / f"{job}.jsonl",
                       extra=["--distributed-timeout-seconds", str(seconds), "--tensor-model-parallel-size", "1"])
            for job, seconds in ((job_a, 60), (job_b, 20))}
    first = slurm_task(trainer, args[job_a], 0, 2, job_a)
    processes = [first]
    try:
        # Job A's task 0 serves the port before job B starts (a fixed sleep raced a loaded machine), and job B's task 0
        # has failed before job A's task 1 starts (job A, which cannot train without it, still holds the port).
        deadline = time.monotonic() + 60
        while not any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp")):
            assert first.poll() is None and time.monotonic() < deadline, "job A's task 0 never served its store"
            time.sleep(0.1)
        (b0, text_b0), = finish([slurm_task(trainer, args[job_b], 0, 2, job_b)], timeout=60)
        processes += [slurm_task(trainer, args[job_b], 1, 2, job_b), slurm_task(trainer, args[job_a], 1, 2, job_a)]
    except BaseException:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        raise
    (a0, text_a0), (b1, text_b1), (a1, text_a1) = finish(processes, timeout=180)
    assert a0 == 0 and a1 == 0, (text_a0[-3000:], text_a1[-3000:])
    assert sorted(losses(tmp_path / f"{job_a}.jsonl")) == list(range(1, ITERS + 1))
    assert b0 != 0 and "cannot serve the c10d TCPStore" in text_b0, text_b0[-3000:]
    # (It fails when its timeout passes, or sooner when job A ends and takes the store with it.)
    assert b1 != 0 and ("never arrived" in text_b1 or "rendezvous through the c10d store failed" in text_b1), \
        text_b1[-3000:]
    assert not (tmp_path / f"{job_b}.jsonl").exists() or not records(tmp_path / f"{job_b}.jsonl")


def test_a_port_held_by_another_program_ends_the_ranks_with_a_message(setup, trainer, tmp_path):
    """A program that accepts connections on the store's port but is no c10d store (here a bare listener): task 0
    cannot serve it, and the others, connected, used to wait forever for the store's answer to their ping, whatever
    the timeout. Now they give up after the timeout (plus a grace), saying something else listens there."""
    import socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    try:
        started = time.monotonic()
        tasks = [slurm_task(trainer, flags(setup, tmp_path / "log.jsonl", extra=["--distributed-timeout-seconds", "5"]),
                            rank, 2, 400001, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(listener.getsockname()[1]))
                 for rank in range(2)]
        (code0, text0), (code1, text1) = finish(tasks, timeout=90)
    finally:
        listener.close()
    assert time.monotonic() - started < 60
    assert code0 != 0 and "cannot serve the c10d TCPStore" in text0, text0[-2000:]
    assert code1 != 0 and "something other than the job's store listens on the port" in text1, text1[-2000:]


def test_torchrun_workers_die_with_their_agent(setup, torchrun, trainer, tmp_path):
    """An agent killed outright (SIGKILL to torchrun alone) left its workers training to the end, holding the save
    lock; they are now tied to it and die with it."""
    log = tmp_path / "log.jsonl"
    agent = subprocess.Popen(
        [torchrun, "--standalone", "--nproc-per-node", "2", "--no-python", trainer, "train",
         *flags(setup, log, 100000, extra=["--save", tmp_path / "save", "--save-interval", "1000"])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=worker_environment())
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and records(log)):
            assert agent.poll() is None, agent.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no iteration logged within 120 s"
            time.sleep(0.1)
        workers = [p for p in psutil.Process(agent.pid).children(recursive=True) if p.name() == "trestle-train"]
        assert len(workers) == 2
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive, f"workers {[p.pid for p in alive]} outlived their agent"
    finally:
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_nodes_given_other_data_or_another_save_directory_are_refused(setup, trestle, trainer, tmp_path):
    """Node 1 given another --data-path trained on other samples without a word (exit 0, other losses), and with
    another --save it said it committed into a directory that never existed: both now end the job before any step,
    naming the rank. The same data under another path (a node-local copy) is the same data."""
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"line {i} of another corpus, not the same words"}) + "\n"
                             for i in range(400)))
    trestle.run("preprocess", "--input", other, "--output-prefix", tmp_path / "other", "--tokenizer-type", "bytes",
                "--quiet")
    copy = tmp_path / "copy"
    copy.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(setup / "data" / f"kjv_text_document{suffix}", copy / f"kjv_text_document{suffix}")
    port = free_port(15000, 25000)

    def run(node1_extra, log, job):
        tasks = []
        for rank in range(4):
            extra = ["--distributed-timeout-seconds", "60", *(node1_extra if rank >= 2 else [])]
            arguments = flags(setup, log, extra=extra)
            if rank >= 2 and "--data-path" in node1_extra:  # the node's own --data-path replaces the common one
                at = arguments.index("--data-path")
                del arguments[at:at + 2]
            tasks.append(slurm_task(trainer, arguments, rank, 4, job + port - 15000))
        return finish(tasks)
    for code, text in run(["--data-path", tmp_path / "other_text_document"], tmp_path / "a.jsonl", 410000):
        assert code == 1 and "reads other training samples than rank 0" in text, text[-3000:]
    for code, text in run(["--save", tmp_path / "elsewhere"], tmp_path / "b.jsonl", 420000):
        assert code == 1 and "saves under another --save than rank 0" in text, text[-3000:]
    for code, text in run(["--data-path", copy / "kjv_text_document"], tmp_path / "c.jsonl", 430000):
        assert code == 0, text[-3000:]


def test_ranks_started_for_another_job_or_twice_are_named(setup, trainer, tmp_path):
    """One node given other parallel flags, or two processes given one rank: the job used to time out creating its
    groups, naming nothing; now the ranks say which rank was started for which job, or that a rank is claimed twice."""
    port = free_port(15000, 25000)
    timeout = ["--distributed-timeout-seconds", "20"]
    tasks = [slurm_task(trainer, flags(setup, tmp_path / "a.jsonl",
                                       extra=[*timeout, *(["--tensor-model-parallel-size", "1"] if rank >= 2 else [])]),
                        rank, 4, 440000 + port - 15000) for rank in range(4)]
    results = finish(tasks)
    # Task 0 (which serves the store) says so; the others end with it.
    code, text = results[0]
    assert code == 1 and "for a job of 4 ranks (tp 2, pp 1, cp 1, ep 1, dp 2), rank 2 for one of 4 ranks (tp 1" \
        in text, text[-3000:]
    assert all(code != 0 for code, _ in results)
    port = free_port(15000, 25000)
    tasks = [slurm_task(trainer, flags(setup, tmp_path / "b.jsonl", extra=timeout), rank, 4, 450000 + port - 15000)
             for rank in (0, 1, 1, 3)]
    results = finish(tasks)
    assert any(code == 1 and "another process of this job already claims this rank" in text for code, text in results), \
        [text[-1500:] for _, text in results]

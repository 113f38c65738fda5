"""The script server (script_server.py) that runs the reference scripts: a forked child behaves as `python script`
would (argv, environment, working directory, __main__, output, exit code or signal), and one that outlives its
timeout is killed with the processes it started; the ranks of a job whose first rank fails are ended with it."""
import os
import subprocess
import time

import pytest
from script_server import ScriptServer

SCRIPT = """
import json, os, signal, subprocess, sys, time
mode = sys.argv[1]
if mode == "echo":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "var": os.environ.get("SCRIPT_SERVER_VAR"),
                      "main": __name__, "file": __file__}))
    print("to stderr", file=sys.stderr)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "raise":
    raise ValueError("the script failed")
elif mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(str(child.pid))
    time.sleep(600)
"""


@pytest.fixture
def server(tmp_path):
    server = ScriptServer(["json"], tmp_path / "scratch")
    yield server
    server.close()


def test_a_child_runs_as_python_would(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    (tmp_path / "work").mkdir()
    result = server.run([script, "echo", 7], env=dict(os.environ, SCRIPT_SERVER_VAR="x"), cwd=tmp_path / "work")
    assert result.returncode == 0, result.stderr
    import json
    seen = json.loads(result.stdout)
    assert seen == {"argv": [str(script), "echo", "7"], "cwd": str(tmp_path / "work"), "var": "x", "main": "__main__",
                    "file": str(script)}
    assert result.stderr == "to stderr\n"


def test_exit_codes_exceptions_and_signals_come_back(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    children = [server.start([script, "exit", 3]), server.start([script, "raise"]), server.start([script, "kill"])]
    exited, raised, killed = (server.wait(child, 60) for child in children)
    assert exited.returncode == 3
    assert raised.returncode == 1 and "ValueError: the script failed" in raised.stderr
    assert killed.returncode == -9


def test_a_rank_that_fails_ends_the_ranks_waiting_for_it(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    start = time.monotonic()
    children = [server.start([script, "exit", 3]), server.start([script, "hang", tmp_path / "grandchild.pid"])]
    # start() answers once the child leads its own process group: a kill of that group right away reaches it
    assert os.getpgid(children[1]["pid"]) == children[1]["pid"]
    failed, waiting = server.wait_all(children, timeout=120)
    assert failed.returncode == 3 and waiting.returncode == -9
    assert time.monotonic() - start < 30


def test_a_child_killed_as_soon_as_it_starts_comes_back_killed(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    for _ in range(20):  # the kill lands anywhere in the child's start, before or after it opened its output
        child = server.start([script, "hang", tmp_path / "grandchild.pid"])
        os.killpg(child["pid"], 9)
        killed = server.wait(child, 60)
        assert killed.returncode == -9 and killed.stdout == ""


def test_a_child_past_its_timeout_is_killed_with_its_processes(server, tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    pid_file = tmp_path / "grandchild.pid"
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired, match=r"'hang'.* timed out after"):
        server.wait_all([server.start([script, "hang", pid_file])], timeout=3)
    assert time.monotonic() - start < 30
    grandchild = int(pid_file.read_text())
    for _ in range(100):  # killed with its process group; reaped by init
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the script's own child {grandchild} outlived the timeout")
    assert server.run([script, "exit", 0]).returncode == 0  # the server goes on

"""Runs Python scripts (`python script.py args...`) in children forked from one server process that imported the
heavy reference packages (torch, megatron-core, ...) once: a fresh interpreter per megatron-core rank spent ~5 s of
CPU on those imports alone. A child gets its own argv, environment, working directory, session and output files, and
runs the script as __main__ (a spawn-started helper process of it re-imports the script by path, as usual); its exit
code comes back, negative for the signal that ended it. A child that outlives its timeout is killed with its process
group. Modules a script imports beyond the preloaded ones are imported in the child as usual.

    server = reference_scripts()      # this process's server preloading REFERENCE_MODULES
    children = [server.start([script, "--rank", str(r)], env) for r in range(2)]
    results = server.wait_all(children, timeout=600)   # subprocess.CompletedProcess each, output as text
"""
import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

# What the reference scripts of the interop tests import: loaded once by reference_scripts()'s server.
REFERENCE_MODULES = ["torch", "torch.distributed", "torch.distributed.checkpoint", "safetensors.torch",
                     "megatron.core.dist_checkpointing", "megatron.core.parallel_state", "megatron.core.distributed",
                     "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.optimizer_param_scheduler",
                     "megatron.core.transformer.transformer_config"]


class ScriptServer:
    def __init__(self, preload, scratch):
        self.preload, self.scratch, self.process, self.count = list(preload), str(scratch), None, 0

    def _server(self):
        if self.process is None or self.process.poll() is not None:
            os.makedirs(self.scratch, exist_ok=True)
            log = open(os.path.join(self.scratch, "server.log"), "w")
            self.process = subprocess.Popen([sys.executable, __file__, *self.preload], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=log, text=True)
            log.close()
            ready = self._reply(timeout=600)
            if ready != {"ready": True}:
                raise RuntimeError(f"the script server did not start: {ready}\n{self._log()}")
        return self.process

    def _log(self):
        with open(os.path.join(self.scratch, "server.log")) as f:
            return f.read()[-4000:]

    def _reply(self, timeout):  # one answer per request, so no second line waits in the pipe's buffer
        readable, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not readable:
            return None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the script server died (exit code {self.process.wait()})\n{self._log()}")
        return json.loads(line)

    def _ask(self, request, timeout=600):
        server = self._server()
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        return self._reply(timeout)

    def start(self, argv, env=None, cwd=None):
        """Starts `python argv[0] argv[1:]` as a forked child; returns a handle for wait()."""
        self.count += 1
        out = os.path.join(self.scratch, f"child{self.count}")
        argv = [str(a) for a in argv]
        answer = self._ask({"argv": argv, "env": dict(os.environ if env is None else env),
                            "cwd": str(cwd or os.getcwd()), "stdout": out + ".out", "stderr": out + ".err"})
        if answer is None or "pid" not in answer:
            raise RuntimeError(f"the script server did not start {argv}: {answer}\n{self._log()}")
        return {"argv": argv, "pid": answer["pid"], "stdout": out + ".out", "stderr": out + ".err"}

    def wait(self, child, timeout):
        """Waits for a child: subprocess.CompletedProcess; after `timeout` s its process group is killed and
        subprocess.TimeoutExpired raised."""
        self.process.stdin.write(json.dumps({"wait": child["pid"]}) + "\n")
        self.process.stdin.flush()
        answer = self._reply(timeout)
        expired = answer is None
        if expired:
            _kill_group(child["pid"])
            answer = self._reply(60)
        stdout, stderr = (open(child[k], errors="replace").read() for k in ("stdout", "stderr"))
        for k in ("stdout", "stderr"):
            os.unlink(child[k])
        if expired:
            raise subprocess.TimeoutExpired(child["argv"], timeout, stdout, stderr)
        return subprocess.CompletedProcess(child["argv"], answer["returncode"], stdout, stderr)

    def wait_all(self, children, timeout):
        """Waits for children started together (the ranks of one job) with one deadline; on a timeout every one of
        them is killed before subprocess.TimeoutExpired is raised. One that fails ends the others (which would wait
        for it until their own timeouts), so its error is what the caller sees."""
        deadline, results = time.monotonic() + timeout, []
        try:
            for child in children:
                if results and results[-1].returncode != 0:
                    _kill_group(child["pid"])
                results.append(self.wait(child, max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for child in children[len(results) + 1:]:
                _kill_group(child["pid"])
                self.wait(child, 60)
            raise
        return results

    def run(self, argv, env=None, cwd=None, timeout=600):
        return self.wait(self.start(argv, env, cwd), timeout)

    def close(self):
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


def _kill_group(pid):
    """Kills a child and the processes it started (it leads its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_shared = None


def reference_scripts():
    """This process's server for the reference scripts (started on first use, closed at exit)."""
    global _shared
    if _shared is None:
        scratch = tempfile.mkdtemp(prefix="trestle-scripts-")
        _shared = ScriptServer(REFERENCE_MODULES, scratch)
        atexit.register(lambda: (_shared.close(), shutil.rmtree(scratch, ignore_errors=True)))
    return _shared


def _child(request, outputs, has_session):
    """In the forked child: becomes `python argv...` and never returns. `outputs` are the descriptors of its stdout and
    stderr files, which the server created before the fork (so they exist even for a child killed at once);
    `has_session` (a pipe's write end) is closed once the child leads its own session, so that a kill of its process
    group cannot come before it has one."""
    import atexit
    import runpy
    import traceback
    code = 1
    try:
        try:
            os.setsid()
        finally:
            os.close(has_session)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdin = open(os.devnull)
        for fd, output in zip((1, 2), outputs):
            os.dup2(output, fd)
            os.close(output)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and "torch" in sys.modules:  # OpenMP read the server's environment when it loaded
            sys.modules["torch"].set_num_threads(int(threads))
        sys.argv = request["argv"]
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        os._exit(code)


def _serve(preload):
    import importlib
    for name in preload:
        importlib.import_module(name)
    answers = sys.stdout
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "wait" in request:
            _, status = os.waitpid(request["wait"], 0)
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            print(json.dumps({"returncode": code}), file=answers, flush=True)
            continue
        outputs = [os.open(request[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for k in ("stdout", "stderr")]
        session_read, has_session = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(session_read)
            _child(request, outputs, has_session)
        for output in outputs:
            os.close(output)
        os.close(has_session)
        os.read(session_read, 1)  # end of file once the child has its session (or has died trying)
        os.close(session_read)
        print(json.dumps({"pid": pid}), file=answers, flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1:])

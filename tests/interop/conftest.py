"""Interop fixtures: the built `trestle` CLI (env TRESTLE_BIN, set by ctest) and helpers to run it."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))  # the tests' own modules (models, script_server)


class Trestle:
    """Runs the trestle CLI; run() asserts success and returns stdout, run_raw() returns the CompletedProcess."""

    def __init__(self, path):
        self.path = path

    def run_raw(self, *args, timeout=120):
        return subprocess.run([self.path, *map(str, args)], capture_output=True, text=True, timeout=timeout)

    def run(self, *args, timeout=120):
        result = self.run_raw(*args, timeout=timeout)
        assert result.returncode == 0, (
            f"trestle {' '.join(map(str, args))} exited with {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
        return result.stdout

    def inspect(self, path, checksums=True):
        args = ["inspect", path, "--json"] + (["--checksums"] if checksums else [])
        return json.loads(self.run(*args))


@pytest.fixture(scope="session")
def trestle_bin():
    path = os.environ.get("TRESTLE_BIN") or shutil.which("trestle")
    if not path:
        pytest.fail("set TRESTLE_BIN to the built trestle CLI (ctest does this)")
    if not os.access(path, os.X_OK):
        pytest.fail(f"TRESTLE_BIN={path} is not an executable file")
    return path


@pytest.fixture(scope="session")
def trestle(trestle_bin):
    return Trestle(trestle_bin)


@pytest.fixture(scope="session")
def trestle_convert(trestle):
    """The CLI, for tests of `trestle convert`; fails them when this build's convert command does not run."""
    result = trestle.run_raw("convert", "--help")
    if result.returncode != 0:
        pytest.fail(f"`trestle convert --help` failed ({result.returncode}):\nstderr:\n{result.stderr}")
    return trestle



# A file whose every test was skipped (a CUDA-only file without a GPU) must read as skipped in ctest, not passed:
# ctest sets TRESTLE_ALL_SKIPPED_EXIT_CODE and gives the same code as the test's SKIP_RETURN_CODE. A run where any
# test ran (passed or failed) keeps pytest's own exit status.
_skipped, _ran = set(), set()


def pytest_collectreport(report):
    if report.skipped:  # pytest.skip(allow_module_level=True)
        _skipped.add(report.nodeid)


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):  # an xfail test ran
        _skipped.add(report.nodeid)
    elif report.when == "call":
        _ran.add(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    code = os.environ.get("TRESTLE_ALL_SKIPPED_EXIT_CODE")
    # (a file skipped at module level collects no test: pytest says NO_TESTS_COLLECTED)
    if code and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) and _skipped and not _ran:
        session.exitstatus = int(code)

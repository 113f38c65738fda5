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


"""`pip install .` of the repository (pyproject.toml, scikit-build-core, CMake) into a fresh virtual environment that
sees the project's torch, and the wheel build: `import trestle` then works from anywhere, and the installed package
saves, loads, reaches the converters and runs the DCP plugin. One CMake build directory serves both (the second build is
incremental)."""
import os
import pathlib
import shutil
import site
import subprocess
import sys
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[2]

USE = textwrap.dedent('''
    import os, sys, torch, trestle
    import torch.distributed.checkpoint as dcp
    assert trestle.__file__.startswith(sys.prefix), trestle.__file__
    state = {"w": torch.randn(33, 7), "b": torch.arange(5, dtype=torch.int64)}
    trestle.save(state, "ckpt")
    back = trestle.load("ckpt", {k: torch.empty_like(v) for k, v in state.items()})
    assert all(torch.equal(back[k], state[k]) for k in state)
    dcp.save(state, storage_writer=trestle.dcp.Writer("dcp"), no_dist=True)
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=dcp.FileSystemReader("dcp"), no_dist=True)
    assert all(torch.equal(back[k], state[k]) for k in state)
    try:  # the converters are in the package too (a plain state dict has no model to reshard)
        trestle.reshard("ckpt", "copy", tp=1)
        raise AssertionError("reshard of a model-less checkpoint succeeded")
    except RuntimeError as e:
        assert "does not describe a Megatron model" in str(e), e
    print("installed trestle ok:", trestle.__file__)
''')


def fresh_venv(path):
    """A new venv whose site-packages also sees the project's (torch, scikit-build-core) through a .pth file."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    python = path / "bin" / "python"
    target = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                            capture_output=True, text=True).stdout.strip()
    pathlib.Path(target, "project-venv.pth").write_text(site.getsitepackages()[0] + "\n")
    return python


def pip(python, *args, env):
    result = subprocess.run([python, "-m", "pip", "--disable-pip-version-check", *map(str, args)], env=env,
                            capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, f"pip {' '.join(map(str, args))}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def run_installed(python, tmp_path, env):
    work = tmp_path / "use"
    work.mkdir()
    clean = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "TRESTLE_PYTHON_PATH")}
    result = subprocess.run([python, "-c", USE], cwd=work, env=clean, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "installed trestle ok" in result.stdout


def test_pip_install_and_wheel_in_a_fresh_venv(tmp_path):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    build_dir = f"--config-settings=build-dir={tmp_path / 'cmake-build'}"
    python_path = os.environ.get("TRESTLE_PYTHON_PATH")
    if python_path:
        # Beside the project's build (ctest's): same depth under the repository, same build type and warnings, so
        # ccache (paths relative to the repository) serves the objects that build compiled; reruns are incremental.
        project_build = pathlib.Path(python_path).parent
        cache = dict(line.split("=", 1) for line in (project_build / "CMakeCache.txt").read_text().splitlines()
                     if "=" in line and not line.startswith(("#", "//")))
        build_dir = f"--config-settings=build-dir={project_build.parent / (project_build.name + '-pip')}"
        build_type = cache.get("CMAKE_BUILD_TYPE:STRING", "RelWithDebInfo")
        werror = cache.get("TRESTLE_WERROR:BOOL", "OFF")
        build_dir = [build_dir, f"--config-settings=cmake.build-type={build_type}",
                     f"--config-settings=cmake.define.TRESTLE_WERROR={werror}"]
        for compiler in ("CMAKE_C_COMPILER", "CMAKE_CXX_COMPILER"):
            for key, value in cache.items():
                if key.split(":")[0] == compiler:
                    build_dir.append(f"--config-settings=cmake.define.{compiler}={value}")
    if shutil.which("ccache"):
        env.setdefault("CMAKE_CXX_COMPILER_LAUNCHER", "ccache")
        env.setdefault("CMAKE_C_COMPILER_LAUNCHER", "ccache")
        env.setdefault("CCACHE_BASEDIR", str(REPO))
        project_cache = pathlib.Path.home() / ".cache" / "trestle" / "ccache"  # scripts/build's
        if project_cache.is_dir():
            env.setdefault("CCACHE_DIR", str(project_cache))
        env.setdefault("CCACHE_NOHASHDIR", "true")
    build_dir = build_dir if isinstance(build_dir, list) else [build_dir]

    installed = fresh_venv(tmp_path / "venv")
    pip(installed, "install", "--no-build-isolation", "--no-deps", *build_dir, REPO, env=env)
    run_installed(installed, tmp_path, env)

    pip(installed, "wheel", "--no-build-isolation", "--no-deps", *build_dir, "-w", tmp_path / "dist", REPO,
        env=env)
    wheels = list((tmp_path / "dist").glob("trestle-*.whl"))
    assert len(wheels) == 1, wheels
    from_wheel = fresh_venv(tmp_path / "wheel-venv")
    pip(from_wheel, "install", "--no-index", "--no-deps", wheels[0], env=env)
    shutil.rmtree(tmp_path / "use")
    run_installed(from_wheel, tmp_path, env)

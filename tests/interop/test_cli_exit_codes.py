"""The exit-code rule of every `trestle` command (and of `trestle bench`, run by trestle-bench): 0 for --help and
success, 2 for a usage error (unknown option, bad value, missing argument), 1 for a failure (a missing input path, a
corrupt file); a message naming the problem on stderr, never a crash. Also that the product binary carries no bench
code and that `trestle bench` says so when trestle-bench is not beside it."""
import os
import shutil
import subprocess

import pytest

COMMANDS = ["bench", "convert", "diff", "export", "import", "inspect", "reshard", "verify"]


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory):
    """Files that exist but are not what they claim: a safetensors file, a Hugging Face directory, an HDF5 file and a
    Trestle checkpoint with a truncated manifest."""
    root = tmp_path_factory.mktemp("corrupt")
    st = root / "model.safetensors"
    st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    hf = root / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"')
    shutil.copy(st, hf / "model.safetensors")
    h5 = root / "file.h5"
    h5.write_bytes(b"this is not an HDF5 file\n" * 10)
    ckpt = root / "ckpt"
    (ckpt / "iter_0000001").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    (ckpt / "iter_0000001" / "manifest.json").write_text('{"format": "trestle", "version": 1, "tensors": {')
    return {"safetensors": st, "hf": hf, "h5": h5, "ckpt": ckpt}


def check(trestle, expected, *args, says=None):
    result = trestle.run_raw(*args, timeout=120)
    assert result.returncode == expected, (args, result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    if says is not None:
        assert says in result.stderr, (args, result.stderr)
    if expected != 0:
        assert result.stderr.strip(), (args, "no message on stderr")
    return result


def test_top_level_usage(trestle):
    assert "commands:" in check(trestle, 0, "--help").stdout
    check(trestle, 2, says="usage: trestle <command>")
    check(trestle, 2, "no-such-command", says="no-such-command")


@pytest.mark.parametrize("command", COMMANDS)
def test_help_exits_0_and_shows_options(trestle, command):
    out = check(trestle, 0, command, "--help").stdout
    assert "usage" in out.lower() or "Usage" in out
    assert "--help" in out or "-h" in out


def test_train_help_shows_every_group_a_user_sets(trestle):
    """The LoRA options were once left out of `trestle train --help`."""
    out = check(trestle, 0, "train", "--help").stdout
    for group in ("launch", "parallel", "model", "lora", "data", "optimizer", "checkpointing", "logging"):
        assert f" {group} options:" in out, group
    for flag in ("--lora-rank", "--lora-target-modules", "--pretrained-checkpoint", "linear_kv_down_proj"):
        assert flag in out, flag


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "bench"])
def test_unknown_option_exits_2(trestle, command):
    check(trestle, 2, command, "--no-such-option", "x", "y", says="no-such-option")


@pytest.mark.parametrize("args, says", [
    (["convert"], "required"),
    (["convert", "--from", "hf", "a", "--to", "trestle", "b", "--tp", "0"], "--tp"),
    (["convert", "--from", "hf", "a", "--to", "trestle", "b", "--pp", "-2"], "--pp"),
    (["convert", "--from", "hf", "a", "--to", "hf", "b", "--max-shard-size", "0"], "--max-shard-size"),
    (["convert", "--from", "hf", "a", "--to", "hf", "b", "--max-shard-size", "5XB"], "5XB"),
    (["convert", "--from", "zip", "a", "--to", "hf", "b"], "zip"),
    (["convert", "--from", "hf", "a", "--to", "trestle", "b", "--codec", "lz4"], "--codec"),
    (["convert", "--from", "trestle", "a", "--to", "hf", "b", "--hf-expert-layout", "odd"], "--hf-expert-layout"),
    (["convert", "--from", "hf", "a", "--to", "trestle", "b", "--tp", "two"], "two"),
    (["diff", "only-a"], "required"),
    (["diff", "a", "b", "--atol", "-1"], "--atol"),
    (["export", "one-path"], "two paths"),
    (["export", "--to", "zip", "a", "b"], "zip"),
    (["import", "--from", "zip", "a", "b"], "zip"),
    (["inspect"], "PATH"),
    (["reshard", "in", "out", "--tp", "0"], "--tp"),
    (["reshard", "in", "out", "--dp", "-1"], "--dp"),
    (["reshard", "in", "out", "--first-stage-layers", "-1"], "--first-stage-layers"),
    (["reshard", "in", "out", "--to-format", "hf"], "--to-format"),
    (["reshard"], "required"),
    (["verify"], "PATH"),
    (["verify", "ckpt", "--tolerance", "-1"], "--tolerance"),
    (["bench"], "usage"),
    (["bench", "no-such-benchmark"], "no-such-benchmark"),
    (["bench", "save", "--repeat", "0"], "--repeat"),
    (["bench", "save", "--size", "0"], "--size"),
    (["bench", "load", "--threads", "-1"], "--threads"),
    (["bench", "convert", "--tp", "0"], "--tp"),
    (["bench", "reshard", "--no-such-option"], "no-such-option"),
    (["bench", "safetensors", "--read-method", "carrier-pigeon"], "carrier-pigeon"),
])
def test_usage_errors_exit_2(trestle, tmp_path, args, says):
    # Usage errors are found before anything is read, so inputs that do not exist still give 2, not 1.
    args = [str(tmp_path / a) if a in ("a", "b", "in", "out", "ckpt") else a for a in args]
    result = check(trestle, 2, *args)
    assert says.lower() in (result.stderr + result.stdout).lower(), (args, result.stderr)


def test_failures_exit_1_naming_the_path(trestle, tmp_path, corrupt):
    missing = str(tmp_path / "missing")
    out = str(tmp_path / "out")
    for args in (["convert", "--from", "hf", missing, "--to", "trestle", out],
                 ["convert", "--from", "hf", missing, "--to", "hf", out],
                 ["convert", "--from", "megatron-dist", missing, "--to", "hf", out],
                 ["diff", missing, str(corrupt["ckpt"])],
                 ["export", "--to", "hdf5", missing, str(tmp_path / "x.h5")],
                 ["import", "--from", "hdf5", missing, out],
                 ["inspect", missing],
                 ["reshard", missing, out, "--tp", "2"],
                 ["verify", missing]):
        check(trestle, 1, *args, says="missing")


def test_corrupt_inputs_exit_1(trestle, tmp_path, corrupt):
    out = str(tmp_path / "out")
    for args, says in ((["inspect", corrupt["safetensors"]], "model.safetensors"),
                       (["convert", "--from", "hf", corrupt["hf"], "--to", "trestle", out],
                        f"{corrupt['hf'] / 'config.json'}: not valid JSON"),
                       (["convert", "--from", "hf", corrupt["hf"], "--to", "hf", out],
                        f"{corrupt['hf'] / 'model.safetensors'}: header is not valid JSON"),
                       (["import", "--from", "hdf5", corrupt["h5"], out], "file.h5"),
                       (["inspect", corrupt["ckpt"]], "manifest.json"),
                       (["verify", corrupt["ckpt"]], "manifest.json"),
                       (["export", "--to", "hdf5", corrupt["ckpt"], str(tmp_path / "x.h5")], "manifest.json"),
                       (["reshard", corrupt["ckpt"], out, "--tp", "2"], "manifest.json"),
                       (["diff", corrupt["ckpt"], corrupt["ckpt"]], "manifest.json")):
        check(trestle, 1, *args, says=str(says))


def test_bench_failure_exits_1(trestle, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    check(trestle, 1, "bench", "reshard", "--size", "1MB", "--no-fio", "--dir", str(blocker / "scratch"),
          says="scratch")


def test_trestle_has_no_bench_code_and_runs_trestle_bench_beside_it(trestle_bin, tmp_path):
    bench_bin = os.path.join(os.path.dirname(trestle_bin), "trestle-bench")
    assert os.access(bench_bin, os.X_OK), bench_bin
    with open(trestle_bin, "rb") as f:
        product = f.read()
    with open(bench_bin, "rb") as f:
        bench = f.read()
    for symbol in (b"measure_fio_ceiling", b"run_bench_rounds", b"PeerClient"):
        assert symbol in bench, symbol
        assert symbol not in product, symbol
    # The peers were copied beside trestle-bench at build time.
    peers = os.path.join(os.path.dirname(trestle_bin), "bench", "peers")
    assert sorted(os.listdir(peers)) == ["megatron_convert_peer.py", "preprocess_peer.py", "safetensors_peer.py",
                                         "torch_checkpoint_peer.py", "train_peer.py"]
    # Alone in a folder, `trestle bench` fails with a message naming the program it looked for.
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(trestle_bin, alone / "trestle")
    result = subprocess.run([str(alone / "trestle"), "bench", "save", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "trestle-bench" in result.stderr, (result.returncode, result.stderr)

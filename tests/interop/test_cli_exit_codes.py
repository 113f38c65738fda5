"""The exit-code rule of every `trestle` command (and of `trestle bench`, run by trestle-bench): 0 for --help and
success, 2 for a usage error (unknown option, bad value, missing argument), 1 for a failure (a missing input path, a
corrupt file); a message naming the problem on stderr, never a crash. Also that the product binary carries no bench
code and that `trestle bench` says so when trestle-bench is not beside it."""
import json
import os
import shutil
import struct
import subprocess

import pytest

from models import save_tiny_model

COMMANDS = ["bench", "convert", "diff", "export", "import", "inspect", "reshard", "verify"]
# A run's flags beside a model (one that need not exist: usage errors come first).
TRAIN_RUN = ["--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2", "--seq-length", "16",
             "--train-iters", "1", "--lr", "1e-3", "--eval-iters", "0"]


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
    (["verify", "ckpt", "--tolerance", "-1", "--against", "a"], "--tolerance"),
    (["verify", "ckpt", "--tolerance", "0.1"], "give --against too"),
    (["train", "--load", "", "--mock-data"], "--load is an empty path"),
    (["train", "--nproc-per-node", "2", "--save", "", "--mock-data"], "--save is an empty path"),
    # One path too many, for every command that takes paths (each was once ignored), and a negative iteration.
    (["verify", "ckpt", "extra"], "unexpected argument 'extra'"),
    (["inspect", "ckpt", "extra"], "unexpected argument 'extra'"),
    (["diff", "a", "b", "extra"], "unexpected argument 'extra'"),
    (["reshard", "in", "out", "extra", "--tp", "1"], "unexpected argument 'extra'"),
    (["convert", "--from", "trestle", "a", "--to", "hf", "b", "extra"], "unexpected argument 'extra'"),
    (["export", "a", "b", "extra"], "unexpected argument 'extra'"),
    (["import", "a", "b", "extra"], "unexpected argument 'extra'"),
    # A path with a comma is one path (a list option split it: "unexpected argument")
    (["convert", "--from", "hf", "a,b", "--to", "hf", "c,d", "--tp", "0"], "--tp"),
    (["export", "--to", "zip", "a,b", "c,d"], "zip"),
    (["preprocess", "--input", "a", "--output-prefix", "b", "extra"], "unexpected argument 'extra'"),
    (["verify", "--iteration", "-1", "ckpt"], "--iteration must be 0 or more"),
    (["inspect", "ckpt", "--json", "extra"], "unexpected argument 'extra'"),
    (["diff", "a", "b", "--iteration-b", "-3"], "--iteration-b must be 0 or more"),
    (["reshard", "in", "out", "--iteration", "-1"], "--iteration must be 0 or more"),
    (["convert", "--from", "trestle", "a", "--to", "hf", "b", "--iteration", "-1"], "--iteration must be 0 or more"),
    (["export", "a", "b", "--iteration", "-1"], "--iteration must be 0 or more"),
    (["import", "a", "b", "--iteration", "-1"], "--iteration must be 0 or more"),
    # An empty path (the conversion ran whole, then failed to rename into "", exit 1)
    (["convert", "--from", "hf", "a", "--to", "trestle", ""], "DST is an empty path"),
    (["convert", "--from", "hf", "", "--to", "hf", "b"], "SRC is an empty path"),
    (["reshard", "in", "", "--tp", "1"], "OUT is an empty path"),
    (["reshard", "", "out", "--tp", "1"], "IN is an empty path"),
    (["bench"], "usage"),
    (["bench", "no-such-benchmark"], "no-such-benchmark"),
    (["bench", "save", "--repeat", "0"], "--repeat"),
    (["bench", "save", "--size", "0"], "--size"),
    (["bench", "load", "--threads", "-1"], "--threads"),
    (["bench", "convert", "--tp", "0"], "--tp"),
    (["bench", "reshard", "--no-such-option"], "no-such-option"),
    (["bench", "safetensors", "--read-method", "carrier-pigeon"], "carrier-pigeon"),
    # Each was accepted: an extra word ignored, a port taken modulo 65536, sizes that crashed or failed late.
    (["train", "--model-config", "a", "--mock-data", "extra"], "unexpected argument 'extra'"),
    (["train", "--nproc-per-node", "2", "--master-port", "70000", "--mock-data"], "--master-port must be 0"),
    (["train", "--nproc-per-node", "100000", "--mock-data"], "--nproc-per-node must be 1 to 1024"),
    (["train", "--distributed-timeout-minutes", "-1", "--mock-data"], "--distributed-timeout-minutes must be 1"),
    (["bench", "save", "extra"], "unexpected argument 'extra'"),
    (["bench", "kernels", "extra"], "unexpected argument 'extra'"),
    (["bench", "preprocess", "extra"], "unexpected argument 'extra'"),
    (["bench", "train", "extra"], "unexpected argument 'extra'"),
    (["bench", "train", "--heads", "0"], "--heads"),
    (["bench", "train", "--hidden", "30", "--heads", "4"], "--heads dividing --hidden"),
    (["bench", "train", "--arch", "mixtral", "--experts", "2", "--topk", "3"], "--topk from 1 to --experts"),
    (["preprocess", "--input", "a", "--output-prefix", ""], "must not be empty"),
    # cxxopts' "Argument 'two' failed to parse" names the option that carried it.
    (["convert", "--from", "hf", "a", "--to", "trestle", "b", "--tp", "two"], "--tp: 'two' is not a value it takes"),
    (["convert", "--from", "hf", "a", "--to", "trestle", "b", "--pp=x"], "--pp: 'x' is not a value it takes"),
    (["train", "--tensor-model-parallel-size", "x"], "--tensor-model-parallel-size: 'x' is not a value it takes"),
    (["bench", "kernels", "--threads", "abc"], "--threads: 'abc' is not a value it takes"),
    (["bench", "save", "--repeat", "abc"], "--repeat: 'abc' is not a value it takes"),
    # Empty paths were read as the current directory's nothing (exit 1).
    (["inspect", ""], "PATH is an empty path"),
    (["verify", ""], "PATH is an empty path"),
    (["verify", "ckpt", "--against", ""], "--against is an empty path"),
    (["diff", "a", ""], "B is an empty path"),
    # An option given twice with different values (a positional and its option too) was last-wins, silently.
    (["diff", "a", "b", "-b", "a"], "B (-b) given twice"),
    (["convert", "--from", "hf", "a", "--to", "trestle", "b", "--tp", "2", "--tp", "4"], "--tp given twice"),
    # Layout options that cannot apply: vpp or stage sizes without pipeline stages.
    (["convert", "--from", "hf", "a", "--to", "trestle", "b", "--vpp", "2"], "--vpp 2 needs --pp above 1"),
    (["convert", "--from", "hf", "a", "--to", "trestle", "b", "--first-stage-layers", "1"], "need --pp above 1"),
    # Options a conversion does not use were accepted and ignored.
    (["convert", "--from", "hf", "a", "--to", "hf", "b", "--tp", "2"], "--tp does not apply to hf -> hf"),
    (["convert", "--from", "hf", "a", "--to", "hf", "b", "--hf-expert-layout", "fused"],
     "--hf-expert-layout does not apply to hf -> hf"),
    (["convert", "--from", "hf", "a", "--to", "hf", "b", "--iteration", "3"], "--iteration does not apply"),
    (["convert", "--from", "hf", "a", "--to", "hf", "b", "--lr", "1e-3"], "--lr does not apply"),
    (["convert", "--from", "hf", "a", "--to", "trestle", "b", "--max-shard-size", "1GB"],
     "--max-shard-size does not apply to hf -> trestle"),
    (["convert", "--from", "trestle", "a", "--to", "hf", "b", "--codec", "zstd"], "--codec does not apply"),
    (["convert", "--from", "hf", "a", "--to", "trestle", "b", "--hf-config", "c"], "--hf-config does not apply"),
    (["convert", "--from", "megatron-dist", "a", "--to", "trestle", "b", "--make-vocab-size-divisible-by", "64"],
     "--make-vocab-size-divisible-by does not apply"),
    # A Megatron checkpoint keeps its layer-norm names: --norms was ignored for it.
    (["convert", "--from", "trestle", "a", "--to", "megatron-dist", "b", "--norms", "local"],
     "--norms does not apply to trestle -> megatron-dist: it sets the layer-norm names of a model converted from "
     "Hugging Face"),
    (["convert", "--from", "megatron-dist", "a", "--to", "trestle", "b", "--norms", "te"], "--norms does not apply"),
    (["preprocess", "--input", "a", "--output-prefix", "b", "--tokenizer-type", "bytes", "--json-keys", "text",
      "text"], "'text' given twice"),
    # A padding multiple of 2^62 times tp 4 wrapped to 0 and the padding divided by it (killed by SIGFPE).
    (["convert", "--from", "hf", "a", "--to", "megatron-dist", "b", "--tp", "4", "--make-vocab-size-divisible-by",
      str(2**62)], "--make-vocab-size-divisible-by must be an integer from 1 to 1073741824, not 4611686018427387904"),
    (["train", "--model-config", "a", *TRAIN_RUN, "--make-vocab-size-divisible-by", str(2**62)],
     "--make-vocab-size-divisible-by must be an integer from 1 to 1073741824"),
    (["train", "--model-config", "a", *TRAIN_RUN, "--padded-vocab-size", str(10**12)],
     "--padded-vocab-size 1000000000000 over the tensor-parallel size 1 must be an integer from 1 to 1073741824"),
    # The dataset cut a sample's length to an int32: 2^32 + 16 trained as 16.
    (["train", "--model-config", "a", *TRAIN_RUN, "--seq-length", str(2**32 + 16)],
     "--seq-length 4294967312 is more than the 2147483646 tokens a sample can hold"),
    (["train", "--model-config", "a", *TRAIN_RUN, "--exit-interval", "-1"], "--exit-interval -1 must not be negative"),
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


def test_a_zarr_dist_checkpoint_is_named_as_one(trestle, tmp_path):
    """Megatron's older 'zarr' sharded backend (metadata.json, no .metadata): refused saying so, from the root and from
    its iteration directory, not as a directory without a checkpoint."""
    root = tmp_path / "zarr"
    (root / "iter_0000001").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    (root / "iter_0000001" / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "zarr", "sharded_backend_version": 1, "common_backend": "torch",
         "common_backend_version": 1}))
    for source in (root, root / "iter_0000001"):
        check(trestle, 1, "convert", "--from", "megatron-dist", str(source), "--to", "hf", str(tmp_path / "out"),
              says="names Megatron's 'zarr' sharded backend, which Trestle does not read")


def test_corrupt_inputs_exit_1(trestle, tmp_path, corrupt):
    out = str(tmp_path / "out")
    for args, says in ((["inspect", corrupt["safetensors"]], "model.safetensors"),
                       (["convert", "--from", "hf", corrupt["hf"], "--to", "trestle", out],
                        f"{corrupt['hf'] / 'config.json'}: not valid JSON"),
                       (["convert", "--from", "hf", corrupt["hf"], "--to", "hf", out],
                        f"{corrupt['hf'] / 'config.json'}: not valid JSON"),
                       (["convert", "--from", "hf", corrupt["hf"] / "model.safetensors", "--to", "hf", out],
                        f"{corrupt['hf'] / 'model.safetensors'}: header is not valid JSON"),
                       (["import", "--from", "hdf5", corrupt["h5"], out], "file.h5"),
                       (["inspect", corrupt["ckpt"]], "manifest.json"),
                       (["verify", corrupt["ckpt"]], "manifest.json"),
                       (["export", "--to", "hdf5", corrupt["ckpt"], str(tmp_path / "x.h5")], "manifest.json"),
                       (["reshard", corrupt["ckpt"], out, "--tp", "2"], "manifest.json"),
                       (["diff", corrupt["ckpt"], corrupt["ckpt"]], "manifest.json")):
        check(trestle, 1, *args, says=str(says))


TRESTLE_READERS = [["verify", "{root}"], ["inspect", "{root}"], ["reshard", "{root}", "{out}", "--tp", "1"],
                   ["diff", "{root}", "{root}"], ["convert", "--from", "trestle", "{root}", "--to", "hf", "{out}"],
                   ["export", "{root}", "{out}.h5"]]


def tracked_root(tmp_path, tracker, manifest=True):
    """A Trestle root whose tracker holds `tracker` beside iter_0000000 (with a manifest.json, unreadable, when
    `manifest`): what a reader says about the tracker comes before the manifest is read."""
    root = tmp_path / "ckpt"
    (root / "iter_0000000").mkdir(parents=True)
    if manifest:
        (root / "iter_0000000" / "manifest.json").write_text('{"format": "trestle", "version": 1, "tensors": {')
    (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    return root


@pytest.mark.parametrize("args", TRESTLE_READERS, ids=lambda a: a[0])
@pytest.mark.parametrize("tracker, manifest, says", [
    ("500\n", True, "iteration 500 is not a committed checkpoint (committed: 0)"),
    ("0\n", False, "iteration 0 is not a committed checkpoint"),
    ("0\n1\n", True, "expected one iteration number"),
    ("-1\n", True, "expected one iteration number"),
    ("", True, "expected one iteration number"),
    ("99999999999999999999999\n", True, "(too large)"),
    ("0__0\n", True, "expected one iteration number"),
], ids=["missing-iteration", "no-manifest", "two-numbers", "negative", "empty", "huge", "double-underscore"])
def test_tracker_naming_no_committed_iteration(trestle, tmp_path, args, tracker, manifest, says):
    """Every command that reads a Trestle checkpoint says what is wrong with the tracker (some once said the
    directory was no checkpoint they recognise, or read "0\n1" as 0)."""
    root = tracked_root(tmp_path, tracker, manifest)
    args = [a.format(root=root, out=tmp_path / "out") for a in args]
    result = check(trestle, 1, *args, says=says)
    assert "recognises" not in result.stderr, result.stderr
    if "not a committed checkpoint" in says:
        assert f"{root / 'latest_checkpointed_iteration.txt'} names it" in result.stderr, result.stderr


@pytest.mark.parametrize("args", TRESTLE_READERS, ids=lambda a: a[0])
@pytest.mark.parametrize("holds", [".trestle_save.lock", ".tmp.iter_0000002.123-456"])
def test_a_root_before_its_first_commit_is_said_to_hold_none_yet(trestle, tmp_path, args, holds):
    """A root a trainer saves into before its first commit (its lock, a save's staging): inspect said it expected
    safetensors, verify, diff and reshard that it was no checkpoint they recognise; each says nothing is committed."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / holds).mkdir() if holds.startswith(".tmp") else (root / holds).write_text("host h, pid 1\n")
    args = [a.format(root=root, out=tmp_path / "out") for a in args]
    check(trestle, 1, *args, says=f"{root}: no latest_checkpointed_iteration.txt (no committed checkpoint here)")


@pytest.mark.parametrize("args", [["inspect", "{root}"], ["verify", "{root}"],
                                  ["convert", "--from", "megatron-legacy", "{root}", "--to", "hf", "{out}"]],
                         ids=lambda a: a[0])
@pytest.mark.parametrize("tracker", ["2\n", "release\n"])
def test_legacy_tracker_naming_a_missing_iteration_lists_the_saved_ones(trestle, tmp_path, args, tracker):
    """A legacy mp_rank tree whose tracker was torn ("20" cut to "2") was read as a Trestle root ("iteration 2 is not
    a committed checkpoint") or said "the tracker's iteration has no mp_rank_* directories": neither named the
    tracker nor what was saved, as the same damage in a torch_dist root does ("saved: iter_0000005")."""
    root = tmp_path / "legacy"
    for name in ["iter_0000020", "iter_0000010"]:
        (root / name / "mp_rank_00").mkdir(parents=True)
        (root / name / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    named = "iter_0000002: iteration 2" if tracker == "2\n" else "release: 'release'"
    result = check(trestle, 1, *[a.format(root=root, out=tmp_path / "out") for a in args],
                   says=f"{root / named}, which {root / 'latest_checkpointed_iteration.txt'} names")
    assert "saved: iter_0000010, iter_0000020)" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tracker", ["0", " +0 \n", "\t0\r\n", "0_0\n", "-0\n", "000\n"])
def test_tracker_whitespace_and_plus_are_read_as_megatron_reads_them(trestle, tmp_path, tracker):
    """int(text.strip()) in Megatron: the tracker is fine, so the reader gets to (the broken) manifest.json."""
    root = tracked_root(tmp_path, tracker)
    result = check(trestle, 1, "verify", root, says="manifest.json")
    assert "iteration number" not in result.stderr, result.stderr


@pytest.mark.parametrize("kind", ["fifo", "directory", "oversized", "link"])
@pytest.mark.parametrize("holds", ["trestle", "torch_dist", "legacy"])
def test_tracker_that_is_no_file_is_refused_not_waited_on(trestle, tmp_path, kind, holds):
    """A FIFO in place of the tracker blocked every reader forever (each opened it with a blocking ifstream); a
    directory or a file of megabytes there is no tracker either, nor a link to one elsewhere (followed before).
    Refused, naming the tracker, whatever the root holds beside it."""
    root = tracked_root(tmp_path, "0\n")
    if holds == "torch_dist":
        shutil.rmtree(root / "iter_0000000")
        (root / "iter_0000000").mkdir()
        (root / "iter_0000000" / ".metadata").write_bytes(b"")
    elif holds == "legacy":
        shutil.rmtree(root / "iter_0000000")
        (root / "iter_0000000" / "mp_rank_00").mkdir(parents=True)
    tracker = root / "latest_checkpointed_iteration.txt"
    tracker.unlink()
    if kind == "fifo":
        os.mkfifo(tracker)
        says = "not a regular file (a FIFO)"
    elif kind == "directory":
        tracker.mkdir()
        says = "not a regular file (a directory)"
    elif kind == "link":
        (tmp_path / "elsewhere.txt").write_text("0\n")
        tracker.symlink_to(tmp_path / "elsewhere.txt")
        says = "a symbolic link; a checkpoint's own directories and files are never links"
    else:
        tracker.write_text("0" + " " * (1 << 20))
        says = "more than the 4096 a file of this kind may have"
    for args in TRESTLE_READERS[:2] + [["convert", "--from", {"torch_dist": "megatron-dist", "legacy": "megatron-legacy"}.get(holds, holds),
                                        "{root}", "--to", "hf", "{out}"]]:
        args = [a.format(root=root, out=tmp_path / "out") for a in args]
        result = check(trestle, 1, *args, says=says)
        assert "latest_checkpointed_iteration.txt" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


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


LLAMA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("fifo", ["config.json", "model.safetensors", "tokenizer_config.json"])
def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(trestle, tmp_path, fifo):
    # Opening a FIFO for reading blocks until a writer comes; each reader refuses it before opening it.
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0, tokenizer_config={"model_max_length": 64})
    ckpt = tmp_path / "ckpt"
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", ckpt, "--quiet")
    (hf / fifo).unlink()
    os.mkfifo(hf / fifo)
    runs = [["convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "out", "--quiet"],
            ["convert", "--from", "hf", hf, "--to", "hf", tmp_path / "out_hf", "--quiet"]]
    if fifo != "tokenizer_config.json":  # (inspect and verify read no side file)
        runs += [["inspect", hf], ["verify", ckpt, "--against", hf]]
    for args in runs:
        result = trestle.run_raw(*args, timeout=30)
        assert result.returncode == 1, (args, result.returncode, result.stdout, result.stderr)
        assert f"{hf / fifo}: " in result.stderr and "not a regular file" in result.stderr, (args, result.stderr)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]  # no output, not even a partial one


def read_safetensors(path):
    """A safetensors file's header (parsed) and the bytes after it."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def packed_header(header):
    """The length prefix and JSON of a header, padded with spaces to 8 bytes as the format allows."""
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text


def test_a_tensor_larger_than_memory_is_refused_naming_it(trestle, tmp_path):
    # A sparse 8 TiB file whose embeddings are [2^34, 32] float32 (4 TiB each): no buffer holds one, no disk the copy.
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0)
    path = hf / "model.safetensors"
    header, data = read_safetensors(path)
    vocab, hidden, huge = 2**34, LLAMA["hidden_size"], ("model.embed_tokens.weight", "lm_head.weight")
    out, offset, body = {"__metadata__": {"format": "pt"}}, 0, bytearray()
    for name, entry in sorted((k, v) for k, v in header.items() if k != "__metadata__" and k not in huge):
        begin, end = entry["data_offsets"]
        out[name] = dict(entry, data_offsets=[offset, offset + end - begin])
        offset += end - begin
        body += data[begin:end]
    for name in huge:  # last, as a hole
        out[name] = {"dtype": "F32", "shape": [vocab, hidden], "data_offsets": [offset, offset + vocab * hidden * 4]}
        offset += vocab * hidden * 4
    prefix = packed_header(out)
    with open(path, "wb") as f:
        f.write(prefix + body)
        f.truncate(len(prefix) + offset)
    config = json.loads((hf / "config.json").read_text())
    config["vocab_size"] = vocab
    (hf / "config.json").write_text(json.dumps(config))
    refusals = {"trestle": "needs 2.00 TiB (2199023255552 bytes) in memory", "hf": "free on its file system"}
    for to, says in refusals.items():
        result = trestle.run_raw("convert", "--from", "hf", hf, "--to", to, tmp_path / "out", "--quiet", timeout=60)
        assert result.returncode == 1, (to, result.returncode, result.stdout, result.stderr[-2000:])
        assert says in result.stderr, (to, result.stderr)
        assert sorted(os.listdir(tmp_path)) == ["hf"], to  # no output, no partial one, no lock


def break_config(hf, how):
    (hf / "config.json").unlink()
    if how == "directory":
        (hf / "config.json").mkdir()
    elif how != "missing":
        (hf / "config.json").write_text(how)


@pytest.mark.parametrize("damage, names, says", [
    ("missing", "config.json", "config.json"),
    ("directory", "config.json", "config.json"),
    ("{oops", "config.json", "not valid JSON"),
    ("empty weight_map", "model.safetensors.index.json", "lists no tensors"),
    ("a shard left out", "model.safetensors.index.json", "does not list shard"),
])
def test_hf_to_hf_refuses_what_hf_to_trestle_refuses(trestle, tmp_path, damage, names, says):
    # hf -> hf once copied such a model through: without config.json, with '{oops' as its config, or 0 tensors of 9 shards.
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0, max_shard_size="20KB")
    index = hf / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    if damage == "empty weight_map":
        index.write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    elif damage == "a shard left out":
        last = max(weight_map.values())
        index.write_text(json.dumps({"weight_map": {k: v for k, v in weight_map.items() if v != last}}))
    else:
        break_config(hf, damage)
    for to in ("trestle", "hf"):
        result = trestle.run_raw("convert", "--from", "hf", hf, "--to", to, tmp_path / "out", "--quiet", timeout=60)
        assert result.returncode == 1, (to, result.returncode, result.stdout, result.stderr)
        assert f"{hf / names}" in result.stderr and says in result.stderr, (to, result.stderr)
        assert sorted(os.listdir(tmp_path)) == ["hf"], to  # no output, not even a partial one


def edit_tensor_entry(path, name, change):
    """Rewrites one entry of a .safetensors header in place (its data bytes unchanged)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    change(header, name)
    path.write_bytes(packed_header(header) + data[8 + length:])


@pytest.mark.parametrize("name, change, says", [
    ("model.norm.weight", lambda h, n: h[n].update(dtype="I32"), "must be floating point"),
    ("model.norm.weight", lambda h, n: h[n].update(shape=[4, 8]), "wrong shape: model.norm.weight is [4, 8]"),
    ("model.layers.0.mlp.down_proj.weight", lambda h, n: h[n].update(shape=h[n]["shape"][::-1]),
     "wrong shape: model.layers.0.mlp.down_proj.weight"),
    ("model.norm.weight", lambda h, n: h.update({"../../" + n: h.pop(n)}), "not consumed by the mapping: ../../"),
], ids=["integer", "reshaped", "transposed", "renamed"])
def test_hf_to_hf_refuses_weights_hf_to_trestle_refuses(trestle, tmp_path, name, change, says):
    """hf -> hf copied such weights through (exit 0), where hf -> trestle refused them: both check the model's tensors."""
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0)
    edit_tensor_entry(hf / "model.safetensors", name, change)
    for to in ("trestle", "hf"):
        result = trestle.run_raw("convert", "--from", "hf", hf, "--to", to, tmp_path / "out", "--dtype", "fp32",
                                 "--quiet", timeout=60)
        assert result.returncode == 1 and says in result.stderr, (to, result.returncode, result.stderr)
        assert sorted(os.listdir(tmp_path)) == ["hf"], to


EVIL = "evil\x1b[2J\x1b[31mRED\nfake line\x07\r\x9b1m"
EVIL_PRINTED = "evil\\x1b[2J\\x1b[31mRED\\nfake line\\x07\\r\\xc2\\x9b1m"


def assert_printable(text):
    # One line per line of output, and nothing a terminal acts on: no control character but the newline ending a line.
    bad = sorted({hex(ord(c)) for c in text if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) < 0xa0})
    assert not bad, (bad, text)
    assert not any(line.startswith("fake line") for line in text.splitlines()), text


def test_control_characters_in_names_are_escaped_in_inspect(trestle, tmp_path):
    import numpy as np
    from safetensors.numpy import save_file
    path = tmp_path / "m\x1b[31m.safetensors"
    save_file({EVIL: np.zeros(4, dtype=np.float32), "plain": np.ones(2, dtype=np.float32)}, str(path))
    out = trestle.run("inspect", path)
    assert_printable(out)
    assert EVIL_PRINTED in out and "m\\x1b[31m.safetensors" in out, out
    report = json.loads(trestle.run("inspect", path, "--json"))  # JSON escapes on its own: the name comes back whole
    assert sorted(t["name"] for t in report["tensors"]) == sorted([EVIL, "plain"])


def test_control_characters_in_names_are_escaped_in_errors(trestle, tmp_path):
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0)
    path = hf / "model.safetensors"
    header, data = read_safetensors(path)
    header[EVIL] = header.pop("model.norm.weight")
    path.write_bytes(packed_header(header) + data)
    result = trestle.run_raw("convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "out", "--quiet")
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert_printable(result.stderr)
    assert EVIL_PRINTED in result.stderr and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("command", ["convert", "reshard"])
def test_an_empty_destination_directory_keeps_its_permissions_and_group(trestle, tmp_path, command):
    """An empty directory prepared for the output (private, setgid) was replaced by a new one of the default mode."""
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2), seed=0)
    source = tmp_path / "ckpt"
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", source, "--quiet")
    out = tmp_path / "prepared"
    out.mkdir()
    os.chmod(out, 0o2750)
    group = os.stat(out).st_gid
    if command == "convert":
        trestle.run("convert", "--from", "trestle", source, "--to", "hf", out, "--quiet")
        assert (out / "model.safetensors").is_file()
    else:
        trestle.run("reshard", source, out, "--tp", "2", "--quiet")
        assert (out / "latest_checkpointed_iteration.txt").is_file()
    mode = os.stat(out).st_mode & 0o7777
    assert mode == 0o2750, oct(mode)
    assert os.stat(out).st_gid == group


def test_a_dry_run_of_hf_to_hf_writes_nothing(trestle, tmp_path):
    """hf -> hf ignored --dry-run and wrote the whole output."""
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0)
    printed = trestle.run("convert", "--from", "hf", hf, "--to", "hf", tmp_path / "out", "--dry-run")
    assert "nothing written (--dry-run)" in printed and "21 tensors" in printed, printed
    assert not (tmp_path / "out").exists()


def test_a_dry_run_refuses_the_destination_the_run_would(trestle, tmp_path):
    """--dry-run checks the destination as the run does: a non-empty directory, a file or a path inside the source is
    refused (exit 1, naming it) where the dry run said 0 and the run then failed; a fresh path plans and writes
    nothing."""
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0)
    ckpt = tmp_path / "ckpt"
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", ckpt, "-q")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    commands = [["convert", "--from", "hf", hf, "--to", "trestle", "{dst}", "--tp", "2"],
                ["convert", "--from", "hf", hf, "--to", "hf", "{dst}"],
                ["convert", "--from", "hf", hf, "--to", "megatron-dist", "{dst}"],
                ["convert", "--from", "trestle", ckpt, "--to", "hf", "{dst}"],
                ["convert", "--from", "trestle", ckpt, "--to", "megatron-dist", "{dst}"],
                ["reshard", ckpt, "{dst}", "--tp", "2"]]
    for command in commands:
        source = command[3] if command[0] == "convert" else command[1]
        for dst, says in [(tmp_path / "full", "destination exists and is not an empty directory"),
                          (tmp_path / "file", "destination exists and is not an empty directory"),
                          (source / "inside", "lies inside the source")]:
            args = [dst if a == "{dst}" else a for a in command] + ["--dry-run"]
            result = check(trestle, 1, *args)
            assert says in result.stderr and str(dst) in result.stderr, (args, result.stderr)
        fresh = tmp_path / "fresh"
        check(trestle, 0, *[fresh if a == "{dst}" else a for a in command], "--dry-run")
        assert not fresh.exists() and not (source / "inside").exists(), command
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and (tmp_path / "file").read_text() == "mine"


def test_a_piece_larger_than_memory_fails_naming_its_tensor_not_aborting(trestle, tmp_path):
    # The torch_dist writer's threads allocate each rank file's pieces: a padded vocabulary of 10^8 rows (an
    # embedding piece of 12.8 GB at hidden 32) threw std::bad_alloc on a writer thread, and the process aborted
    # ("terminate called"), leaving its partial output and lock behind.
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0)

    def limit_memory():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    result = subprocess.run([str(trestle.path), "convert", "--from", "hf", str(hf), "--to", "megatron-dist",
                             str(tmp_path / "out"), "--make-vocab-size-divisible-by", str(10**8), "--quiet"],
                            capture_output=True, text=True, timeout=120, preexec_fn=limit_memory)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert "out of memory: tensor 'embedding.word_embeddings.weight' needs a piece of 12800000000 bytes" in \
        result.stderr, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no output, no partial one, no lock


def test_a_run_whose_micro_batch_cannot_fit_is_refused_naming_its_flags(trestle, tmp_path):
    # One micro-batch of 10^9 tokens at hidden 64 holds 238 GiB of hidden states: it ended in a bare "out of memory"
    # after allocating.
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0)
    args = [a for a in TRAIN_RUN if a not in ("--seq-length", "16")]
    result = trestle.run_raw("train", "--model-config", hf / "config.json", *args, "--seq-length", 10**9,
                             timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert "--seq-length 1000000000 x --micro-batch-size 1 at hidden size" in result.stderr, result.stderr
    assert "one micro-batch's hidden states alone take" in result.stderr, result.stderr


def test_the_regularisers_a_config_sets_are_named_not_dropped_silently(trestle, tmp_path):
    # transformers trains with attention_dropout, Phi-3's resid_pdrop and Mixtral's router_jitter_noise; Trestle
    # trains without them, which it said of the flags (--attention-dropout 0.1 is refused) but not of config.json.
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0)
    config = json.loads((hf / "config.json").read_text())
    config.update(attention_dropout=0.5, resid_pdrop=0.1)
    (hf / "config.json").write_text(json.dumps(config))
    result = trestle.run_raw("train", "--model-config", hf / "config.json", *TRAIN_RUN, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("sets attention_dropout 0.5, resid_pdrop 0.1: Trestle trains without dropout and router jitter"
            in result.stdout), result.stdout
    # A dropout the command line sets to 0 is the user's choice: left out of the note.
    result = trestle.run_raw("train", "--model-config", hf / "config.json", *TRAIN_RUN, "--attention-dropout", "0",
                             timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sets resid_pdrop 0.1: Trestle trains" in result.stdout, result.stdout

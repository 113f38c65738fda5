"""HDF5 interchange checked with h5py: files h5py writes in Trestle's layout are imported, exported again, and h5py
reads back the same arrays bit for bit (bf16 and fp8 as raw bits with a dtype attribute, f16 natively); a converted
model's export carries its hf_files back on import (and each tensor's digest, checked there), and files edited with h5py (data never written, tensors missing,
cut, added or oversized, carried files renamed or changed) are refused naming the file and dataset."""
import json
import os
import shutil
import subprocess

import h5py
import numpy as np
import pytest
import torch
import xxhash

TRESTLE = os.environ.get("TRESTLE_BIN", "trestle")

# Trestle dtype -> (how h5py stores it, how to make random values of it)
DTYPES = {
    "f32": np.float32, "f64": np.float64, "f16": np.float16, "i8": np.int8, "i16": np.int16, "i32": np.int32,
    "i64": np.int64, "u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "u64": np.uint64,
}


def random_array(dtype, shape, rng):
    if dtype in ("bf16",):
        return torch.randn(shape, generator=rng).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    if dtype in ("f8_e4m3", "f8_e5m2"):
        torch_dtype = torch.float8_e4m3fn if dtype == "f8_e4m3" else torch.float8_e5m2
        return torch.randn(shape, generator=rng).to(torch_dtype).view(torch.uint8).numpy()
    if dtype == "bool":
        return (torch.rand(shape, generator=rng) > 0.5).numpy().astype(np.uint8)
    np_dtype = DTYPES[dtype]
    if np.issubdtype(np_dtype, np.floating):
        return torch.randn(shape, generator=rng, dtype=torch.float64).numpy().astype(np_dtype)
    info = np.iinfo(np_dtype)
    return np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=rng))).integers(
        info.min, info.max, size=shape, dtype=np_dtype, endpoint=True)


def run(*args):
    result = subprocess.run([TRESTLE, *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def source_file(tmp_path):
    rng = torch.Generator().manual_seed(3)
    arrays = {}
    shapes = [(7, 5), (3,), (), (0, 4), (2, 3, 4)]
    names = list(DTYPES) + ["bf16", "f8_e4m3", "f8_e5m2", "bool"]
    path = tmp_path / "source.h5"
    with h5py.File(path, "w") as f:
        header = {"format": "trestle", "version": 1, "iteration": 42, "world_size": 2,
                  "layout": {"tp": 2, "pp": 1, "vpp": 1, "dp": 1, "ep": 1, "cp": 1},
                  "model": {"architecture": "test"}, "training": {"consumed_samples": 1234, "ranks": [{"rng": 1}, {"rng": 2}]}}
        f.attrs.create("trestle_manifest", np.bytes_(json.dumps(header)))
        for i, dtype in enumerate(names):
            for j, shape in enumerate(shapes):
                name = f"decoder.layers.{i}.t{j}.{dtype}"
                arrays[name] = (dtype, random_array(dtype, shape, rng))
                d = f.create_dataset(name, data=arrays[name][1])
                d.attrs.create("dtype", np.bytes_(dtype))
    return path, arrays


def test_import_then_export_is_bit_exact(tmp_path, source_file):
    path, arrays = source_file
    root = tmp_path / "ckpt"
    run("import", "--from", "hdf5", str(path), str(root))
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "42"
    run("verify", str(root))
    out = tmp_path / "exported.h5"
    run("export", "--to", "hdf5", str(root), str(out))
    with h5py.File(out, "r") as f:
        assert sorted(f.keys()) == sorted(arrays)
        for name, (dtype, expected) in arrays.items():
            got = f[name][()]
            assert f[name].attrs["dtype"].decode() == dtype
            assert got.dtype.itemsize == expected.dtype.itemsize, name
            assert got.shape == expected.shape, name
            assert got.tobytes() == expected.tobytes(), name
            if dtype == "f16":
                assert got.dtype == np.float16  # h5py sees a native half
        header = json.loads(f.attrs["trestle_manifest"])
        assert header["iteration"] == 42
        assert header["layout"]["tp"] == 2
        assert header["training"]["consumed_samples"] == 1234
        assert header["training"]["ranks"] == [{"rng": 1}, {"rng": 2}]
    # bf16 values reinterpret to the same floats torch had
    name = next(n for n in arrays if n.endswith("t0.bf16"))
    with h5py.File(out, "r") as f:
        bits = f[name][()]
    assert torch.equal(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16),
                       torch.from_numpy(arrays[name][1].view(np.int16)).view(torch.bfloat16))


def test_inspect_shows_imported_checkpoint(tmp_path, source_file):
    path, arrays = source_file
    root = tmp_path / "ckpt"
    run("import", "--from", "hdf5", str(path), str(root))
    info = json.loads(run("inspect", "--json", str(root)))
    assert info["format"] == "trestle"
    assert info["iteration"] == 42
    assert info["totals"]["tensors"] == len(arrays)
    by_name = {t["name"]: t for t in info["tensors"]}
    for name, (dtype, array) in arrays.items():
        assert by_name[name]["dtype"] == dtype
        assert by_name[name]["global_shape"] == list(array.shape)


def test_import_rejects_files_without_trestle_header(tmp_path):
    path = tmp_path / "plain.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros(3))
    result = subprocess.run([TRESTLE, "import", "--from", "hdf5", str(path), str(tmp_path / "ckpt")],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "trestle_manifest" in result.stderr and str(path) in result.stderr
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


# --- files `trestle export` wrote from a converted model, edited with h5py the way a torn or hostile file would be ---

EMBEDDING = "embedding.word_embeddings.weight"  # [256, 64] f32 in the model below


@pytest.fixture(scope="module")
def exported_model(tmp_path_factory):
    """A tiny Llama converted to Trestle (carrying hf_files/generation_config.json) and exported to HDF5."""
    from models import save_tiny_model
    base = tmp_path_factory.mktemp("exported")
    save_tiny_model(base / "hf", "LlamaConfig", dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
                    seed=0)
    run("convert", "-q", "--from", "hf", str(base / "hf"), "--to", "trestle", str(base / "ckpt"))
    run("export", "--to", "hdf5", str(base / "ckpt"), str(base / "ckpt.h5"))
    return base


def import_raw(path, root):
    return subprocess.run([TRESTLE, "import", "--from", "hdf5", str(path), str(root)], capture_output=True, text=True)


def edited_copy(exported_model, tmp_path, edit, drop_tensor_list=False):
    path = tmp_path / "edited.h5"
    path.write_bytes((exported_model / "ckpt.h5").read_bytes())
    with h5py.File(path, "r+") as f:
        if drop_tensor_list:  # leaves the model description as the only record of what the file must hold
            header = json.loads(f.attrs["trestle_manifest"])
            del header["tensors"]
            f.attrs["trestle_manifest"] = np.bytes_(json.dumps(header))
            del f.attrs["trestle_manifest_xxh3_64"]  # a header rewritten by h5py's user has no digest
        edit(f)
    return path


def assert_refused(path, tmp_path, *words):
    result = import_raw(path, tmp_path / "out")
    assert result.returncode == 1, result.stdout + result.stderr
    for word in (str(path),) + words:
        assert word in result.stderr, result.stderr
    assert not (tmp_path / "out" / "latest_checkpointed_iteration.txt").exists()
    return result.stderr


def replace_embedding(f, **dataset_args):
    del f[EMBEDDING]
    d = f.create_dataset(EMBEDDING, **dataset_args)
    d.attrs["dtype"] = np.bytes_(b"f32")


def test_a_changed_value_fails_its_digest_on_import(exported_model, tmp_path):
    """HDF5 keeps no checksums: export records each tensor's xxh3-64, so one value changed in the file is refused on
    import, naming the dataset, and nothing is written (it was imported, and the new checkpoint's checksums certified
    it): the root the import created is removed (it was left empty), a root that was there is kept."""
    damaged = tmp_path / "damaged.h5"
    shutil.copy(exported_model / "ckpt.h5", damaged)
    with h5py.File(damaged, "r+") as f:
        f[EMBEDDING][3, 5] = f[EMBEDDING][3, 5] + 1
    result = subprocess.run([TRESTLE, "import", "--from", "hdf5", str(damaged), str(tmp_path / "back")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert f"dataset '{EMBEDDING}': its data differ from the digest trestle_manifest records" in result.stderr
    assert not (tmp_path / "back").exists()
    (tmp_path / "mine").mkdir()
    result = subprocess.run([TRESTLE, "import", "--from", "hdf5", str(damaged), str(tmp_path / "mine")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and (tmp_path / "mine").is_dir(), (result.stdout, result.stderr)
    assert not (tmp_path / "mine" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_a_truncated_file_is_named_as_one(exported_model, tmp_path, keep):
    """A torn export (cut short by a full disk or a failed copy) is told apart from a file of another kind."""
    data = (exported_model / "ckpt.h5").read_bytes()
    torn = tmp_path / "torn.h5"
    torn.write_bytes(data[:int(len(data) * keep)])
    message = assert_refused(torn, tmp_path)
    assert "not an HDF5 file" not in message and "truncated or damaged" in message, message
    other = tmp_path / "other.h5"
    other.write_bytes(b"\x00" * 4096)
    assert "not an HDF5 file (no HDF5 signature)" in assert_refused(other, tmp_path)


def test_export_import_round_trip_carries_files(exported_model, tmp_path):
    carried = exported_model / "ckpt" / "iter_0000000" / "hf_files" / "generation_config.json"
    with h5py.File(exported_model / "ckpt.h5", "r") as f:
        header = json.loads(f.attrs["trestle_manifest"])
        digest = xxhash.xxh3_64_hexdigest(f[EMBEDDING][()].tobytes())  # each tensor's, which import checks
        assert header["tensors"][EMBEDDING] == {"dtype": "f32", "global_shape": [256, 64], "xxh3_64": digest}
        files = {d.attrs["name"].decode(): d[()].tobytes() for d in f["trestle_files"].values()}
    assert files == {"hf_files/generation_config.json": carried.read_bytes()}
    run("import", "--from", "hdf5", str(exported_model / "ckpt.h5"), str(tmp_path / "back"))
    assert (tmp_path / "back" / "iter_0000000" / "hf_files" / "generation_config.json").read_bytes() == carried.read_bytes()
    run("verify", str(tmp_path / "back"))
    run("diff", "-q", str(exported_model / "ckpt"), str(tmp_path / "back"))


@pytest.mark.parametrize("chunks", [(64, 64), (2**16,)])
def test_import_refuses_datasets_never_written(exported_model, tmp_path, chunks):
    shape = (256, 64) if len(chunks) == 2 else (2**28,)  # the second declares 1 GiB in a file of a few hundred KiB
    path = edited_copy(exported_model, tmp_path, lambda f: replace_embedding(f, shape=shape, dtype="f4", chunks=chunks))
    assert_refused(path, tmp_path, EMBEDDING, "never written")


def test_import_refuses_partly_written_dataset(exported_model, tmp_path):
    def edit(f):
        replace_embedding(f, shape=(256, 64), dtype="f4", chunks=(64, 64))
        f[EMBEDDING][:64] = np.ones((64, 64), "f4")
    assert_refused(edited_copy(exported_model, tmp_path, edit), tmp_path, EMBEDDING, "never written")


def test_import_refuses_huge_declared_dataset(exported_model, tmp_path):
    path = edited_copy(exported_model, tmp_path,
                       lambda f: replace_embedding(f, shape=(2**40,), dtype="f4", chunks=(1024,)))
    assert "bad_alloc" not in assert_refused(path, tmp_path, EMBEDDING, "never written")


def test_import_reads_compressed_datasets(exported_model, tmp_path):
    with h5py.File(exported_model / "ckpt.h5", "r") as f:
        data = f[EMBEDDING][()]
    path = edited_copy(exported_model, tmp_path,
                       lambda f: replace_embedding(f, data=data, compression="gzip", chunks=(64, 32)))
    run("import", "--from", "hdf5", str(path), str(tmp_path / "back"))
    run("diff", "-q", str(exported_model / "ckpt"), str(tmp_path / "back"))


def outside_file(tmp_path, fifo=False):
    """A file beside the HDF5 file, holding the embedding's bytes (or a FIFO, whose read would block)."""
    outside = tmp_path / "outside.bin"
    if fifo:
        os.mkfifo(outside)
    else:
        outside.write_bytes(np.ones((256, 64), "f4").tobytes())
    return str(outside)


@pytest.mark.parametrize("kind", ["external_storage", "external_fifo", "external_link", "soft_link"])
def test_import_reads_nothing_from_outside_the_file(exported_model, tmp_path, kind):
    """A dataset whose raw data HDF5 keeps in another file (external storage, a FIFO there too), or a link to a dataset
    in another file or elsewhere in this one, is refused naming it: nothing outside the file is read (nor waited on)."""
    if kind == "external_link":
        with h5py.File(tmp_path / "other.h5", "w") as g:
            g.create_dataset("x", data=np.ones((256, 64), "f4")).attrs["dtype"] = np.bytes_(b"f32")

    def edit(f):
        if kind.startswith("external_") and kind != "external_link":
            outside = outside_file(tmp_path, fifo=kind == "external_fifo")
            replace_embedding(f, shape=(256, 64), dtype="f4", external=[(outside, 0, 256 * 64 * 4)])
        elif kind == "external_link":
            del f[EMBEDDING]
            f[EMBEDDING] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/x")
        else:
            f.move(EMBEDDING, "moved")
            f[EMBEDDING] = h5py.SoftLink("/moved")
    path = edited_copy(exported_model, tmp_path, edit)
    words = {"external_storage": "external files", "external_fifo": "external files", "external_link": "external link",
             "soft_link": "soft link"}[kind]
    result = subprocess.run([TRESTLE, "import", "--from", "hdf5", str(path), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and EMBEDDING in result.stderr and words in result.stderr, result.stderr
    assert not (tmp_path / "out" / "latest_checkpointed_iteration.txt").exists()


def cut_embedding(f):
    replace_embedding(f, data=f[EMBEDDING][:255])


def compressed_oversized_embedding(f):
    replace_embedding(f, data=np.zeros((4096, 64), "f4"), compression="gzip")


def extra_dataset(f):
    f.create_dataset("evil", data=np.zeros(3, "f4")).attrs["dtype"] = np.bytes_(b"f32")


# edit, what the error names when the file lists its tensors, and when only the model description is left
TENSOR_EDITS = {
    "missing": (lambda f: f.__delitem__(EMBEDDING), [EMBEDDING, "missing", "[256,64]"], ["missing: " + EMBEDDING]),
    "cut": (cut_embedding, [EMBEDDING, "[255,64]", "[256,64]"], ["wrong shape", EMBEDDING, "[255, 64]", "[256, 64]"]),
    "compressed_oversized": (compressed_oversized_embedding, [EMBEDDING, "[4096,64]", "[256,64]"],
                             ["wrong shape", EMBEDDING, "[4096, 64]"]),
    "extra": (extra_dataset, ["'evil'", "not one of the tensors"], ["evil", "neither weights"]),
}


@pytest.mark.parametrize("drop_tensor_list", [False, True], ids=["listed", "model_description"])
@pytest.mark.parametrize("edit", sorted(TENSOR_EDITS))
def test_import_checks_every_expected_tensor(exported_model, tmp_path, edit, drop_tensor_list):
    change, listed_words, model_words = TENSOR_EDITS[edit]
    path = edited_copy(exported_model, tmp_path, change, drop_tensor_list)
    assert_refused(path, tmp_path, *(model_words if drop_tensor_list else listed_words))


def test_import_checks_the_model_description_when_the_list_agrees(exported_model, tmp_path):
    def edit(f):  # a consistent lie: the list is changed along with the dataset
        cut_embedding(f)
        header = json.loads(f.attrs["trestle_manifest"])
        header["tensors"][EMBEDDING]["global_shape"] = [255, 64]
        f.attrs["trestle_manifest"] = np.bytes_(json.dumps(header))
        del f.attrs["trestle_manifest_xxh3_64"]  # (which would name the lie first)
    assert_refused(edited_copy(exported_model, tmp_path, edit), tmp_path, "conversion accounting failed", EMBEDDING)


def set_file_name(name):
    return lambda f: f["trestle_files/0"].attrs.__setitem__("name", np.bytes_(name.encode()))


def change_file_bytes(f):
    data = f["trestle_files/0"][()]
    data[0] ^= 1
    f["trestle_files/0"][...] = data


@pytest.mark.parametrize("edit, words", [
    (set_file_name("../generation_config.json"), ["trestle_files/0", ".."]),
    (set_file_name("hf_files/other.json"), ["hf_files/other.json", "not recorded"]),
    (change_file_bytes, ["hf_files/generation_config.json", "digest"]),
    (lambda f: f.__delitem__("trestle_files"), ["hf_files/generation_config.json", "not carried"]),
], ids=["dotdot", "unrecorded", "changed", "dropped"])
def test_import_checks_carried_files(exported_model, tmp_path, edit, words):
    assert_refused(edited_copy(exported_model, tmp_path, edit), tmp_path, *words)


# --- a failed or killed export, and an import into an iteration the root already holds ---

def temporaries(out):
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp."))


def run_with_faults(args, **faults):
    """The command with the fault hooks of ckpt/fault_point.h set (kill_point=N: TRESTLE_TEST_KILL_POINT=N); the result
    also carries the process id."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRESTLE_TEST_")}
    env.update({f"TRESTLE_TEST_{name.upper()}": str(value) for name, value in faults.items()})
    with subprocess.Popen([TRESTLE, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as process:
        stdout, stderr = process.communicate(timeout=120)
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    result.pid = process.pid
    return result


def test_killed_or_failed_export_leaves_no_temporary(exported_model, tmp_path):
    """A killed export left its whole-size .OUT.h5.tmp.PID beside the output and no later export removed it; a failing
    one left its partial file. The next export removes dead runs' temporaries, a failing one removes its own, and the
    output already there is untouched until the rename, which comes after the file is synced."""
    out = tmp_path / "out.h5"
    args = ["export", "--to", "hdf5", exported_model / "ckpt", out]
    trace = tmp_path / "trace.txt"
    assert run_with_faults(args, kill_trace=trace).returncode == 0
    assert trace.read_text().splitlines() == ["fsync", "rename", "fsync directory"]
    before = out.read_bytes()
    for point in (1, 2):  # killed at the sync and at the rename: the output as it was, the dead run's file beside it
        killed = run_with_faults(args, kill_point=point)
        assert killed.returncode == -9
        assert out.read_bytes() == before
        assert temporaries(out) == [f".out.h5.tmp.{killed.pid}"]  # the earlier dead run's went when this one started
    run(*args)
    assert temporaries(out) == []
    before = out.read_bytes()
    for point in (1, 2):  # the sync or the rename fails
        result = run_with_faults(args, fail_point=point)
        assert result.returncode == 1 and "injected fault" in result.stderr, result.stderr
        assert out.read_bytes() == before and temporaries(out) == []

    broken = tmp_path / "broken"  # fails halfway: a rank file's tensor data has a flipped bit
    shutil.copytree(exported_model / "ckpt", broken)
    rank_file = broken / "iter_0000000" / "rank_00000.bin"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 1
    rank_file.write_bytes(data)
    result = subprocess.run([TRESTLE, "export", "--to", "hdf5", str(broken), str(out)], capture_output=True, text=True)
    assert result.returncode == 1 and "checksum mismatch" in result.stderr, result.stderr
    assert out.read_bytes() == before and temporaries(out) == []


def test_export_refuses_a_link_or_directory_as_its_output(exported_model, tmp_path):
    """export replaced a symbolic link with its file (the link's target untouched): refused, as convert refuses such
    destinations; so is a directory."""
    target = tmp_path / "target.h5"
    target.write_bytes(b"not an export")
    link = tmp_path / "link.h5"
    link.symlink_to(target)
    (tmp_path / "dir.h5").mkdir()
    for out, says in ((link, "is a symbolic link"), (tmp_path / "dir.h5", "exists and is not a regular file")):
        result = subprocess.run([TRESTLE, "export", "--to", "hdf5", str(exported_model / "ckpt"), str(out)],
                                capture_output=True, text=True)
        assert result.returncode == 1 and f"{out}: {says}" in result.stderr, result.stderr
    assert link.is_symlink() and target.read_bytes() == b"not an export"


def test_import_into_an_existing_iteration_is_refused_before_writing(exported_model, tmp_path):
    """Importing into a root that already held the iteration read and wrote every tensor, then failed at the commit
    advising "save with overwrite", which import does not have. Refused before any write, saying what import can do."""
    root = tmp_path / "root"
    source = exported_model / "ckpt.h5"
    run("import", "--from", "hdf5", str(source), str(root))
    listing = sorted(root.rglob("*"))
    trace = tmp_path / "trace.txt"
    result = run_with_faults(["import", "--from", "hdf5", source, root], kill_trace=trace)
    assert result.returncode == 1, result.stderr
    assert f"{root / 'iter_0000000'}: iteration 0 already exists" in result.stderr, result.stderr
    assert "--iteration" in result.stderr and "overwrite" not in result.stderr, result.stderr
    assert not trace.exists() or trace.read_text() == "", trace.read_text()  # no write, sync or rename step reached
    assert sorted(root.rglob("*")) == listing
    run("import", "--from", "hdf5", str(source), str(root), "--iteration", "7")
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "7"
    run("diff", "-q", str(exported_model / "ckpt"), str(root))
    # An older iteration than the tracked one would move the tracker back (a --load would resume from it): refused.
    older = subprocess.run([TRESTLE, "import", "--from", "hdf5", str(source), str(root), "--iteration", "3"],
                           capture_output=True, text=True)
    assert older.returncode == 1 and "tracker names iteration 7, newer than 3" in older.stderr, older.stderr
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "7"
    assert not (root / "iter_0000003").exists()


def test_an_import_killed_between_its_commit_and_the_tracker_is_finished_by_running_it_again(exported_model, tmp_path):
    """Killed after iter_N was renamed into place but before the tracker moved there, an import left the root tracking
    the older iteration, and running it again was refused ("already exists"): the tracker never reached the import
    and the dead run's lock stayed. Running it again now imports it in that iteration's place and moves the tracker;
    killed after the tracker moved, the iteration is committed and a re-run is refused, but removes the dead run's
    leftovers."""
    source = exported_model / "ckpt.h5"
    root = tmp_path / "root"
    run("import", "--from", "hdf5", str(source), str(root), "--iteration", "3")
    trace = tmp_path / "trace.txt"
    run_with_faults(["import", "--from", "hdf5", source, tmp_path / "probe"], kill_trace=trace)
    steps = trace.read_text().splitlines()
    for step, tracked, rerun in (("update tracker", "3", 0), ("committed", "40", 1)):
        killed = run_with_faults(["import", "--from", "hdf5", source, root, "--iteration", 40],
                                 kill_point=steps.index(step) + 1)
        assert killed.returncode == -9, killed.stderr
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == tracked
        assert (root / "iter_0000040" / "manifest.json").exists()
        assert any(p.name.startswith(".tmp.iter_0000040.") for p in root.iterdir())
        again = subprocess.run([TRESTLE, "import", "--from", "hdf5", str(source), str(root), "--iteration", "40"],
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == rerun, again.stdout + again.stderr
        if rerun == 0:
            assert "killed before it moved the tracker there: importing it again, in its place" in again.stdout
        else:
            assert "iteration 40 already exists" in again.stderr, again.stderr
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "40"
        assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []
        run("verify", str(root))
        run("diff", "-q", str(exported_model / "ckpt"), str(root))
        shutil.rmtree(root / "iter_0000040")
        (root / "latest_checkpointed_iteration.txt").write_text("3\n")


def test_an_import_beside_a_job_saving_into_the_root_is_refused(exported_model, tmp_path):
    """An import into a root a trainer was saving into moved the tracker under the trainer (which later saved over the
    imported iteration, or moved the tracker back): it takes the root's save lock as the trainer does, and is refused
    naming the holder while one lives, leaving the root as it was."""
    import fcntl
    root = tmp_path / "root"
    run("import", "--from", "hdf5", str(exported_model / "ckpt.h5"), str(root), "--iteration", "3")
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    with open(root / ".trestle_save.lock", "w") as held:  # (a trainer holds it so for its whole run)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("host elsewhere, pid 4242\n")
        held.flush()
        refused = subprocess.run([TRESTLE, "import", "--from", "hdf5", str(exported_model / "ckpt.h5"), str(root),
                                  "--iteration", "7"], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1 and f"{root}: another job is saving checkpoints here (host elsewhere, pid " \
            "4242, holding" in refused.stderr, refused.stderr
        assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == sorted(before + [".trestle_save.lock"])
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    (root / ".trestle_save.lock").unlink()
    run("import", "--from", "hdf5", str(exported_model / "ckpt.h5"), str(root), "--iteration", "7")
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "7"
    after = {str(p.relative_to(root)) for p in root.rglob("*")}
    assert {p for p in after if not p.startswith("iter_0000007")} == set(before)  # (the lock released and removed)


def test_a_second_export_into_the_same_file_is_refused(exported_model, tmp_path):
    """Two exports into one file both reported success, the later one's file replacing the other's: an export holds
    <dir>/.<name>.lock while it writes, and another is refused naming it."""
    import fcntl
    with open(tmp_path / ".out.h5.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        refused = subprocess.run([TRESTLE, "export", "--to", "hdf5", str(exported_model / "ckpt"),
                                  str(tmp_path / "out.h5")], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1 and f"{tmp_path / 'out.h5'}: another job is writing it (it holds " \
            f"{tmp_path / '.out.h5.lock'})" in refused.stderr, refused.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == [".out.h5.lock"]
    run("export", "--to", "hdf5", str(exported_model / "ckpt"), str(tmp_path / "out.h5"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.h5"]


def test_verify_and_export_take_an_iteration_directory(exported_model, tmp_path):
    """`verify ROOT/iter_N` and `export ROOT/iter_N` were refused ("no latest_checkpointed_iteration.txt") where convert
    and inspect take the iteration directory."""
    it = exported_model / "ckpt" / "iter_0000000"
    assert "ok: " in run("verify", str(it))
    run("export", "--to", "hdf5", str(it), str(tmp_path / "it.h5"))
    run("import", "--from", "hdf5", str(tmp_path / "it.h5"), str(tmp_path / "back"))
    run("diff", "-q", str(exported_model / "ckpt"), str(tmp_path / "back"))
    other = subprocess.run([TRESTLE, "verify", str(it), "--iteration", "5"], capture_output=True, text=True)
    assert other.returncode == 1 and "iteration" in other.stderr, other.stderr


def test_export_never_writes_into_its_source(exported_model, tmp_path):
    """export overwrote the tracker, the manifest or a data file of the checkpoint it read when told to write there:
    an output inside the iteration directory or the checkpoint directory is refused, and nothing changes."""
    source = tmp_path / "ckpt"
    shutil.copytree(exported_model / "ckpt", source)
    before = {p: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    for out in (source / "latest_checkpointed_iteration.txt", source / "iter_0000000" / "manifest.json",
                source / "iter_0000000" / "rank_00000.bin", source / "new.h5"):
        result = subprocess.run([TRESTLE, "export", "--to", "hdf5", str(source), str(out)], capture_output=True,
                                text=True)
        assert result.returncode == 1 and "the source is never written to" in result.stderr, result.stderr
    assert {p: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before
    empty = subprocess.run([TRESTLE, "export", "--to", "hdf5", str(source), ""], capture_output=True, text=True)
    assert empty.returncode == 2 and "an empty path" in empty.stderr, empty.stderr


HEADER = {"format": "trestle", "version": 1, "iteration": 3, "world_size": 1,
          "layout": {"tp": 1, "pp": 1, "vpp": 1, "dp": 1, "ep": 1, "cp": 1}, "model": {"architecture": "test"},
          "training": {}}


def test_bit_patterns_stored_as_signed_integers_keep_their_bits(tmp_path):
    """bf16 written as int16 (torch's .view(torch.int16), the usual way into numpy) lost every negative weight (read
    as values into u16: clamped to 0); fp8 as int8 alike. Bit patterns are read as bits; an integer dtype stored in
    the other sign (i8 values as u8: 200 became 127) is refused."""
    rng = torch.Generator().manual_seed(5)
    bf16 = torch.randn(6, 5, generator=rng).to(torch.bfloat16)
    fp8 = torch.randn(7, generator=rng).to(torch.float8_e4m3fn)
    path = tmp_path / "signed.h5"
    with h5py.File(path, "w") as f:
        f.attrs.create("trestle_manifest", np.bytes_(json.dumps(HEADER)))
        f.create_dataset("a", data=bf16.view(torch.int16).numpy()).attrs.create("dtype", np.bytes_("bf16"))
        f.create_dataset("b", data=fp8.view(torch.int8).numpy()).attrs.create("dtype", np.bytes_("f8_e4m3"))
    assert (bf16 < 0).any() and (fp8.float() < 0).any()
    run("import", "--from", "hdf5", str(path), str(tmp_path / "ckpt"))
    run("export", "--to", "hdf5", str(tmp_path / "ckpt"), str(tmp_path / "back.h5"))
    with h5py.File(tmp_path / "back.h5") as f:
        assert np.array_equal(f["a"][()].view(np.int16), bf16.view(torch.int16).numpy())
        assert np.array_equal(f["b"][()].view(np.int8), fp8.view(torch.int8).numpy())
    with h5py.File(tmp_path / "unsigned.h5", "w") as f:
        f.attrs.create("trestle_manifest", np.bytes_(json.dumps(HEADER)))
        f.create_dataset("c", data=np.array([200, 1], dtype=np.uint8)).attrs.create("dtype", np.bytes_("i8"))
    assert_refused(tmp_path / "unsigned.h5", tmp_path, "dataset 'c'", "stored as unsigned integers", "i8")


def header_text(f):
    return f.attrs["trestle_manifest"].decode() if isinstance(f.attrs["trestle_manifest"], bytes) else \
        f.attrs["trestle_manifest"]


def set_header(f, text, keep_digest=False):
    del f.attrs["trestle_manifest"]
    f.attrs.create("trestle_manifest", np.bytes_(text.encode()))
    if not keep_digest and "trestle_manifest_xxh3_64" in f.attrs:
        del f.attrs["trestle_manifest_xxh3_64"]


def nested_training(f):
    header = json.loads(header_text(f))
    set_header(f, json.dumps(header)[:-1] + ', "training": {"x": ' + "[" * 5000 + "]" * 5000 + "}}")


def changed_rope_theta(f):
    text = header_text(f)
    assert text.count('"rope_theta":10000.0') == 1
    set_header(f, text.replace('"rope_theta":10000.0', '"rope_theta":90000.0'), keep_digest=True)


def manifest_as_array(f):
    del f.attrs["trestle_manifest"]
    f.attrs.create("trestle_manifest", np.array([b"x" * 200] * 300))


def dtype_as_array(f):
    del f[EMBEDDING].attrs["dtype"]
    f[EMBEDDING].attrs.create("dtype", np.array([b"f32"] * 15000))


def name_not_utf8(f):
    f.create_dataset(b"x\xff\xfe", data=np.zeros(2, np.float32)).attrs.create("dtype", np.bytes_("f32"))


@pytest.mark.parametrize("edit, words", [
    (nested_training, ["'trestle_manifest' nests 5001 levels deep; at most 64"]),
    (changed_rope_theta, ["differs from the digest trestle_manifest_xxh3_64 records"]),
    (manifest_as_array, ["attribute 'trestle_manifest' holds 300 strings; one is expected"]),
    (dtype_as_array, [EMBEDDING, "attribute 'dtype' holds 15000 strings; one is expected"]),
    (name_not_utf8, ["dataset 'x\\xff\\xfe'", "not printable UTF-8 text"]),
], ids=["nested", "header_changed", "manifest_array", "dtype_array", "name_not_utf8"])
def test_a_hostile_header_or_attribute_is_refused(exported_model, tmp_path, edit, words):
    """A header nested 17,000 deep imported into a 289 MB manifest no command could read; a changed byte of the header
    (rope_theta) imported as another model with every digest passing; an attribute holding an array of strings overran
    its buffer (a crash); a name that is not UTF-8 ended in an unnamed JSON error. Each is refused naming it."""
    assert_refused(edited_copy(exported_model, tmp_path, edit), tmp_path, *words)


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "fifo.h5"
    os.mkfifo(fifo)
    result = subprocess.run([TRESTLE, "import", "--from", "hdf5", str(fifo), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and f"{fifo}: not a regular file (a FIFO)" in result.stderr, result.stderr


def test_a_damaged_object_header_is_an_error_not_a_crash(exported_model, tmp_path):
    """A flipped byte in a dataset's attribute message (just before the name 'dtype') makes HDF5 1.10 (Debian 12's)
    dereference garbage in H5Aexists: trestle import died by SIGSEGV. The file is now read in a child process: every
    such file is refused with exit 1 naming it, and nothing is left where the import would have written."""
    data = (exported_model / "ckpt.h5").read_bytes()
    names = [at for at in range(len(data)) if data.startswith(b"dtype\0", at)][:3]
    assert names, "no 'dtype' attribute name found in the exported file"
    crashed = 0
    for name in names:
        for at in range(name - 8, name):
            path = tmp_path / "damaged.h5"
            damaged = bytearray(data)
            damaged[at] ^= 0xFF
            path.write_bytes(damaged)
            out = tmp_path / f"out_{at}"
            result = import_raw(path, out)
            assert result.returncode in (0, 1), (at, result.returncode, result.stderr)
            if result.returncode == 1:
                assert str(path) in result.stderr and not out.exists(), (at, result.stderr)
                crashed += "the HDF5 library crashed reading it" in result.stderr
    linked = subprocess.run(["ldd", shutil.which(TRESTLE) or TRESTLE], capture_output=True, text=True).stdout
    if "libhdf5_serial.so.103" in linked:  # HDF5 1.10: such bytes crash it
        assert crashed, "no damaged file made HDF5 1.10 crash: the test no longer reaches the crash it guards against"

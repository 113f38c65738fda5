"""HDF5 interchange checked with h5py: files h5py writes in Trestle's layout are imported, exported again, and h5py
reads back the same arrays bit for bit (bf16 and fp8 as raw bits with a dtype attribute, f16 natively)."""
import json
import os
import subprocess

import h5py
import numpy as np
import pytest
import torch

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

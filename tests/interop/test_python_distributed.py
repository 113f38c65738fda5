"""The `trestle` Python package in multi-process torch.distributed jobs (Gloo, CPU):
- the torch.distributed.checkpoint storage plugin: DTensors (even and uneven Shard(0), Shard(1), a 2-D mesh),
  replicated tensors, nested dicts, Python objects and bytes saved by 2 ranks through trestle.dcp.Writer load
  bit-exactly into 4 ranks through trestle.dcp.Reader and through torch's stock FileSystemReader (and into one
  process); what torch's stock FileSystemWriter saves loads through trestle.dcp.Reader; dcp.async_save works through
  the plugin too;
- trestle.save_async in a training loop of 2 ranks (model and AdamW state as DTensor shards viewing the live tensors,
  saved every 2 steps while training goes on) loads bit-exactly into 4 ranks and into one process;
- a hostile .metadata (a pickle calling os.system) is refused by the Reader, which never runs it; items stored
  through torch's DCP extensions (zstd streams) are refused naming the file and tensor;
- saves and loads without collectives (each rank's own files and __{rank}.metadata) both ways with torch's stock
  writer and reader; torch's SAFETENSORS serialization refused by name; a partial load past a tensor of a dtype
  Trestle does not store; one rank's bad input to trestle.save fails every rank at once."""
import os
import pathlib
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from script_server import reference_scripts

WORKER = r'''
import os, sys, pickle, torch, torch.distributed as dist
sys.path.insert(0, os.environ["TRESTLE_PYTHON_PATH"])
import trestle
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, Replicate, distribute_tensor

mode, rank, world, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = "file://" + work + "/store." + mode + "." + str(world)
dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
mesh = init_device_mesh("cpu", (world,))


def reference():
    g = torch.Generator().manual_seed(7)
    return {
        "even": torch.randn(12, 5, generator=g),
        "uneven": torch.randn(13, 3, generator=g),
        "cols": torch.randn(4, 10, generator=g).to(torch.bfloat16),
        "grid": torch.randn(8, 6, generator=g),
        "replicated": torch.arange(17, dtype=torch.int32),
        "nested": {"deep": {"w": torch.randn(6, generator=g).double()}, "step": torch.tensor(5.0)},
        "extra": {"epoch": 3, "name": "run-1", "blob": b"\x00\x01bytes"},
    }


def sharded(ref, fill=None):
    """ref as this job's DTensors (fill: zeros instead of the values)."""
    f = (lambda t: torch.zeros_like(t)) if fill == "zeros" else (lambda t: t)
    out = {
        "even": distribute_tensor(f(ref["even"]), mesh, [Shard(0)]),
        "uneven": distribute_tensor(f(ref["uneven"]), mesh, [Shard(0)]),
        "cols": distribute_tensor(f(ref["cols"]), mesh, [Shard(1)]),
        "replicated": f(ref["replicated"]).clone(),
        "nested": {"deep": {"w": distribute_tensor(f(ref["nested"]["deep"]["w"]), mesh, [Shard(0)])},
                   "step": f(ref["nested"]["step"]).clone()},
        "extra": dict(ref["extra"]) if fill is None else {"epoch": 0, "name": "", "blob": b""},
    }
    if world % 2 == 0:
        mesh2 = init_device_mesh("cpu", (2, world // 2))
        out["grid"] = distribute_tensor(f(ref["grid"]), mesh2, [Shard(0), Shard(1)])
    else:
        out["grid"] = distribute_tensor(f(ref["grid"]), mesh, [Replicate()])
    return out


def check(loaded, ref):
    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t
    for k in ("even", "uneven", "cols", "grid", "replicated"):
        assert torch.equal(full(loaded[k]), ref[k]), k
        assert full(loaded[k]).dtype == ref[k].dtype, k
    assert torch.equal(full(loaded["nested"]["deep"]["w"]), ref["nested"]["deep"]["w"])
    assert torch.equal(loaded["nested"]["step"], ref["nested"]["step"])
    assert loaded["extra"] == ref["extra"], loaded["extra"]


ref = reference()
if mode == "dcp_save":
    dcp.save(sharded(ref), storage_writer=trestle.dcp.Writer(work + "/dcp_trestle"))
    dcp.save(sharded(ref), storage_writer=dcp.FileSystemWriter(work + "/dcp_stock"))
    # DCP's async_save stages the state, then runs the writer in the background
    dcp.async_save(sharded(ref), storage_writer=trestle.dcp.Writer(work + "/dcp_async")).result()
elif mode == "dcp_load":
    # Trestle's files read by Trestle and by torch, torch's read by Trestle, async_save's read by torch
    for source, reader in (("trestle", "trestle"), ("trestle", "stock"), ("stock", "trestle"), ("async", "stock")):
        path = work + "/dcp_" + source
        r = trestle.dcp.Reader(path) if reader == "trestle" else dcp.FileSystemReader(path)
        target = sharded(ref, fill="zeros")
        dcp.load(target, storage_reader=r)
        check(target, ref)
elif mode == "train_save":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    names = [n for n, _ in model.named_parameters()]

    def shard_view(t):  # this rank's rows of t, a view of the live tensor
        local = torch.chunk(t.detach(), world, dim=0)[rank]
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())

    handle, expected = None, {}
    for step in range(1, 9):
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 2 == 0:
            state = {}
            for n, p in model.named_parameters():
                s = opt.state[p]
                state["model." + n] = shard_view(p)
                state["optim." + n + ".exp_avg"] = shard_view(s["exp_avg"])
                state["optim." + n + ".exp_avg_sq"] = shard_view(s["exp_avg_sq"])
                state["optim." + n + ".step"] = s["step"]
            expected[step] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}
            handle = trestle.save_async(state, work + "/train", iteration=step, training={"step": step})
            # the loop goes on: the next optimizer step changes the tensors the save staged
    handle.wait()
    if rank == 0:
        torch.save(expected, work + "/train_expected.pt")
elif mode == "train_load":
    expected = torch.load(work + "/train_expected.pt")
    for step, state in expected.items():
        target = {k: distribute_tensor(torch.full_like(v, float("nan")), mesh, [Shard(0)]) if v.dim() else
                  torch.zeros_like(v) for k, v in state.items()}
        trestle.load(work + "/train", target, iteration=step)
        for k, v in state.items():
            got = target[k].full_tensor() if isinstance(target[k], DTensor) else target[k]
            assert torch.equal(got, v), (step, k)
elif mode == "nocoll":
    # dcp.save / dcp.load without collectives: each rank plans alone and writes (and reads) its own files and
    # __{rank}.metadata, as torch's FileSystemWriter does; a tensor only one rank has beside each rank's shard.
    def state(fill=None):
        own = torch.arange(4.0) + 10 * rank
        out = sharded(ref, fill)
        out["own_" + str(rank)] = torch.zeros_like(own) if fill else own
        return out
    for writer in ("trestle", "stock"):
        path = work + "/nocoll_" + writer
        w = trestle.dcp.Writer(path) if writer == "trestle" else dcp.FileSystemWriter(path)
        dcp.save(state(), storage_writer=w, use_collectives=False)
    dist.barrier()
    for writer, reader in (("trestle", "trestle"), ("trestle", "stock"), ("stock", "trestle")):
        path = work + "/nocoll_" + writer
        assert sorted(os.listdir(path)) == sorted(f"__{r}{s}" for r in range(world) for s in (".metadata", "_0.distcp")), \
            sorted(os.listdir(path))
        r = trestle.dcp.Reader(path) if reader == "trestle" else dcp.FileSystemReader(path)
        target = state("zeros")
        dcp.load(target, storage_reader=r)  # no .metadata: each rank reads its own __{rank}.metadata
        for k in ("even", "uneven", "cols"):  # each rank's own shard of the DTensors
            assert torch.equal(target[k].to_local(), sharded(ref)[k].to_local()), (writer, reader, k)
        assert torch.equal(target["own_" + str(rank)], torch.arange(4.0) + 10 * rank), (writer, reader)
elif mode == "bad_rank":
    # trestle.save with one rank's input bad: every rank fails at once, none waits in the save's gather.
    import time
    sd = {"w": torch.ones(4)}
    if rank == 1:
        sd["v"] = torch.ones(3, dtype=torch.complex64)
    start = time.monotonic()
    try:
        trestle.save(sd, work + "/bad", iteration=1)
        raise SystemExit("saved")
    except (TypeError, RuntimeError) as e:
        message = str(e)
    assert time.monotonic() - start < 20, time.monotonic() - start
    assert "tensor 'v': torch dtype ComplexFloat has no Trestle equivalent" in message, message
    if rank == 0:
        assert "rank 1 could not save" in message, message
dist.barrier()
dist.destroy_process_group()
print("worker", mode, rank, "ok")
'''


@pytest.fixture(scope="module")
def python_path():
    path = os.environ.get("TRESTLE_PYTHON_PATH")
    if not path or not os.path.isdir(path):
        pytest.fail("set TRESTLE_PYTHON_PATH to <build>/python (ctest does this)")
    sys.path.insert(0, path)
    return path


def run_job(work, mode, world, python_path):
    script = work / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, TRESTLE_PYTHON_PATH=python_path, OMP_NUM_THREADS="1")
    server = reference_scripts()
    try:
        results = server.wait_all([server.start([script, mode, r, world, work], env) for r in range(world)], timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{mode}: a worker did not finish in 180 s")
    for r, result in enumerate(results):
        assert result.returncode == 0, f"{mode} rank {r} exited with {result.returncode}:\n{result.stdout}{result.stderr}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory, python_path):
    """2 ranks saved the same sharded state through trestle.dcp.Writer (dcp_trestle), torch's FileSystemWriter
    (dcp_stock) and dcp.async_save with trestle.dcp.Writer (dcp_async)."""
    work = tmp_path_factory.mktemp("dcp")
    run_job(work, "dcp_save", 2, python_path)
    return work


def test_dcp_plugin_2_to_4_and_3_ranks_both_ways_with_stock_torch(saved, python_path):
    run_job(saved, "dcp_load", 4, python_path)
    run_job(saved, "dcp_load", 3, python_path)  # uneven shards
    # every rank wrote one item file, torch's naming; the items are 4 KiB-aligned torch.save archives
    files = sorted(p.name for p in (saved / "dcp_trestle").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files


def test_dcp_plugin_in_one_process_reads_whole_tensors(saved, python_path):
    import torch.distributed.checkpoint as dcp
    import trestle

    whole = {"even": torch.zeros(12, 5), "cols": torch.zeros(4, 10, dtype=torch.bfloat16),
             "nested": {"deep": {"w": torch.zeros(6, dtype=torch.float64)}}}
    dcp.load(whole, storage_reader=trestle.dcp.Reader(saved / "dcp_trestle"), no_dist=True)
    stock = {"even": torch.ones(12, 5), "cols": torch.ones(4, 10, dtype=torch.bfloat16),
             "nested": {"deep": {"w": torch.ones(6, dtype=torch.float64)}}}
    dcp.load(stock, storage_reader=dcp.FileSystemReader(saved / "dcp_trestle"), no_dist=True)
    assert torch.equal(whole["even"], stock["even"]) and torch.equal(whole["cols"], stock["cols"])
    assert torch.equal(whole["nested"]["deep"]["w"], stock["nested"]["deep"]["w"])
    g = torch.Generator().manual_seed(7)
    assert torch.equal(whole["even"], torch.randn(12, 5, generator=g))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
                                   torch.bfloat16])
def test_dcp_dtypes_without_a_typed_storage_cross_both_ways(tmp_path, python_path, dtype):
    """torch.save keeps fp8 and unsigned 16/32/64-bit tensors as an UntypedStorage rebuilt by _rebuild_tensor_v3: the
    Reader refused those items of torch's files ("not a tensor") and torch could not load the Writer's."""
    import torch.distributed.checkpoint as dcp
    import trestle

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (6, 5 * dtype.itemsize), generator=g, dtype=torch.uint8).view(dtype)  # any bits
    for writer, reader in (("torch", "trestle"), ("trestle", "torch"), ("trestle", "trestle")):
        root = tmp_path / f"{writer}_{reader}"
        dcp.save({"x": x[:, 1:4]}, no_dist=True,
                 storage_writer=dcp.FileSystemWriter(root) if writer == "torch" else trestle.dcp.Writer(root))
        y = {"x": torch.zeros(6, 3, dtype=dtype)}
        dcp.load(y, no_dist=True,
                 storage_reader=dcp.FileSystemReader(root) if reader == "torch" else trestle.dcp.Reader(root))
        assert torch.equal(y["x"].view(torch.uint8), x[:, 1:4].contiguous().view(torch.uint8)), (writer, reader)


def test_save_async_training_loop_2_ranks_loads_into_4_and_1(tmp_path, python_path):
    import trestle

    run_job(tmp_path, "train_save", 2, python_path)
    run_job(tmp_path, "train_load", 4, python_path)
    expected = torch.load(tmp_path / "train_expected.pt")
    assert sorted(expected) == [2, 4, 6, 8]
    for step, state in expected.items():
        whole = {k: torch.empty_like(v) for k, v in state.items()}
        trestle.load(tmp_path / "train", whole, iteration=step)
        for k, v in state.items():
            assert torch.equal(whole[k], v), (step, k)
        manifest = trestle.inspect(tmp_path / "train", iteration=step)
        assert manifest["training"]["step"] == step
        # two ranks each wrote their half of every sharded tensor; the replicated step once
        rows = manifest["tensors"]["model.0.weight"]["chunks"]
        assert len(rows) == 2, rows
    assert not torch.equal(expected[2]["model.0.weight"], expected[8]["model.0.weight"])


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_dcp_reader_refuses_a_metadata_that_runs_code(saved, tmp_path):
    import torch.distributed.checkpoint as dcp
    import trestle
    from torch.distributed.checkpoint.api import CheckpointException

    ckpt = tmp_path / "dcp_trestle"
    shutil.copytree(saved / "dcp_trestle", ckpt)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Evil()))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(CheckpointException) as raised:  # DCP's wrapper of every rank's error
            dcp.load({"even": torch.zeros(12, 5)}, storage_reader=trestle.dcp.Reader(ckpt), no_dist=True)
    finally:
        os.chdir(cwd)
    assert ".metadata: not a DCP Metadata object" in str(raised.value), raised.value
    assert not (tmp_path / "pwned").exists()


def test_dcp_reader_names_items_stored_through_extensions(tmp_path, python_path):
    import torch.distributed.checkpoint as dcp
    import trestle
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.api import CheckpointException

    dcp.save({"a": torch.randn(30, 7)}, storage_writer=dcp.FileSystemWriter(tmp_path / "z", _extensions=[ZStandard()]),
             no_dist=True)
    with pytest.raises(CheckpointException) as raised:
        dcp.load({"a": torch.zeros(30, 7)}, storage_reader=trestle.dcp.Reader(tmp_path / "z"), no_dist=True)
    assert "__0_0.distcp: tensor 'a'" in str(raised.value) and "extensions (stream.zstd" in str(raised.value)


def test_dcp_plugin_without_collectives_both_ways_with_stock_torch(tmp_path, python_path):
    """dcp.save(..., use_collectives=False) through trestle.dcp.Writer kept one rank's data (both wrote __0_0.distcp
    and .metadata); trestle.dcp.Reader could not read the ranks' own __{rank}.metadata that torch writes then."""
    run_job(tmp_path, "nocoll", 2, python_path)


def test_a_bad_input_on_one_rank_fails_every_rank_at_once(tmp_path, python_path):
    run_job(tmp_path, "bad_rank", 2, python_path)


def test_dcp_reader_refuses_the_safetensors_serialization_and_reads_around_unreadable_dtypes(tmp_path, python_path):
    import torch.distributed.checkpoint as dcp
    import trestle
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    # torch's SAFETENSORS serialization records each tensor at its file's safetensors header: read as the tensor's raw
    # bytes, that header came back as numbers.
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dcp.save({"a": a}, storage_writer=dcp.FileSystemWriter(tmp_path / "st", serialization_format=SerializationFormat.SAFETENSORS),
             no_dist=True)
    with pytest.raises(CheckpointException) as raised:
        dcp.load({"a": torch.zeros(3, 4)}, storage_reader=trestle.dcp.Reader(tmp_path / "st"), no_dist=True)
    assert "tensor 'a'" in str(raised.value) and "the start of a safetensors file" in str(raised.value)
    # A tensor of a dtype Trestle does not store stops only a load that asks for it.
    dcp.save({"a": a, "c": torch.ones(3, dtype=torch.complex64)}, storage_writer=dcp.FileSystemWriter(tmp_path / "c"),
             no_dist=True)
    target = {"a": torch.zeros(3, 4)}
    dcp.load(target, storage_reader=trestle.dcp.Reader(tmp_path / "c"), no_dist=True)
    assert torch.equal(target["a"], a)
    with pytest.raises(CheckpointException) as raised:
        dcp.load({"c": torch.zeros(3, dtype=torch.complex64)}, storage_reader=trestle.dcp.Reader(tmp_path / "c"),
                 no_dist=True)
    assert "tensor 'c' has dtype torch.complex64, which Trestle does not store" in str(raised.value)
    # A sparse tensor is named, not "unsupported memory format option Contiguous".
    with pytest.raises(TypeError) as raised:
        trestle.save({"emb.grad": torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))}, tmp_path / "sparse")
    assert "'emb.grad' is a Sparse tensor" in str(raised.value)

"""Interop with torch.distributed.checkpoint (the venv's torch) and megatron-core's dist_checkpointing: torch_dist
checkpoints they write are read bit-exactly by Trestle, checkpoints Trestle writes load bit-exactly with them (into
other shardings too), and legacy mp_rank trees written with torch.save in Megatron's layout are read bit-exactly.
Tensors travel through safetensors files via tests/interop/torch_dist_tool.cc (env TRESTLE_TORCH_DIST_TOOL)."""
import argparse
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from models import assert_bit_exact
from ports import free_port
from script_server import reference_scripts
from safetensors.torch import load_file, save_file


# megatron-core on CPU takes over a minute per run on a busy machine (importing it alone takes ~30 s); a run that
# does not finish in this time is a failure.
MCORE_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def tool():
    path = os.environ.get("TRESTLE_TORCH_DIST_TOOL")
    if not path:
        pytest.fail("set TRESTLE_TORCH_DIST_TOOL to the built trestle_torch_dist_tool (ctest does this)")
    return path


def run_tool(tool, *args):
    result = subprocess.run([tool, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "embedding.word_embeddings.weight": torch.randn(12, 8, generator=g).to(torch.bfloat16),
        "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(16, 8, generator=g),
        "decoder.final_layernorm.weight": torch.randn(8, generator=g).half(),
        "counts": torch.arange(10, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
    }


def test_reads_single_process_dcp_save(tmp_path, trestle, tool):
    tensors = sample_tensors()
    view = torch.arange(40, dtype=torch.float32).reshape(5, 8)[:, 2:6]  # non-contiguous view
    state = {**tensors, "nested": {"view": view, "obj": {"k": 1, "s": "text"}}, "raw": io.BytesIO(b"\x00\xffbytes"),
             "lr": 0.5}
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
    run_tool(tool, "read-dcp", tmp_path / "ckpt", tmp_path / "out.safetensors")
    assert_bit_exact({**tensors, "nested.view": view}, load_file(tmp_path / "out.safetensors"))
    info = trestle.inspect(tmp_path / "ckpt")
    assert info["format"] == "torch_dist"
    objects = {o["name"]: o for o in info["objects"]}
    assert objects["nested.obj.k"]["value"] == 1
    assert objects["nested.obj.s"]["value"] == "text"
    assert objects["lr"]["value"] == 0.5
    assert "hello" not in objects["raw"]["value"] and "BytesIO" in objects["raw"]["value"]


WORKER = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DeviceMesh, distribute_tensor, Shard, Replicate
    from safetensors.torch import load_file
    rank, world, mode, ckpt, src = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[6])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh("cpu", list(range(world)))
    full = load_file(src)
    placements = lambda t: [Shard(0)] if t.dim() and t.shape[0] >= world else [Replicate()]
    state = {k: distribute_tensor(v, mesh, placements(v)) for k, v in full.items()}
    if mode == "save":
        dcp.save(state, checkpoint_id=ckpt)
    else:
        zeros = {k: distribute_tensor(torch.zeros_like(v), mesh, placements(v)) for k, v in full.items()}
        dcp.load(zeros, checkpoint_id=ckpt)
        for k, v in zeros.items():
            got = v.full_tensor()
            assert torch.equal(got.reshape(-1).view(torch.uint8), full[k].reshape(-1).view(torch.uint8)), k
    dist.barrier()
    dist.destroy_process_group()
    # Leave without running C++ static destructors: torch's Gloo threads can abort a finished worker at interpreter
    # exit ("terminate called without an active exception"), after every check above has passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
""")


def run_ranks(tmp_path, world, mode, ckpt, src, port):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    server = reference_scripts()
    results = server.wait_all([server.start([script, r, world, mode, ckpt, src, port]) for r in range(world)],
                              timeout=300)
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]


def test_reads_dtensor_sharded_save_from_two_ranks(tmp_path, tool):
    tensors = sample_tensors()
    save_file(tensors, tmp_path / "src.safetensors")
    run_ranks(tmp_path, 2, "save", tmp_path / "ckpt", tmp_path / "src.safetensors", free_port())
    files = sorted(f for f in os.listdir(tmp_path / "ckpt") if f.endswith(".distcp"))
    assert files == ["__0_0.distcp", "__1_0.distcp"]
    for parts in (1, 3):
        out = tmp_path / f"out{parts}.safetensors"
        run_tool(tool, "read-dcp", tmp_path / "ckpt", out, parts)
        assert_bit_exact(tensors, load_file(out))


@pytest.mark.parametrize("write_ranks", [1, 3])
def test_trestle_written_checkpoint_loads_with_dcp(tmp_path, tool, write_ranks):
    tensors = sample_tensors()
    save_file(tensors, tmp_path / "src.safetensors")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    run_tool(tool, "write-dcp", tmp_path / "src.safetensors", ckpt, write_ranks)
    # Single process, plain tensors.
    target = {k: torch.zeros_like(v) for k, v in tensors.items()}
    target["trestle_note"] = None
    dcp.load(target, checkpoint_id=str(ckpt))
    assert target.pop("trestle_note") == {"writer": "trestle", "ranks": write_ranks}
    assert_bit_exact(tensors, target)
    # A different sharding: two gloo ranks with DTensors.
    run_ranks(tmp_path, 2, "load", ckpt, tmp_path / "src.safetensors", free_port())
    # Every item is a torch.save archive torch.load accepts on its own.
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(str(ckpt)).read_metadata()
    for index, info in md.storage_data.items():
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            torch.load(io.BytesIO(f.read(info.length)), weights_only=False)


def test_reads_legacy_megatron_tree(tmp_path, trestle, tool):
    g = torch.Generator().manual_seed(1)
    args = argparse.Namespace(num_layers=2, hidden_size=8, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                              virtual_pipeline_model_parallel_size=2, ffn_hidden_size=16, swiglu=True)
    root = tmp_path / "legacy"
    expected = {}
    for tp in range(2):
        base = torch.randn(4, 16, generator=g)
        chunks = {
            "model0": {"language_model": {"embedding.weight": torch.randn(6, 8, generator=g).bfloat16()},
                       "decoder.layers.0.self_attention.linear_qkv.weight": base[:, 2:10],  # strided view
                       "decoder.layers.0.mlp.linear_fc2.weight": base.t()},  # transposed view
            "model1": {"decoder.layers.0.mlp.linear_fc1.weight": torch.randn(8, 8, generator=g).half(),
                       "decoder.layers.0.self_attention.linear_qkv._extra_state": None},
        }
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 20, **chunks,
                 "optimizer": {"optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}}, "param_groups": []},
                 "rng_state": [{"random_rng_state": (3, tuple(range(5)), None), "torch_rng_state": torch.get_rng_state()}]}
        d = root / "iter_0000020" / f"mp_rank_{tp:02d}"
        d.mkdir(parents=True)
        torch.save(state, d / "model_optim_rng.pt")
        expected[tp] = {
            "model0.language_model.embedding.weight": chunks["model0"]["language_model"]["embedding.weight"],
            "model0.decoder.layers.0.self_attention.linear_qkv.weight": base[:, 2:10],
            "model0.decoder.layers.0.mlp.linear_fc2.weight": base.t(),
            "model1.decoder.layers.0.mlp.linear_fc1.weight": chunks["model1"]["decoder.layers.0.mlp.linear_fc1.weight"],
            "optimizer.optimizer.state.0.exp_avg": torch.ones(3),
            "rng_state.0.torch_rng_state": state["rng_state"][0]["torch_rng_state"],
        }
    (root / "latest_checkpointed_iteration.txt").write_text("20")
    info = trestle.inspect(root)
    assert info["format"] == "megatron_legacy" and info["iteration"] == 20
    assert [r["tp"] for r in info["ranks"]] == [0, 1]
    rank0 = info["ranks"][0]
    assert rank0["model_keys"] == ["model0", "model1"]
    assert rank0["args"]["num_layers"] == 2 and rank0["args"]["swiglu"] is True
    assert rank0["checkpoint_version"] == 3.0 and rank0["iteration"] == 20
    for tp in range(2):
        out = tmp_path / f"rank{tp}.safetensors"
        run_tool(tool, "read-legacy", root / "iter_0000020" / f"mp_rank_{tp:02d}" / "model_optim_rng.pt", out)
        assert_bit_exact(expected[tp], load_file(out))


MCORE = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    # CPU workarounds, at module level so megatron-core's writer process (which imports this file) has them too:
    # FileSystemWriterAsync calls torch.cuda.synchronize() unconditionally, the save's finalize broadcasts a flag on
    # torch.cuda.current_device(), and the writer measures its RSS with psutil, which the venv does not install.
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
    filesystem_async._process_memory = lambda: 0
    def main():
        mode, ckpt, src = sys.argv[1], sys.argv[2], sys.argv[3]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4])
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
        from safetensors.torch import load_file
        full = load_file(src)
        if mode == "save":
            sd = {k: ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in full.items()}
            sd["iteration"] = 7
            strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
            dist_checkpointing.save(sd, ckpt, sharded_strategy=strategy)
        else:
            sd = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in full.items()}
            # The test tool writes a bare DCP directory; megatron-core's load also wants Megatron's common.pt
            # (trestle convert --to megatron-dist writes one).
            if not os.path.exists(os.path.join(ckpt, "common.pt")):
                torch.save({}, os.path.join(ckpt, "common.pt"))
            loaded = dist_checkpointing.load(sd, ckpt)
            for k, v in full.items():
                assert torch.equal(loaded[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
        dist.destroy_process_group()
    if __name__ == "__main__":
        main()
""")


def run_mcore(tmp_path, mode, ckpt, src, port):
    script = tmp_path / "mcore.py"
    script.write_text(MCORE)
    try:
        result = reference_scripts().run([script, mode, ckpt, src, port], timeout=MCORE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"megatron-core dist_checkpointing {mode} did not finish within {MCORE_TIMEOUT_S} s\n"
                    f"stderr:\n{e.stderr}")
    assert result.returncode == 0, (f"megatron-core dist_checkpointing {mode} failed ({result.returncode})\n"
                                    f"stderr:\n{result.stderr}")


def test_megatron_core_dist_checkpointing_roundtrip(tmp_path, tool):
    tensors = {k: v for k, v in sample_tensors().items() if v.dim() > 0}
    save_file(tensors, tmp_path / "src.safetensors")
    (tmp_path / "mc").mkdir()
    run_mcore(tmp_path, "save", tmp_path / "mc", tmp_path / "src.safetensors", free_port())
    run_tool(tool, "read-dcp", tmp_path / "mc", tmp_path / "out.safetensors")
    assert_bit_exact(tensors, load_file(tmp_path / "out.safetensors"))
    (tmp_path / "ours").mkdir()
    run_tool(tool, "write-dcp", tmp_path / "src.safetensors", tmp_path / "ours", 2)
    run_mcore(tmp_path, "load", tmp_path / "ours", tmp_path / "src.safetensors", free_port())

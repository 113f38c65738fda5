#!/usr/bin/env python3
"""The Python side of `trestle bench save` and `trestle bench load`: torch.distributed.checkpoint (DCP) and torch.save.

Started once with --spec SPEC.json ({"dtype": "bf16", "tensors": [[name, shape], ...]}), it builds its own random
tensors of those names, shapes and dtype (allocated and touched once), prints one JSON line {"ready": true, ...}, then
answers each request line on stdin with one JSON line on stdout:

  save_dcp DIR     torch.distributed.checkpoint.save of the state dict into DIR (one process, no process group; DCP's
                   FileSystemWriter fsyncs its files), then os.fsync of DIR: {"ok": true, "seconds": S}
  save_dcp_async DIR
                   torch.distributed.checkpoint.async_save into DIR, then the future's result() and os.fsync of DIR:
                   {"ok": true, "seconds": S, "blocked": B}, B the time async_save kept the caller
  save_trestle_async DIR
                   the same through Trestle's Python package: trestle.save_async(state, DIR), then handle.wait()
                   (which syncs and commits): {"ok": true, "seconds": S, "blocked": B}. The package is imported from
                   $TRESTLE_PYTHON_PATH when set (the build's python/ folder), else from the environment
  save_torch FILE  torch.save of the state dict, then os.fsync of FILE and its directory: {"ok": true, "seconds": S}
  load_dcp DIR     torch.distributed.checkpoint.load into the state dict's tensors, in place: {"ok": true, "seconds": S}
  save_dcp_tp DIR N, load_dcp_tp DIR N
                   the same with N processes (a Gloo group, spawned for the request), each holding its DTensor piece
                   of every 2-D tensor split by rows (Shard(0)) and the others whole (Replicate()), as a tensor-
                   parallel job holds them; the time runs from a barrier before the call to a barrier after it, so
                   process start-up and tensor allocation stay out: {"ok": true, "seconds": S}
  load_torch FILE  torch.load(FILE, weights_only=True), which reads every byte into new tensors: {"ok": true, ...}
  quit             exits (as does end of input)

Failures answer {"ok": false, "error": "..."}. Page-cache eviction is the caller's job.
"""
import argparse
import json
import os
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def make_state_dict(spec):
    dtype = DTYPES[spec["dtype"]]
    largest = max((torch.Size(shape).numel() for _, shape in spec["tensors"]), default=1)
    source = torch.randn(largest, dtype=torch.float32).to(dtype)
    state = {}
    for name, shape in spec["tensors"]:
        t = torch.empty(shape, dtype=dtype)
        t.view(-1).copy_(source[: t.numel()])
        state[name] = t
    return state


def fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_dcp(state, directory):
    start = time.perf_counter()
    dcp.save(state, checkpoint_id=directory)
    fsync_path(directory, directory=True)
    return {"ok": True, "seconds": time.perf_counter() - start}


def save_dcp_async(state, directory):
    start = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=directory)
    blocked = time.perf_counter() - start
    future.result()
    fsync_path(directory, directory=True)
    return {"ok": True, "seconds": time.perf_counter() - start, "blocked": blocked}


def trestle_package():
    path = os.environ.get("TRESTLE_PYTHON_PATH")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    try:
        import trestle
    except ImportError as e:
        raise RuntimeError(f"the trestle package does not import ({e}): build the trestle_python target, set "
                           "TRESTLE_PYTHON_PATH to <build>/python, or pip install the repository") from e
    return trestle


def save_trestle_async(state, directory):
    trestle = trestle_package()
    start = time.perf_counter()
    handle = trestle.save_async(state, directory)
    blocked = time.perf_counter() - start
    handle.wait()
    return {"ok": True, "seconds": time.perf_counter() - start, "blocked": blocked}


def save_torch(state, path):
    start = time.perf_counter()
    torch.save(state, path)
    fsync_path(path)
    fsync_path(os.path.dirname(os.path.abspath(path)), directory=True)
    return {"ok": True, "seconds": time.perf_counter() - start}


def load_dcp(state, directory):
    start = time.perf_counter()
    dcp.load(state, checkpoint_id=directory)
    return {"ok": True, "seconds": time.perf_counter() - start}


def load_torch(path):
    start = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    seconds = time.perf_counter() - start
    del loaded
    return {"ok": True, "seconds": seconds}


def dcp_rank(rank, world, init_file, spec, action, directory, results):
    """One rank of save_dcp_tp / load_dcp_tp (runs in a spawned process)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        dtype = DTYPES[spec["dtype"]]
        state = {}
        for name, shape in spec["tensors"]:
            if len(shape) == 2:
                if shape[0] % world:
                    raise ValueError(f"{name}: {shape[0]} rows do not split over {world} ranks")
                local = torch.rand([shape[0] // world, shape[1]]).to(dtype)
                state[name] = DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size(shape),
                                                 stride=(shape[1], 1))
            else:
                state[name] = DTensor.from_local(torch.rand(shape).to(dtype), mesh, [Replicate()])
        dist.barrier()
        start = time.perf_counter()
        if action == "save":
            dcp.save(state, checkpoint_id=directory)
            if rank == 0:
                fsync_path(directory, directory=True)
        else:
            dcp.load(state, checkpoint_id=directory)
        dist.barrier()
        if rank == 0:
            results.put(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()


def dcp_in_processes(spec, action, argument):
    directory, _, count = argument.rpartition(" ")
    world = int(count)
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        init_file = os.path.join(scratch, "rendezvous")
        ranks = [context.Process(target=dcp_rank, args=(r, world, init_file, spec, action, directory, results))
                 for r in range(world)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join()
    failed = [r for r, p in enumerate(ranks) if p.exitcode != 0]
    if failed:
        return {"ok": False, "error": f"{action}_dcp_tp with {world} processes: ranks {failed} failed (see stderr)"}
    return {"ok": True, "seconds": results.get()}


def serve(state, spec):
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "quit":
            return
        try:
            if command == "save_dcp":
                answer = save_dcp(state, argument)
            elif command == "save_dcp_async":
                answer = save_dcp_async(state, argument)
            elif command == "save_trestle_async":
                answer = save_trestle_async(state, argument)
            elif command == "save_torch":
                answer = save_torch(state, argument)
            elif command == "load_dcp":
                answer = load_dcp(state, argument)
            elif command == "load_torch":
                answer = load_torch(argument)
            elif command in ("save_dcp_tp", "load_dcp_tp"):
                answer = dcp_in_processes(spec, command[:4], argument)
            else:
                answer = {"ok": False, "error": f"unknown request '{command}'"}
        except Exception as e:  # reported to the caller, which stops the benchmark with this message
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True, help="JSON file with the dtype and the tensors' names and shapes")
    args = parser.parse_args()
    # DCP warns once that it runs without a process group; that is the intent here.
    warnings.filterwarnings("ignore", message=".*process group.*")
    warnings.filterwarnings("ignore", message=".*single process.*")
    with open(args.spec) as f:
        spec = json.load(f)
    state = make_state_dict(spec)
    total = sum(t.numel() * t.element_size() for t in state.values())
    print(json.dumps({"ready": True, "bytes": total, "torch": torch.__version__, "python": sys.version.split()[0]}),
          flush=True)
    serve(state, spec)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The Python side of `trestle bench save` and `trestle bench load`: torch.distributed.checkpoint (DCP) and torch.save.

Started once with --spec SPEC.json ({"dtype": "bf16", "tensors": [[name, shape], ...]}), it builds its own random
tensors of those names, shapes and dtype (allocated and touched once), prints one JSON line {"ready": true, ...}, then
answers each request line on stdin with one JSON line on stdout:

  save_dcp DIR     torch.distributed.checkpoint.save of the state dict into DIR (one process, no process group; DCP's
                   FileSystemWriter fsyncs its files), then os.fsync of DIR: {"ok": true, "seconds": S}
  save_torch FILE  torch.save of the state dict, then os.fsync of FILE and its directory: {"ok": true, "seconds": S}
  load_dcp DIR     torch.distributed.checkpoint.load into the state dict's tensors, in place: {"ok": true, "seconds": S}
  load_torch FILE  torch.load(FILE, weights_only=True), which reads every byte into new tensors: {"ok": true, ...}
  quit             exits (as does end of input)

Failures answer {"ok": false, "error": "..."}. Page-cache eviction is the caller's job.
"""
import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

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


def serve(state):
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "quit":
            return
        try:
            if command == "save_dcp":
                answer = save_dcp(state, argument)
            elif command == "save_torch":
                answer = save_torch(state, argument)
            elif command == "load_dcp":
                answer = load_dcp(state, argument)
            elif command == "load_torch":
                answer = load_torch(argument)
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
    serve(state)


if __name__ == "__main__":
    main()

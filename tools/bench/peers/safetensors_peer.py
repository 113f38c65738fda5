#!/usr/bin/env python3
"""The Python side of `trestle bench safetensors`: safetensors.torch.save_file / load_file on the same tensors.

Started once with --spec SPEC.json ({"dtype": "bf16", "prefix": "model", "shards": [[[name, shape], ...], ...]}),
it builds its own random tensors of those names, shapes and dtype, prints one JSON line {"ready": true, ...}, then
answers each request line on stdin with one JSON line on stdout:

  write DIR   save_file of every shard into DIR (named as save_pretrained names them, plus the index when sharded),
              then os.fsync of every file and of DIR: {"ok": true, "seconds": S}
  read DIR    load_file of every shard, then one touch per 4 KiB page of every tensor, because load_file maps the
              file and returns before reading it: {"ok": true, "seconds": S, "load_file_seconds": L}
  quit        exits (as does end of input)

Failures answer {"ok": false, "error": "..."}. Page-cache eviction is the caller's job.
"""
import argparse
import json
import os
import sys
import time

import safetensors
import torch
from safetensors.torch import load_file, save_file

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def shard_names(prefix, count):
    if count == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def make_shards(spec):
    """Random tensors for every shard; values come from one random buffer, copied so no two tensors share memory."""
    dtype = DTYPES[spec["dtype"]]
    largest = max((torch.Size(shape).numel() for shard in spec["shards"] for _, shape in shard), default=1)
    source = torch.randn(largest, dtype=torch.float32).to(dtype)
    shards = []
    for shard in spec["shards"]:
        tensors = {}
        for name, shape in shard:
            t = torch.empty(shape, dtype=dtype)
            t.view(-1).copy_(source[: t.numel()])
            tensors[name] = t
        shards.append(tensors)
    return shards


def fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(shards, prefix, directory):
    os.makedirs(directory, exist_ok=True)
    names = shard_names(prefix, len(shards))
    start = time.perf_counter()
    for name, tensors in zip(names, shards):
        save_file(tensors, os.path.join(directory, name))
    written = [os.path.join(directory, name) for name in names]
    if len(shards) > 1:
        weight_map = {t: name for name, tensors in zip(names, shards) for t in tensors}
        total = sum(t.numel() * t.element_size() for tensors in shards for t in tensors.values())
        index = os.path.join(directory, f"{prefix}.safetensors.index.json")
        with open(index, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(index)
    for path in written:
        fsync_path(path)
    fsync_path(directory, directory=True)
    return {"ok": True, "seconds": time.perf_counter() - start}


def touch_every_page(tensor):
    flat = tensor.reshape(-1).view(torch.uint8)
    return int(flat[::4096].sum()) + int(flat[-1])


def read(prefix, count, directory):
    paths = [os.path.join(directory, name) for name in shard_names(prefix, count)]
    start = time.perf_counter()
    loaded = [load_file(path) for path in paths]
    load_file_seconds = time.perf_counter() - start
    for tensors in loaded:
        for t in tensors.values():
            touch_every_page(t)
    seconds = time.perf_counter() - start
    del loaded
    return {"ok": True, "seconds": seconds, "load_file_seconds": load_file_seconds}


def serve(shards, prefix):
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "quit":
            return
        try:
            if command == "write":
                answer = write(shards, prefix, argument)
            elif command == "read":
                answer = read(prefix, len(shards), argument)
            else:
                answer = {"ok": False, "error": f"unknown request '{command}'"}
        except Exception as e:  # reported to the caller, which stops the benchmark with this message
            answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(answer), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True, help="JSON file with dtype, prefix and the tensors of every shard")
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    shards = make_shards(spec)
    total = sum(t.numel() * t.element_size() for tensors in shards for t in tensors.values())
    print(json.dumps({"ready": True, "bytes": total, "safetensors": safetensors.__version__,
                      "torch": torch.__version__, "python": sys.version.split()[0]}), flush=True)
    serve(shards, spec.get("prefix", "model"))


if __name__ == "__main__":
    main()

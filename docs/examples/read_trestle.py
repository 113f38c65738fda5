"""A reader of Trestle checkpoints written from docs/format.md alone (numpy, xxhash and zstandard; no Trestle code).

    python read_trestle.py ROOT [--iteration N] [--tensor NAME]   # lists the tensors, or prints one tensor's sum

read_checkpoint(root) returns (manifest, {name: numpy array}); bf16 and f8 tensors come back as their raw uint16 /
uint8 bit patterns, since numpy has no such dtypes."""
import argparse
import json
import math
import os

import numpy
import xxhash
import zstandard

# dtype name -> numpy dtype holding its bytes (little-endian)
DTYPES = {"bool": "?", "u8": "<u1", "i8": "<i1", "i16": "<i2", "u16": "<u2", "i32": "<i4", "u32": "<u4",
          "i64": "<i8", "u64": "<u8", "f16": "<f2", "bf16": "<u2", "f32": "<f4", "f64": "<f8",
          "f8_e4m3": "<u1", "f8_e5m2": "<u1"}


class FormatError(Exception):
    pass


def iteration_directory(root, iteration=None):
    if iteration is None:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            iteration = int(f.read().strip())
    return os.path.join(root, f"iter_{iteration:07d}")


def read_manifest(directory):
    path = os.path.join(directory, "manifest.json")
    with open(path, "rb") as f:
        text = f.read()
    try:
        manifest = json.loads(text.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError both
        raise FormatError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(manifest, dict):
        raise FormatError(f"{path}: not a JSON object")
    if "manifest_xxh3_64" in manifest:  # the manifest's own checksum: every byte before the comma preceding it
        cut = text.rfind(b",", 0, text.rfind(b'"manifest_xxh3_64"'))
        if cut < 0 or xxhash.xxh3_64_hexdigest(text[:cut]) != manifest["manifest_xxh3_64"]:
            raise FormatError(f"{path}: the manifest does not match its checksum (the file is corrupt)")
    if manifest.get("format") != "trestle" or manifest.get("version") != 1:
        raise FormatError(f"{directory}: not a version-1 Trestle manifest")
    return manifest


def chunk_raw_bytes(directory, name, chunk, itemsize):
    """The chunk's raw bytes, every block decoded and checked against its XXH3-64."""
    file = chunk["file"]
    if "/" in file or file in (".", ".."):
        raise FormatError(f"{name}: data file name {file!r} leaves the iteration directory")
    path = os.path.join(directory, file)
    if os.path.islink(path):
        raise FormatError(f"{name}: data file {file} is a symbolic link")
    count = chunk["flat"][1] - chunk["flat"][0] if "flat" in chunk else math.prod(chunk["shape"])
    raw_size = count * itemsize
    block = chunk["block_bytes"]
    blocks = -(-raw_size // block) if raw_size else 0
    sums = chunk["xxh3_64"]
    if len(sums) != blocks:
        raise FormatError(f"{name}: {len(sums)} checksums for {blocks} blocks")
    stored = chunk.get("block_stored_bytes") if chunk["codec"] == "zstd" else \
        [min(block, raw_size - i * block) for i in range(blocks)]
    if chunk["codec"] not in ("raw", "zstd") or stored is None or len(stored) != blocks or \
            sum(stored) != chunk["stored_bytes"]:
        raise FormatError(f"{name}: inconsistent block table in {file}")
    out = bytearray()
    with open(path, "rb") as f:
        f.seek(chunk["byte_offset"])
        for i in range(blocks):
            data = f.read(stored[i])
            if len(data) != stored[i]:
                raise FormatError(f"{name}: {file} ends inside block {i}")
            expected = min(block, raw_size - i * block)
            if chunk["codec"] == "zstd":
                data = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected)
            if len(data) != expected or xxhash.xxh3_64_hexdigest(data) != sums[i]:
                raise FormatError(f"{name}: block {i} of {file} fails its checksum")
            out += data
    return bytes(out)


def read_tensor(directory, name, entry):
    dtype = numpy.dtype(DTYPES[entry["dtype"]])
    shape = tuple(entry["global_shape"])
    total = math.prod(shape)
    result = numpy.zeros(total, dtype=dtype)
    seen = numpy.zeros(total, dtype=numpy.int32)  # how often each element was stored: must end all ones
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for chunk in entry["chunks"]:
        offset, box = chunk["offset"], chunk["shape"]
        if len(offset) != len(shape) or any(o + s > g for o, s, g in zip(offset, box, shape)):
            raise FormatError(f"{name}: chunk box {offset} + {box} outside {list(shape)}")
        values = numpy.frombuffer(chunk_raw_bytes(directory, name, chunk, dtype.itemsize), dtype=dtype)
        # The global flat index of every element of the box, row-major within the box.
        if box:
            grids = numpy.meshgrid(*[numpy.arange(o, o + s, dtype=numpy.int64) for o, s in zip(offset, box)],
                                   indexing="ij")
            index = sum(g.reshape(-1) * st for g, st in zip(grids, strides))
        else:  # a 0-d tensor: one element
            index = numpy.zeros(1, dtype=numpy.int64)
        if "flat" in chunk:
            start, stop = chunk["flat"]
            index = index[start:stop]
        if len(index) != len(values):
            raise FormatError(f"{name}: chunk holds {len(values)} elements for {len(index)} places")
        result[index] = values
        numpy.add.at(seen, index, 1)
    if total and not (seen == 1).all():
        raise FormatError(f"{name}: chunks do not cover the tensor exactly once")
    return result.reshape(shape)


def read_checkpoint(root, iteration=None):
    directory = iteration_directory(root, iteration)
    manifest = read_manifest(directory)
    tensors = {name: read_tensor(directory, name, entry) for name, entry in manifest["tensors"].items()}
    for name, info in manifest.get("files", {}).items():
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        if len(data) != info["bytes"] or xxhash.xxh3_64_hexdigest(data) != info["xxh3_64"]:
            raise FormatError(f"carried file {name} fails its size or checksum")
    return manifest, tensors


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root")
    parser.add_argument("--iteration", type=int)
    parser.add_argument("--tensor")
    args = parser.parse_args()
    manifest, tensors = read_checkpoint(args.root, args.iteration)
    for name, value in tensors.items():
        if args.tensor in (None, name):
            print(f"{name} {manifest['tensors'][name]['dtype']} {list(value.shape)}")


if __name__ == "__main__":
    main()

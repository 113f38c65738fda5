"""`trestle bench kernels` at a small size on the CPU: every fused kernel's forward and backward in every dtype asked
for, and the cast-and-pack rows, each with its time, the ATen composite's, the bandwidth floor and the ratios between
them, in the table and the JSON; bad sizes are refused by name."""
import json
import math
import os
import re
import subprocess

import pytest

KERNELS = ["rms_norm", "rms_norm (1 + w)", "add + rms_norm", "swiglu", "geglu", "softcap", "cross_entropy",
           "softcap attention", "rope"]
DTYPES = {"float": "Float", "bfloat16": "BFloat16", "half": "Half"}
REDUCTIONS = ["sum_of_squares (fp64)"]  # one pass, "reduce", on the CPU


def test_every_kernel_and_dtype_is_measured_beside_its_composite_and_floor(trestle, tmp_path):
    report = tmp_path / "kernels.json"
    out = trestle.run("bench", "kernels", "--tokens", 8, "--hidden", 64, "--ffn", 96, "--vocab", 160, "--head-dim", 16,
                      "--cast-pack-mib", 2, "--repeat", 2, "--dtypes", ",".join(DTYPES), "--device", "cpu",
                      "--json-out", report)
    assert "beside ATen's composite and the bandwidth floor" in out and "speedup" in out and "of floor" in out
    data = json.loads(report.read_text())
    assert data["benchmark"] == "kernels" and data["copy_bandwidth_bytes_per_s"]["cpu"] > 0
    # How each device's calls are timed: wall time on the CPU, the kernels' own time (CUDA events, L2 emptied) on a GPU.
    assert data["timing"]["cpu"] == "wall time of a call" and "CUDA events" in data["timing"]["cuda"]
    assert data["shape"] == {"tokens": 8, "hidden": 64, "ffn": 96, "vocab": 160, "head_dim": 16, "cast_pack_mib": 2}
    figures = data["figures"]
    keys = sorted((f["kernel"], f["dtype"], f["pass"]) for f in figures)
    side = math.isqrt((2 << 20) // 4)
    expected = sorted([(k, t, p) for k in KERNELS for t in DTYPES.values() for p in ("forward", "backward")] +
                      [(k, t, "reduce") for k in REDUCTIONS for t in DTYPES.values()] +
                      [("cast_pack to bf16", "float", p) for p in ("contiguous", "transposed")])
    assert keys == expected
    for f in figures:
        assert f["device"] == "cpu" and f["fused_s"] > 0 and f["composite_s"] > 0 and f["floor_s"] > 0, f
        assert f["speedup"] == pytest.approx(f["composite_s"] / f["fused_s"]), f
        assert f["share_of_floor"] == pytest.approx(f["floor_s"] / f["fused_s"]), f
        assert f["kernel"] in out
        # The floor: the bytes over the copy bandwidth measured in the run (for cast-and-pack, into touched memory).
        if f["kernel"] in REDUCTIONS:  # an [ffn, hidden] gradient read once
            assert f["bytes"] == 96 * 64 * {"Float": 4, "BFloat16": 2, "Half": 2}[f["dtype"]], f
        if f["kernel"].startswith("cast_pack"):
            assert f["bytes"] == side * side * 6, f  # fp32 read, bf16 written
            bandwidth = data["cast_pack_copy_bandwidth_bytes_per_s"]
        else:
            bandwidth = data["copy_bandwidth_bytes_per_s"]["cpu"]
        assert f["floor_s"] == pytest.approx(f["bytes"] / bandwidth, rel=1e-6), f


@pytest.mark.parametrize("args,message", [
    (["--tokens", 2], "--tokens (>= 4)"),
    (["--cast-pack-mib", -1], "--cast-pack-mib at least 0"),
    (["--cast-pack-mib", 1 << 41], "at most 2^40"),
    (["--head-dim", 3], "--head-dim must be even"),
    (["--dtypes", "int8"], "int8"),
    (["--threads", -1], "--threads -1: 0 (ATen's default) to 4096"),
    (["--threads", 100000], "--threads 100000: 0 (ATen's default) to 4096"),
])
def test_bad_sizes_are_refused_by_name(trestle, args, message):
    result = trestle.run_raw("bench", "kernels", "--device", "cpu", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_cast_and_pack_too_large_for_memory_is_refused_by_name(trestle):
    # 2^40 MiB: more than any machine's memory; the staging memory (the pool's own allocator) is asked for first.
    result = trestle.run_raw("bench", "kernels", "--device", "cpu", "--dtypes", "float", "--tokens", 4, "--hidden", 16,
                             "--ffn", 16, "--vocab", 16, "--head-dim", 8, "--repeat", 1, "--cast-pack-mib", 1 << 40)
    assert result.returncode == 1, result.stderr
    assert f"--cast-pack-mib {1 << 40}: cannot allocate" in result.stderr and "staging memory" in result.stderr


def test_odd_sizes_run_every_kernel(trestle, tmp_path):
    # 13 query heads of 2 (a prime count: the attention row's key / value heads must divide it), 7 tokens (1 query
    # position per attention sequence), odd widths everywhere.
    report = tmp_path / "kernels.json"
    trestle.run("bench", "kernels", "--tokens", 7, "--hidden", 26, "--head-dim", 2, "--ffn", 9, "--vocab", 11,
                "--repeat", 1, "--dtypes", "float", "--cast-pack-mib", 0, "--device", "cpu", "--json-out", report)
    figures = json.loads(report.read_text())["figures"]
    assert sorted({f["kernel"] for f in figures}) == sorted(KERNELS + REDUCTIONS)
    assert all(f["fused_s"] > 0 and f["composite_s"] > 0 for f in figures)


def test_a_size_too_large_for_memory_fails_with_a_message(trestle):
    result = trestle.run_raw("bench", "kernels", "--device", "cpu", "--dtypes", "float", "--tokens", 1 << 40,
                             "--repeat", 1, "--cast-pack-mib", 0)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("trestle bench kernels: ") and "allocate" in last, result.stderr
    assert "Exception raised from" not in result.stderr and "frame #" not in result.stderr, result.stderr


def cpu_build(trestle, capability):
    """The CPU build of the fused kernels `bench kernels` names under ATEN_CPU_CAPABILITY=`capability`."""
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    args = ["bench", "kernels", "--device", "cpu", "--dtypes", "float", "--tokens", 4, "--hidden", 16, "--ffn", 16,
            "--vocab", 16, "--head-dim", 8, "--repeat", 1, "--cast-pack-mib", 0]
    result = subprocess.run([trestle.path, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return re.search(r"CPU build: (\w+)", result.stdout).group(1)


def test_the_cpu_build_follows_aten_cpu_capability_as_aten_reads_it(trestle):
    """ATen takes "avx2" and "default" exactly and ignores any other value (warning), keeping the best the CPU runs:
    the fused kernels choose alike ("AVX512", as torch.backends.cpu.get_cpu_capability() prints it, chose AVX2)."""
    best = cpu_build(trestle, "")
    for ignored in ("AVX512", "avx512_vnni", "fast"):
        assert cpu_build(trestle, ignored) == best, ignored
    assert cpu_build(trestle, "default") == "default"
    if best != "default":
        assert cpu_build(trestle, "avx2") == "avx2"

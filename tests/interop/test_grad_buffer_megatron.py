"""Megatron-Core's parameter-and-gradient buffer layout (parallel/layout/grad_buffer_layout.h) against megatron-core's
own _ParamAndGradBuffer built on CPU (its data-parallel group a stand-in reporting the size, so dp > 1 pads as it
would): every parameter's [start, end) and bucket, the buckets' ranges and the padded and unpadded sizes, with and
without the distributed optimizer, for several bucket sizes, dp sizes, a shared embedding and high-bus-bandwidth
padding; and each data-parallel rank's owned parameter pieces per bucket, equal to the distributed optimizer's own
range map (world, in-bucket, shard-local and in-parameter ranges)."""
import json
import os
import subprocess
import types

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

SHAPES = [(300, 64), (64,), (17, 33), (1,), (129,), (4096,), (7, 7), (64, 64)]


class _Group:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size

        self.current = 0

    def rank(self):
        return self.current


@pytest.fixture(scope="module")
def megatron_on_cpu(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # the buffer allocates on the "current CUDA device"
    yield
    torch.cuda.current_device = saved
    dist.destroy_process_group()


def megatron_layout(dp, bucket_size, dist_opt, high_busbw, shared):
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for p, flag in zip(params, shared, strict=True):
        if flag:
            p.shared_embedding = True
    names = {p: f"p{i}" for i, p in enumerate(params)}
    config = DistributedDataParallelConfig(use_distributed_optimizer=dist_opt,
                                           pad_buckets_for_high_nccl_busbw=high_busbw)
    groups = types.SimpleNamespace(tp=dist.group.WORLD, dp_cp=dist.group.WORLD)
    group = _Group(dp)
    buffer = _ParamAndGradBuffer(config, torch.float32, torch.float32, params, group, bucket_size, names, 1.0,
                                 list(range(len(params))), False, pg_collection=groups)
    layout = {"params": [list(buffer.param_index_map[p]) for p in params],
              "buckets": [list(b) for b in buffer.bucket_indices], "numel": buffer.numel,
              "numel_unpadded": buffer.numel_unpadded}
    if dist_opt:  # each rank's owned pieces of each bucket, as the distributed optimizer maps them
        layout["owned"] = []
        for b in range(len(buffer.buckets)):
            ranks = []
            for r in range(dp):
                group.current = r
                param_map = DistributedOptimizer._build_model_gbuf_range(buffer, b)["param_map"]
                pieces = [[next(i for i, q in enumerate(params) if q is p)] + [[m[k].start, m[k].end]
                                               for k in ("gbuf_world", "gbuf_world_in_bucket", "gbuf_local", "param")]
                          for p, m in param_map.items()]
                ranks.append(sorted(pieces, key=lambda x: x[1]))
            layout["owned"].append(ranks)
    return layout


def test_layout_matches_megatron_core(megatron_on_cpu):
    tool = os.environ.get("TRESTLE_GRAD_BUFFER_LAYOUT_TOOL")
    if not tool:
        pytest.fail("set TRESTLE_GRAD_BUFFER_LAYOUT_TOOL (ctest does this)")
    cases = []
    for dp in (1, 2, 3, 4, 8):
        for bucket_size in (None, 1, 500, 5000, 40000):
            for dist_opt in (False, True):
                for shared in ([False] * len(SHAPES), [True] + [False] * (len(SHAPES) - 2) + [True]):
                    for high in ((False, True) if dist_opt and dp == 4 else (False,)):
                        cases.append((dp, bucket_size, dist_opt, high, shared))
    stdin = "".join(json.dumps({"numels": [torch.Size(s).numel() for s in SHAPES], "shared": shared, "dp": dp,
                                "bucket_size": bucket_size, "dist_opt": dist_opt, "high_busbw": high}) + "\n"
                    for dp, bucket_size, dist_opt, high, shared in cases)
    result = subprocess.run([tool], input=stdin, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(answers) == len(cases)
    for case, ours in zip(cases, answers, strict=True):
        assert ours == megatron_layout(*case), case
    assert len(cases) > 100

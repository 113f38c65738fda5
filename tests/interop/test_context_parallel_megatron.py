"""Context parallelism's load-balanced split (train/model/context_parallel.h) against megatron-core's
get_batch_on_this_cp_rank: for each cp size and rank, the global positions of the tokens a rank holds are the ones
Megatron slices out of a batch (of tokens, labels, position ids and the attention mask's query dimension)."""
import json
import os
import subprocess
import types

import pytest
import torch
import torch.distributed as dist

from megatron.core.utils import get_batch_on_this_cp_rank


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_cp_split_matches_megatron_core(process_group, cp):
    tool = os.environ.get("TRESTLE_CONTEXT_PARALLEL_TOOL")
    if not tool:
        pytest.fail("set TRESTLE_CONTEXT_PARALLEL_TOOL (ctest does this)")
    seq = 2 * cp * 5
    result = subprocess.run([tool, str(seq), str(cp)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    ours = json.loads(result.stdout)
    for rank in range(cp):
        group = types.SimpleNamespace(size=lambda: cp, rank=lambda r=rank: r)
        positions = torch.arange(seq).unsqueeze(0).repeat(2, 1)
        batch = {"tokens": positions.clone(), "labels": positions.clone(), "position_ids": positions.clone(),
                 "attention_mask": torch.arange(seq).view(1, 1, seq, 1).expand(2, 1, seq, seq).clone()}
        sliced = get_batch_on_this_cp_rank(batch, cp_group=group)
        for key in ("tokens", "labels", "position_ids"):
            assert sliced[key][0].tolist() == ours[rank], (cp, rank, key)
        assert sliced["attention_mask"][0, 0, :, 0].tolist() == ours[rank], (cp, rank)
    assert sorted(p for r in ours for p in r) == list(range(seq))


def test_a_sequence_that_does_not_divide_is_refused():
    result = subprocess.run([os.environ["TRESTLE_CONTEXT_PARALLEL_TOOL"], "10", "3"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "does not divide into 2 x cp = 6" in result.stderr, result.stderr

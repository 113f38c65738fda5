"""Trestle's pipeline schedules (parallel/pipeline_schedule.h) against megatron-core's own functions on a grid of
(pp, virtual chunks, micro-batches, micro-batch group): per stage the total / warmup / remaining counts equal
get_pp_rank_microbatches, the interleaved table equals get_schedule_table, and the order of steps is the one Megatron's
schedules run from them (warmup forwards, then forward k + warmup with backward k, then the cooldown backwards; a
backward's chunk is chunks - 1 - the table's). Every configuration is also deadlock-free by Trestle's checker."""
import json
import os
import subprocess
import types

import pytest

from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table


def grid():
    for pp in range(1, 5):
        for chunks in range(1, 4):
            for mbs in range(1, 13):
                for group in [0] + list(range(pp, mbs + 1)):
                    if chunks > 1 and pp == 1:
                        continue
                    for forward_only in (0, 1):
                        yield pp, chunks, mbs, group, forward_only


def megatron_counts(pp, rank, chunks, mbs, group, forward_only):
    communicator = types.SimpleNamespace(
        pp_group=types.SimpleNamespace(size=lambda: pp, rank=lambda: rank),
        virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None)
    return get_pp_rank_microbatches(mbs, chunks, group or pp, forward_only=bool(forward_only),
                                    p2p_communicator=communicator)


def megatron_valid(pp, chunks, mbs, group):
    # forward_backward_pipelining_with_interleaving's checks
    if chunks == 1:
        return True
    g = group or pp
    return pp <= g <= mbs and not (0 < mbs % g < pp)


def expected_steps(chunks, mbs, group, pp, counts, forward_only):
    total, _, warmup, remaining = counts
    table = get_schedule_table(mbs, chunks, group or pp)
    fwd = [f"F{mb}c{c}" for mb, c in table]
    bwd = [f"B{mb}c{chunks - 1 - c}" for mb, c in table]
    steps = fwd[:warmup]
    if forward_only:
        return steps
    for k in range(remaining):
        steps += [fwd[warmup + k], bwd[k]]
    return steps + bwd[remaining:total]


def test_schedules_match_megatron_core():
    tool = os.environ.get("TRESTLE_PIPELINE_SCHEDULE_TOOL")
    if not tool:
        pytest.fail("set TRESTLE_PIPELINE_SCHEDULE_TOOL (ctest does this)")
    configs = list(grid())
    stdin = "".join(f"{pp} {chunks} {mbs} {group} {fo}\n" for pp, chunks, mbs, group, fo in configs)
    result = subprocess.run([tool], input=stdin, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(answers) == len(configs)
    compared = 0
    for (pp, chunks, mbs, group, fo), got in zip(configs, answers, strict=True):
        where = dict(pp=pp, chunks=chunks, microbatches=mbs, group=group, forward_only=fo)
        if not megatron_valid(pp, chunks, mbs, group):
            assert "error" in got, where
            continue
        assert "error" not in got, (where, got)
        assert got["deadlock_free"], where
        if chunks > 1:
            assert [tuple(x) for x in got["table"]] == get_schedule_table(mbs, chunks, group or pp), where
        for rank in range(pp):
            counts = megatron_counts(pp, rank, chunks, mbs, group, fo)
            stage = got["stages"][rank]
            assert (stage["total"], stage["all_in_warmup"], stage["warmup"], stage["remaining"]) == counts, \
                (where, rank)
            assert stage["steps"] == expected_steps(chunks, mbs, group, pp, counts, fo), (where, rank)
        compared += 1
    assert compared > 500, compared

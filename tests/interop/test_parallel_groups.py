"""Trestle's Megatron process groups (`trestle train --print-groups WORLD`) have exactly the members, in the same
order, that megatron-core's initialize_model_parallel builds with its RankGenerator for the order tp-cp-ep-dp-pp."""
import json

import pytest
from megatron.core.parallel_state import (RankGenerator, default_embedding_ranks,
                                          default_position_embedding_ranks)

ORDER = "tp-cp-ep-dp-pp"

# (tp, cp, ep, dp, pp, etp); etp None: --expert-tensor-parallel-size not given (Megatron's default, tp)
LAYOUTS = [
    (2, 1, 1, 2, 2, None),
    (2, 2, 1, 2, 1, None),
    (1, 1, 2, 4, 2, None),
    (4, 1, 1, 1, 2, None),
    (1, 1, 1, 8, 1, None),
    (2, 2, 2, 2, 2, None),
    (1, 2, 4, 2, 2, None),
    (2, 1, 4, 4, 1, None),
    (3, 1, 1, 2, 3, None),
    # the experts' own tensor parallelism: smaller than tp, larger, over cp, and given equal to tp
    (2, 1, 2, 2, 1, 1),
    (4, 1, 2, 1, 2, 1),
    (2, 1, 1, 2, 2, 1),
    (1, 1, 2, 4, 1, 2),
    (2, 2, 2, 2, 1, 1),
    (1, 2, 1, 2, 2, 4),
    (2, 1, 2, 2, 2, 2),
]


def megatron_groups(tp, cp, ep, dp, pp, etp):
    world = tp * cp * dp * pp
    etp = etp or tp
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=ORDER, rank_offset=0)
    # initialize_model_parallel's expert generator: tp = expert_tensor_parallel_size, cp folded into expert data
    # parallel.
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=ORDER, rank_offset=0)
    pipelines = dense.get_ranks("pp")
    return {
        "dp-cp": dense.get_ranks("dp-cp"),
        "dp": dense.get_ranks("dp"),
        "cp": dense.get_ranks("cp"),
        "tp-pp": dense.get_ranks("tp-pp"),
        "tp": dense.get_ranks("tp"),
        "pp": pipelines,
        "embedding": [default_embedding_ranks(ranks) for ranks in pipelines],
        "position-embedding": [default_position_embedding_ranks(ranks) for ranks in pipelines],
        "tp-cp": dense.get_ranks("tp-cp"),
        "ep": expert.get_ranks("ep"),
        "expert-tp": expert.get_ranks("tp"),
        "expert-dp": expert.get_ranks("dp"),
    }


def layout_id(layout):
    return "tp{}_cp{}_ep{}_dp{}_pp{}".format(*layout[:5]) + (f"_etp{layout[5]}" if layout[5] else "")


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_groups_equal_megatron_core(trestle, layout):
    tp, cp, ep, dp, pp, etp = layout
    world = tp * cp * dp * pp
    etp_flag = ["--expert-tensor-parallel-size", etp] if etp else []
    ours = json.loads(trestle.run("train", "--print-groups", world, "--tensor-model-parallel-size", tp,
                                  "--context-parallel-size", cp, "--expert-model-parallel-size", ep,
                                  "--pipeline-model-parallel-size", pp, *etp_flag))
    theirs = megatron_groups(*layout)
    assert set(ours) == set(theirs)
    for name, groups in theirs.items():
        assert ours[name] == groups, f"{name} groups differ for {layout}"


def test_sizes_that_do_not_divide_the_world_are_refused(trestle):
    result = trestle.run_raw("train", "--print-groups", 6, "--tensor-model-parallel-size", 4)
    assert result.returncode != 0
    assert "world size 6 is not divisible by tensor x pipeline x context parallel size 4" in result.stderr
    result = trestle.run_raw("train", "--print-groups", 4, "--tensor-model-parallel-size", 2,
                             "--expert-model-parallel-size", 4)
    assert result.returncode != 0
    assert "not divisible by tensor x expert x pipeline parallel size 8" in result.stderr
    result = trestle.run_raw("train", "--print-groups", 4, "--tensor-model-parallel-size", 2,
                             "--expert-model-parallel-size", 2, "--expert-tensor-parallel-size", 4)
    assert result.returncode != 0
    assert "not divisible by expert-tensor x expert x pipeline parallel size 8" in result.stderr
    result = trestle.run_raw("train", "--print-groups", 4, "--expert-tensor-parallel-size", 0)
    assert result.returncode != 0
    assert "--expert-tensor-parallel-size must be at least 1" in result.stderr

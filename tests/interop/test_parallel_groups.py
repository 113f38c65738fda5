"""Trestle's Megatron process groups (`trestle train --print-groups WORLD`) have exactly the members, in the same
order, that megatron-core's initialize_model_parallel builds with its RankGenerator for the order tp-cp-ep-dp-pp."""
import json

import pytest
from megatron.core.parallel_state import (RankGenerator, default_embedding_ranks,
                                          default_position_embedding_ranks)

ORDER = "tp-cp-ep-dp-pp"

# (tp, cp, ep, dp, pp)
LAYOUTS = [
    (2, 1, 1, 2, 2),
    (2, 2, 1, 2, 1),
    (1, 1, 2, 4, 2),
    (4, 1, 1, 1, 2),
    (1, 1, 1, 8, 1),
    (2, 2, 2, 2, 2),
    (1, 2, 4, 2, 2),
    (2, 1, 4, 4, 1),
    (3, 1, 1, 2, 3),
]


def megatron_groups(tp, cp, ep, dp, pp):
    world = tp * cp * dp * pp
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=ORDER, rank_offset=0)
    # initialize_model_parallel's expert generator: expert tensor parallel = tp, cp folded into expert data parallel.
    expert = RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order=ORDER, rank_offset=0)
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
        "expert-dp": expert.get_ranks("dp"),
    }


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}_cp{}_ep{}_dp{}_pp{}".format(*l))
def test_groups_equal_megatron_core(trestle, layout):
    tp, cp, ep, dp, pp = layout
    world = tp * cp * dp * pp
    ours = json.loads(trestle.run("train", "--print-groups", world, "--tensor-model-parallel-size", tp,
                                  "--context-parallel-size", cp, "--expert-model-parallel-size", ep,
                                  "--pipeline-model-parallel-size", pp))
    theirs = megatron_groups(tp, cp, ep, dp, pp)
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

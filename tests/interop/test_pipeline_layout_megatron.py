"""Megatron's --pipeline-model-parallel-layout as Trestle parses it (parallel/layout/pipeline_layout_string.h, through
tests/layout/pipeline_layout_tool.cc) against megatron-core's own PipelineParallelLayerLayout: for each layout string
(Megatron-Bridge's recipe layouts among them: DeepSeek-V3's, GLM-5's with empty virtual stages, Moonlight's), every
(stage, chunk)'s decoder layers equal megatron-core's get_layer_id_list, and a layout megatron-core's
validate_layer_layout refuses Trestle refuses too. Layouts megatron-core takes and Trestle does not run (the embedding
after an empty first virtual stage, MTP layers in a stage of their own) are refused naming why. The even split with
--account-for-embedding/loss-in-pipeline-split places the layers as megatron-core's get_num_layers_to_build and
get_transformer_layer_offset do."""
import json
import os
import subprocess
import types

import pytest

from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

# (layout, pp, decoder layers, MTP layers)
ACCEPTED = [
    ("Et|tL", 2, 2, 0),
    ("E|ttL", 2, 2, 0),
    ("E|t||tL", 2, 2, 0),
    ("Ettt|(tt|)*29,m|L".replace("m|L", "mL"), 31, 61, 1),  # megatron-core's docstring example, MTP with the loss
    ("Et*4|(t*4|)*14,tmL", 16, 61, 1),  # DeepSeek-V3's (16, 1) recipe layout
    ("Et*8|(t*8|)*6,t*5mL", 4, 61, 1),  # DeepSeek-V3's (4, 2): 8 virtual stages over 4 ranks
    ("Et|t||tttt|tttt|tttt|tttt||tttt|tttt|tttt|tttt||tttt|tttt|tttt|tttt||tttt|tttt|tttt|tttt||tttt|tttt"
     "|ttttmL", 13, 78, 1),  # GLM-5's VPP-2 recipe layout (pp 13), empty virtual stages
    ("Etttttt|tttt|tttttttt|tttttttt|tttttttt|tttttttt|tttttttt|tttttttt|tttt|tttt|tttt|tttt|ttttmL", 13, 78,
     1),  # GLM-5's pp 13
    ("Et*14|t*13L", 2, 27, 0),  # Moonlight-16B's (2, 1)
    ("E(t|)*3,tL", 2, 4, 0),
    ("Et,t|(tt)*2|t|tL", 2, 8, 0),
]
REFUSED = [  # megatron-core's checks refuse these
    ("Et|t|L", 2, 2, 0),      # 3 entries over pp 2
    ("Et|ttL", 2, 2, 0),      # 3 decoder layers for a model of 2
    ("tE|tL", 2, 2, 0),       # embedding not first
    ("Et|tLt", 2, 3, 0),      # loss not last
    ("EEt|tL", 2, 2, 0),      # two embeddings
    ("Et|tmL", 2, 2, 0),      # an MTP layer the model does not train
    ("Em|ttL", 2, 2, 1),      # MTP before decoder layers
    ("Et|tX", 2, 2, 0),       # not a layer
    ("E(t|tL", 2, 2, 0),      # a group never closed
    ("E(t|t)L", 2, 2, 0),     # a group without its count
]
TRESTLE_ONLY_REFUSED = [  # megatron-core takes these; Trestle computes the embedding and the loss elsewhere
    ("|Ett|L|", 2, 2, 0, "the embedding (E) must be in the first virtual stage"),
    ("Ett|m|L", 3, 2, 1, "MTP layers in a stage of their own are not supported"),
]


def trestle_layouts(cases):
    tool = os.environ.get("TRESTLE_PIPELINE_LAYOUT_TOOL")
    if not tool:
        pytest.fail("set TRESTLE_PIPELINE_LAYOUT_TOOL (ctest does this)")
    lines = "".join(f"{pp} {layers} {mtp} {layout}\n" for layout, pp, layers, mtp, *_ in cases)
    result = subprocess.run([tool], input=lines, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def megatron_layout(layout, pp, layers, mtp, monkeypatch):
    """megatron-core's [stage][chunk] decoder layer ids for the layout, after its validate_layer_layout."""
    parsed = PipelineParallelLayerLayout(layout, pp)
    parsed.validate_layer_layout(layers, mtp)
    vpp = parsed.virtual_pipeline_model_parallel_size
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vpp)
    return [[parsed.get_layer_id_list(LayerType.decoder, vp_stage=v, pp_rank=s) for v in range(vpp)]
            for s in range(pp)]


def test_accepted_layouts_place_the_layers_as_megatron_core(monkeypatch):
    for case, got in zip(ACCEPTED, trestle_layouts(ACCEPTED), strict=True):
        expected = megatron_layout(*case, monkeypatch)
        assert "error" not in got, (case, got)
        ranges = [[list(range(b, e)) for b, e in chunks] for chunks in got["stages"]]
        assert ranges == expected, (case, ranges, expected)


def test_layouts_megatron_core_refuses_are_refused(monkeypatch):
    for case, got in zip(REFUSED, trestle_layouts(REFUSED), strict=True):
        with pytest.raises(AssertionError):
            megatron_layout(*case, monkeypatch)
        assert "error" in got and got["error"].startswith(f"--pipeline-model-parallel-layout {case[0]}: "), \
            (case, got)
        if "(" in case[0]:
            assert "parentheses group layers only as (X)*n" in got["error"], (case, got)


def test_layouts_trestle_does_not_run_are_refused_saying_why(monkeypatch):
    for case, got in zip(TRESTLE_ONLY_REFUSED, trestle_layouts(TRESTLE_ONLY_REFUSED), strict=True):
        megatron_layout(*case[:4], monkeypatch)  # megatron-core takes it
        assert case[4] in got.get("error", ""), (case, got)


ACCOUNTED = [  # (pp, layers, vpp, embedding, loss)
    (2, 2, 2, 1, 1), (4, 30, 1, 1, 1), (4, 31, 1, 1, 0), (4, 31, 1, 0, 1), (2, 14, 2, 1, 1), (4, 62, 2, 1, 1),
    (3, 7, 1, 1, 1),
]


def test_accounted_splits_place_the_layers_as_megatron_core():
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    cases = [(f"account:{vpp}:{e}:{l}", pp, layers, 0) for pp, layers, vpp, e, l in ACCOUNTED]
    for (pp, layers, vpp, e, l), got in zip(ACCOUNTED, trestle_layouts(cases), strict=True):
        config = types.SimpleNamespace(
            num_layers=layers, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1
            else None, pipeline_model_parallel_layout=None, num_layers_in_first_pipeline_stage=None,
            num_layers_in_last_pipeline_stage=None, account_for_embedding_in_pipeline_split=bool(e),
            account_for_loss_in_pipeline_split=bool(l))
        expected = []
        for s in range(pp):
            row = []
            for v in range(vpp):
                vp_stage = v if vpp > 1 else None
                begin = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=s)
                row.append(list(range(begin, begin + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=s))))
            expected.append(row)
        assert "error" not in got, ((pp, layers, vpp, e, l), got)
        ranges = [[list(range(b, end)) for b, end in chunks] for chunks in got["stages"]]
        assert ranges == expected, ((pp, layers, vpp, e, l), ranges, expected)


def test_hostile_layouts_are_refused_without_a_crash():
    """A layout from a stranger's checkpoint args: deep parentheses (closed, or a million never closed), a repeat count
    past any size, a string of a million characters, are errors (the expansion is capped; each ')' is looked for once)
    naming the layout's start, never a crash or a hang."""
    cases = [("(" * 200000 + "t" + ")*2" * 3, 2, 2, 0), ("E(t|)*99999999999999999999,L", 2, 2, 0),
             ("E" + "t" * 1100000 + "L", 1, 2, 0), ("Et*1048577L", 1, 2, 0), ("E" + "(" * 1000000 + "tL", 1, 1, 0)]
    for case, got in zip(cases, trestle_layouts(cases), strict=True):
        assert "error" in got and len(got["error"]) < 400, (case[0][:40], got.get("error", "")[:400])

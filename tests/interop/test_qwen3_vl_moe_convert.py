"""Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration: a Qwen3-MoE language model under model.language_model, the
Qwen3-VL vision tower under model.visual) through `trestle convert`, checked against transformers.

- a tiny random model of awkward sizes (6 experts of width 24, 2 per token, vocab 301, the vision tower of
  test_qwen3_vl_convert) goes hf -> trestle -> hf bit-exactly at tp 2 x ep 2, pp 2 and ep 3, its experts in either fused
  layout: transformers 5's as it saves them (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and the transposed one Qwen
  publishes ([E, H, 2I], [E, I, H]), each kept as it came; transformers' logits for a prompt with an image are
  unchanged by the round trip;
- the Trestle checkpoint holds every expert under Megatron-Core's names (linear_fc1 = [gate; up]), put together from
  its chunks;
- torch_dist under Megatron-Bridge's Qwen3VLModel names (language_model.*, vision_model.* with its blocks stacked) at
  tp 2 x ep 2, and back;
- per-expert tensors, which transformers does not read for this model, are refused as an export layout.
"""
import json
import os
import re
import sys

import pytest
import safetensors.torch
import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from models import assert_bit_exact, iteration_dir, load_hf_tensors  # noqa: E402
from test_megatron_bridge import assembled, read_manifest  # noqa: E402
from test_qwen3_vl_convert import (IMAGE, TEXT, VISION_START, VISION_END, check_stacked_vision_tower,  # noqa: E402
                                   expected_megatron, save_tiny_qwen3_vl)

MOE = dict(moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1)


def save_tiny_qwen3_vl_moe(directory, seed, transposed=False, **text):
    save_tiny_qwen3_vl(directory, seed, transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration,
                       **MOE, **text)
    if transposed:  # as Qwen publishes it
        tensors = load_hf_tensors(directory)
        for name in tensors:
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                tensors[name] = tensors[name].transpose(1, 2).contiguous()
        for f in os.listdir(directory):
            if f.endswith(".safetensors") or f.endswith(".index.json"):
                os.remove(os.path.join(directory, f))
        safetensors.torch.save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_vl_moe")
    save_tiny_qwen3_vl_moe(root / "fused", seed=9)
    save_tiny_qwen3_vl_moe(root / "transposed", seed=9, transposed=True)
    return {"fused": root / "fused", "transposed": root / "transposed"}


def logits_with_an_image(directory):
    torch.manual_seed(0)
    model = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    grid = torch.tensor([[1, 8, 8]])
    pixels = torch.randn(64, 3 * 2 * 4 * 4)
    ids = torch.tensor([[1, 5, VISION_START] + [IMAGE] * 16 + [VISION_END, 17, 42, 7, 99]])
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).long(),
                     use_cache=False).logits


def expert_megatron(hf, name):
    """An expert's or the router's Megatron tensor from the HF ones (either fused layout)."""
    i, rest = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name).groups()
    p = f"model.language_model.layers.{i}.mlp."
    if rest == "mlp.router.weight":
        return hf[p + "gate.weight"]
    if rest == "pre_mlp_layernorm.weight":
        return hf[f"model.language_model.layers.{i}.post_attention_layernorm.weight"]
    e, which = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", rest).groups()
    hidden = TEXT["hidden_size"]
    gate_up, down = hf[p + "experts.gate_up_proj"][int(e)], hf[p + "experts.down_proj"][int(e)]
    if gate_up.shape[0] == hidden:  # stored transposed
        gate_up, down = gate_up.t(), down.t()
    return gate_up if which == "linear_fc1" else down


@pytest.mark.parametrize("layout", ["fused", "transposed"])
@pytest.mark.parametrize("tp,ep,pp", [(2, 2, 1), (1, 1, 2), (1, 3, 1)])
def test_round_trip_bit_exact_with_logits(trestle_convert, hf_models, tmp_path, layout, tp, ep, pp):
    hf_dir = hf_models[layout]
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "trestle", ckpt, "--tp", tp, "--ep", ep, "--pp", pp,
                        "-q")
    hf = load_hf_tensors(hf_dir)
    c = json.load(open(hf_dir / "config.json"))
    ckpt_iteration, manifest = read_manifest(ckpt)
    experts = {n for n in manifest["tensors"] if ".mlp.experts." in n}
    assert len(experts) == 2 * MOE["num_experts"] * TEXT["num_hidden_layers"], sorted(experts)
    for name, entry in manifest["tensors"].items():
        moe = ".mlp." in name and ("experts" in name or "router" in name) or "pre_mlp_layernorm" in name
        expected = expert_megatron(hf, name) if moe else expected_megatron(hf, c, name)
        whole, _ = assembled(ckpt_iteration, entry)
        assert torch.equal(whole, expected.to(whole.dtype)), name
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_bit_exact(hf, load_hf_tensors(back))  # in the layout it came in
    assert json.load(open(back / "config.json")) == c
    assert torch.equal(logits_with_an_image(back), logits_with_an_image(hf_models["fused"]))


def test_either_layout_on_the_way_out(trestle_convert, hf_models, tmp_path):
    """--hf-expert-layout picks the export layout; the transposed files hold the fused ones transposed; per-expert
    tensors, which transformers does not read for this model, are refused naming the option."""
    ckpt = tmp_path / "ckpt"
    trestle_convert.run("convert", "--from", "hf", hf_models["fused"], "--to", "trestle", ckpt, "-q")
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", tmp_path / "t", "--hf-expert-layout",
                        "fused_transposed", "-q")
    assert_bit_exact(load_hf_tensors(hf_models["transposed"]), load_hf_tensors(tmp_path / "t"))
    result = trestle_convert.run_raw("convert", "--from", "trestle", ckpt, "--to", "hf", tmp_path / "o",
                                     "--hf-expert-layout", "original")
    assert result.returncode != 0 and "fused only" in result.stderr and "--hf-expert-layout" in result.stderr, \
        result.stderr
    assert not (tmp_path / "o").exists()


def test_torch_dist_under_megatron_bridge_names_and_back(trestle_convert, hf_models, tmp_path):
    """torch_dist at tp 2 x ep 2: the language model under language_model. (router and experts included; the router's
    softmax over the top-k logits in args), the vision tower under vision_model.; back to the same bytes in the
    source's layout."""
    from test_megatron_dist_convert import read_dcp
    hf_dir = hf_models["transposed"]
    dist, back = tmp_path / "dist", tmp_path / "back"
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", dist, "--tp", 2, "--ep", 2, "-q")
    saved = read_dcp(iteration_dir(dist))
    weights = {k for k in saved if not k.startswith("optimizer.") and "_extra_state" not in k}
    assert all(k.startswith(("language_model.", "vision_model.")) for k in weights), sorted(weights)
    assert "language_model.decoder.layers.mlp.router.weight" in weights, sorted(weights)
    assert any(k.startswith("language_model.decoder.layers.mlp.experts.") for k in weights), sorted(weights)
    hf = load_hf_tensors(hf_dir)
    check_stacked_vision_tower(hf, saved, {k for k in weights if k.startswith("vision_model.")})
    router = saved["language_model.decoder.layers.mlp.router.weight"]
    for i in range(TEXT["num_hidden_layers"]):
        assert torch.equal(router[i], hf[f"model.language_model.layers.{i}.mlp.gate.weight"]), i
    # transformers' router always renormalises its top-k softmax weights: Megatron's softmax over the top-k logits
    args = torch.load(os.path.join(iteration_dir(dist), "common.pt"), weights_only=False)["args"]
    assert args.moe_router_pre_softmax is False
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", back, "-q")
    assert_bit_exact(hf, load_hf_tensors(back))


def test_inspect_and_verify(trestle_convert, hf_models, tmp_path):
    out = trestle_convert.run("inspect", hf_models["transposed"])
    assert "Qwen3-VL (MoE)" in out, out
    ckpt = tmp_path / "ckpt"
    trestle_convert.run("convert", "--from", "hf", hf_models["transposed"], "--to", "trestle", ckpt, "--ep", 2, "-q")
    out = trestle_convert.run("verify", ckpt, "--against", hf_models["transposed"])
    assert "ok:" in out and "local_experts.5.linear_fc1.weight" in out, out

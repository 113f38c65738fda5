"""DeepSeek-V3 (DeepseekV3ForCausalLM) through `trestle convert`, checked against transformers:

- tiny random models (multi-latent attention with and without the low-rank query, a dense first layer before the MoE
  layers, the router's score-correction bias, shared experts, group-limited routing, YaRN) go hf -> trestle in
  tp 1/2 x pp 1/2 x ep 1/2 (uneven stages) -> hf bit-exactly, transformers' logits equal on the way back;
- every chunk of the Trestle checkpoint holds what Megatron-Core's names say (Megatron-Bridge's mapping: q_a_proj ->
  linear_q_down_proj, kv_a_proj_with_mqa -> linear_kv_down_proj, e_score_correction_bias -> router.expert_bias, ...),
  computed here from the HF tensors, on the pipeline stage and expert-parallel rank Megatron puts it;
- a checkpoint with a multi-token-prediction layer (model.layers.<num_layers>.*, which transformers neither saves nor
  loads) carries it as mtp.layers.0.* on the last stage; its copies of the embedding and head must equal them, and
  are written again on export;
- what Megatron-Core would compute differently is refused naming the option;
- torch_dist: Megatron-Core's per-layer keys (the first layers are dense), local or Transformer Engine names, experts
  [E, ...], MTP keys and Megatron-LM's args (multi_latent_attention, moe_layer_freq, sigmoid router, ...); back to hf
  bit-exactly from Trestle's kept model and from the args alone; megatron-core's own DeepSeek-V3 GPTModel (local spec,
  MLA, MTP, on CPU) loads a Trestle-written checkpoint strictly and its save converts to the same tensors.
"""
import json
import os
import re
import sys
import textwrap
import zlib

import pytest
import safetensors.torch as safetensors_torch
import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from models import check_state_against_mapping, hf_logits, iteration_dir, load_hf_tensors, save_tiny_model  # noqa: E402,E501
from ports import free_port  # noqa: E402
from test_megatron_bridge import (  # noqa: E402
    TORCH_DTYPES, assert_same_tensors, read_manifest, rewrite_config, rewrite_tensors)
from test_megatron_dist_convert import MCORE, read_dcp, run_mcore  # noqa: E402
from ci_scope import ci_cases  # noqa: E402
from mcore_legacy import assert_mtp_moe_tree_converts_back  # noqa: E402

TOKENS = torch.tensor([[1, 5, 17, 42, 7, 99, 3, 11, 64, 2]])

BASE = dict(vocab_size=301, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, pad_token_id=0)
MODELS = {
    # DeepSeek-V3's shape: low-rank queries, 2 groups of which 2 are kept with 4 experts per token, YaRN.
    "v3": dict(BASE, q_lora_rank=24, num_experts_per_tok=4, n_group=2, topk_group=2, routed_scaling_factor=2.5,
               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}),
    # V2-Lite's shape: one query projection, no groups.
    "lite": dict(BASE, q_lora_rank=None, num_experts_per_tok=2, n_group=1, topk_group=1),
}


def save_deepseek(directory, name):
    model = save_tiny_model(str(directory), "DeepseekV3Config", MODELS[name], seed=zlib.crc32(name.encode()),
                            dtype=torch.bfloat16, save_original_format=True)
    # The router's correction bias is a buffer (zeros at init): make it tell experts apart, as a trained one does.
    tensors = load_hf_tensors(directory)
    for key in tensors:
        if key.endswith("e_score_correction_bias"):
            tensors[key] = torch.randn(tensors[key].shape, generator=torch.Generator().manual_seed(len(key)))
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(directory, f))
    safetensors_torch.save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return model


def add_mtp_layer(src, dst):
    """A copy of `src` with DeepSeek-V3's multi-token-prediction layer model.layers.<L>.*: a decoder layer (the last
    one's tensors, perturbed), enorm, hnorm, eh_proj, shared_head.norm, and its copies of the embedding and head."""
    tensors = load_hf_tensors(src)
    config = json.load(open(os.path.join(src, "config.json")))
    last, mtp = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    g = torch.Generator().manual_seed(7)
    for key in list(tensors):
        if key.startswith(f"model.layers.{last}."):
            t = tensors[key]
            tensors[f"model.layers.{mtp}." + key[len(f"model.layers.{last}."):]] = \
                (t.float() + torch.randn(t.shape, generator=g) * 0.01).to(t.dtype)
    h = config["hidden_size"]
    p = f"model.layers.{mtp}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[p + norm + ".weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(torch.bfloat16)
    tensors[p + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g).to(torch.bfloat16)
    tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    os.makedirs(dst)
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    config["num_nextn_predict_layers"] = 1
    json.dump(config, open(os.path.join(dst, "config.json"), "w"), indent=2)
    safetensors_torch.save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for name in MODELS:
        save_deepseek(root / name, name)
    add_mtp_layer(root / "v3", root / "v3_mtp")
    return {name: str(root / name) for name in (*MODELS, "v3_mtp")}


def layer_tensor_name(hf, name, layers):
    """Where Megatron's `name` comes from in a DeepSeek-style HF checkpoint (MTP layers stored as model.layers.{L+k}):
    (tensor, None, None) for the embedding, head, final norm and the MTP layers' own tensors, else (None, the HF layer
    prefix, the name within the layer)."""
    fixed = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight",
             "decoder.final_layernorm.weight": "model.norm.weight"}
    if name in fixed:
        return hf[fixed[name]], None, None
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m:
        return None, f"model.layers.{m.group(1)}.", m.group(2)
    m = re.fullmatch(r"mtp\.layers\.(\d+)\.(.+)", name)
    assert m, name
    p, rest = f"model.layers.{layers + int(m.group(1))}.", m.group(2)
    mtp_own = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
               "final_layernorm.weight": "shared_head.norm.weight"}
    if rest in mtp_own:
        return hf[p + mtp_own[rest]], None, None
    assert rest.startswith("transformer_layer."), name
    return None, p, rest[len("transformer_layer."):]


def gated_mlp_tensor(hf, p, rest, name):
    """The dense MLP's, the shared experts' or a routed expert's linear_fc1 ([gate; up]) or an expert's linear_fc2."""
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    if rest == "mlp.shared_experts.linear_fc1.weight":
        return torch.cat([hf[p + "mlp.shared_experts.gate_proj.weight"], hf[p + "mlp.shared_experts.up_proj.weight"]])
    e = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", rest)
    assert e, f"unexpected Megatron tensor {name}"
    x = p + f"mlp.experts.{e.group(1)}."
    if e.group(2) == "2":
        return hf[x + "down_proj.weight"]
    return torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]])


def expected_megatron(hf, config, name, norms):
    """The global canonical tensor Megatron-Core names `name`, made from the HF tensors (Megatron-Bridge's mapping)."""
    layers = config["num_hidden_layers"]
    whole, p, rest = layer_tensor_name(hf, name, layers)
    if whole is not None:
        return whole
    te = norms == "te"
    a = p + "self_attn."
    direct = {
        "input_layernorm.weight": p + "input_layernorm.weight",
        "self_attention.linear_q_down_proj.weight": a + "q_a_proj.weight",
        ("self_attention.linear_q_up_proj.layer_norm_weight" if te else "self_attention.q_layernorm.weight"):
            a + "q_a_layernorm.weight",
        "self_attention.linear_q_up_proj.weight": a + "q_b_proj.weight",
        "self_attention.linear_q_proj.weight": a + "q_proj.weight",
        "self_attention.linear_kv_down_proj.weight": a + "kv_a_proj_with_mqa.weight",
        ("self_attention.linear_kv_up_proj.layer_norm_weight" if te else "self_attention.kv_layernorm.weight"):
            a + "kv_a_layernorm.weight",
        "self_attention.linear_kv_up_proj.weight": a + "kv_b_proj.weight",
        "self_attention.linear_proj.weight": a + "o_proj.weight",
        "pre_mlp_layernorm.weight": p + "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": p + "post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": p + "mlp.down_proj.weight",
        "mlp.router.weight": p + "mlp.gate.weight",
        "mlp.router.expert_bias": p + "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.linear_fc2.weight": p + "mlp.shared_experts.down_proj.weight",
    }
    if rest in direct:
        return hf[direct[rest]]
    return gated_mlp_tensor(hf, p, rest, name)


def check_trestle_checkpoint(hf_dir, ckpt, tp, pp, ep, first, norms):
    """Every canonical tensor, put together from its chunks (each element exactly once), equals the HF-made one;
    layer tensors sit on their layer's stage, the MTP layer and the head on the last, experts on their EP rank."""
    hf = load_hf_tensors(hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    layers, experts = config["num_hidden_layers"], config["n_routed_experts"]
    iteration_dir, manifest = read_manifest(ckpt)
    names = set(manifest["tensors"])
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names and "decoder.layers.1.mlp.router.expert_bias" in names
    assert "decoder.layers.0.mlp.router.weight" not in names  # the dense first layer
    sizes = [first or layers // pp] + [(layers - first) // (pp - 1) if first else layers // pp] * (pp - 1)
    stage_of = [s for s, n in enumerate(sizes) for _ in range(n)]
    for name, entry in manifest["tensors"].items():
        expected = expected_megatron(hf, config, name, norms)
        assert list(expected.shape) == entry["global_shape"], name
        whole = torch.zeros(expected.shape, dtype=TORCH_DTYPES[entry["dtype"]])
        count = torch.zeros(expected.shape, dtype=torch.int32)
        layer = re.match(r"decoder\.layers\.(\d+)\.", name)
        stage = stage_of[int(layer.group(1))] if layer else (0 if name.startswith("embedding") else pp - 1)
        expert = re.search(r"local_experts\.(\d+)\.", name)
        for chunk in entry["chunks"]:
            rank = int(re.fullmatch(r"rank_(\d+)\.bin", chunk["file"]).group(1))
            assert rank // (tp * ep) == stage, f"{name} on pipeline rank {rank // (tp * ep)}, expected {stage}"
            if expert:
                assert (rank // tp) % ep == int(expert.group(1)) // (experts // ep), f"{name} on the wrong EP rank"
            with open(os.path.join(iteration_dir, chunk["file"]), "rb") as f:
                f.seek(chunk["byte_offset"])
                data = bytearray(f.read(chunk["stored_bytes"]))
            piece = torch.frombuffer(data, dtype=whole.dtype).reshape(chunk["shape"])
            box = tuple(slice(o, o + s) for o, s in zip(chunk["offset"], chunk["shape"], strict=True))
            whole[box] = piece
            count[box] += 1
        assert torch.all(count == 1), f"{name}: elements not written exactly once"
        assert torch.equal(whole.view(torch.uint8) if whole.dtype == torch.bfloat16 else whole,
                           expected.view(torch.uint8) if expected.dtype == torch.bfloat16 else expected), name
    return names


# (model, tp, pp, ep, first-stage layers, norms)
LAYOUTS = [
    ("v3", 1, 1, 1, 0, "te"),
    ("v3", 2, 1, 2, 0, "local"),
    ("v3", 1, 2, 1, 1, "te"),
    ("v3", 2, 2, 2, 2, "te"),
    ("lite", 2, 2, 2, 1, "local"),
    ("lite", 1, 1, 1, 0, "te"),
    ("v3_mtp", 2, 2, 2, 1, "te"),
    ("v3_mtp", 1, 1, 1, 0, "local"),
]


@pytest.mark.parametrize("model,tp,pp,ep,first,norms", LAYOUTS,
                         ids=[f"{m}-tp{t}-pp{p}-ep{e}-first{f}-{n}" for m, t, p, e, f, n in LAYOUTS])
def test_round_trip_megatron_names_and_logits(trestle_convert, hf_models, tmp_path, model, tp, pp, ep, first, norms):
    src = hf_models[model]
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    extra = ["--first-stage-layers", first] if first else []
    trestle_convert.run("convert", "--from", "hf", src, "--to", "trestle", ckpt, "--tp", tp, "--pp", pp, "--ep", ep,
                        "--norms", norms, "--codec", "raw", "-q", *extra)
    names = check_trestle_checkpoint(src, ckpt, tp, pp, ep, first, norms)
    assert any(n.startswith("mtp.layers.0.transformer_layer.mlp.experts.") for n in names) == (model == "v3_mtp")
    manifest = read_manifest(ckpt)[1]
    megatron = manifest["model"]["megatron"]
    assert megatron["multi_latent_attention"] and megatron["moe_first_dense_layers"] == 1
    assert megatron["mtp_num_layers"] == (1 if model == "v3_mtp" else 0)
    assert megatron["moe_router_score_function"] == "sigmoid" and megatron["moe_router_enable_expert_bias"]
    if model.startswith("v3"):
        assert megatron["rope_type"] == "yarn" and megatron["rotary_scaling_factor"] == 4.0
        assert (megatron["moe_router_num_groups"], megatron["moe_router_group_topk"]) == (2, 2)

    verified = trestle_convert.run("verify", "--against", src, ckpt)
    assert "max abs diff 0, 0 above tolerance" in verified

    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    # The MTP layer's copies of embedding and head are written again from the tensors they copy.
    assert_same_tensors(src, back)
    assert json.load(open(os.path.join(back, "config.json"))) == json.load(open(os.path.join(src, "config.json")))
    if (tp, pp, ep) == (1, 1, 1):
        torch.testing.assert_close(hf_logits(back, TOKENS), hf_logits(src, TOKENS), rtol=0, atol=0)


def test_logits_depend_on_what_is_converted(hf_models, tmp_path):
    """The tiny model's logits change when the correction bias or a latent norm changes, so the logits check above
    would see a lost or misplaced tensor."""
    src = hf_models["v3"]
    base = hf_logits(src, TOKENS)
    for key in ("model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.2.self_attn.kv_a_layernorm.weight"):
        tensors = load_hf_tensors(src)
        tensors[key] = tensors[key].flip(0)
        changed = rewrite_tensors(src, str(tmp_path / key.replace(".", "_")), tensors)
        assert not torch.equal(hf_logits(changed, TOKENS), base), key


def test_what_megatron_computes_differently_is_refused(trestle_convert, hf_models, tmp_path):
    cases = [(dict(norm_topk_prob=False), "norm_topk_prob"),
             (dict(rope_interleave=False), "rope_interleave"),
             (dict(n_group=4, topk_group=1), "group-limited routing"),
             (dict(attention_bias=True), "attention_bias")]
    for changes, needle in cases:
        bad = rewrite_config(hf_models["v3"], str(tmp_path / needle.replace(" ", "_")), **changes)
        result = trestle_convert.run_raw("convert", "--from", "hf", bad, "--to", "trestle", str(tmp_path / "x"))
        assert result.returncode == 1 and needle in result.stderr, (changes, result.stderr)
        assert not os.path.exists(tmp_path / "x")
    info = json.loads(trestle_convert.run("inspect", hf_models["v3"], "--json"))
    assert info["config"]["bridge"]["convertible"] and info["config"]["bridge"]["family"] == "DeepSeek-V3"


def test_mtp_copies_that_differ_are_refused(trestle_convert, hf_models, tmp_path):
    src = hf_models["v3_mtp"]
    tensors = load_hf_tensors(src)
    tensors["model.layers.3.embed_tokens.weight"][5, 3] += 1
    bad = rewrite_tensors(src, str(tmp_path / "bad"), tensors)
    result = trestle_convert.run_raw("convert", "--from", "hf", bad, "--to", "trestle", str(tmp_path / "x"))
    assert result.returncode == 1 and "model.layers.3.embed_tokens.weight" in result.stderr, result.stderr
    assert "differs" in result.stderr and not os.path.exists(tmp_path / "x")


# --- torch_dist: Megatron-Core's keys (per-layer for the mixed dense / MoE layers), args, and megatron-core itself ---

DIST_LAYOUTS = [("v3", 2, 2, 2, 2, "te"), ("v3_mtp", 1, 2, 2, 1, "local"), ("lite", 2, 1, 1, 0, "te")]


@pytest.mark.parametrize("model,tp,pp,ep,first,norms", DIST_LAYOUTS,
                         ids=[f"{m}-tp{t}-pp{p}-ep{e}-{n}" for m, t, p, e, _, n in DIST_LAYOUTS])
def test_torch_dist_keys_args_and_back(trestle_convert, hf_models, tmp_path, model, tp, pp, ep, first, norms):
    src = hf_models[model]
    dist = tmp_path / "dist"
    extra = ["--first-stage-layers", first] if first else []
    trestle_convert.run("convert", "--from", "hf", src, "--to", "megatron-dist", dist, "--tp", tp, "--pp", pp, "--ep",
                        ep, "--norms", norms, "-q", *extra)
    it = iteration_dir(dist)
    assert len([f for f in os.listdir(it) if f.endswith(".distcp")]) == tp * pp * ep
    hf = load_hf_tensors(src)
    config = json.load(open(os.path.join(src, "config.json")))
    experts = config["n_routed_experts"]
    state = read_dcp(it)
    # Megatron-Core's keys: one per layer (moe_layer_freq is a list), experts [E, ...], local names under local.
    assert "decoder.layers.0.mlp.linear_fc1.weight" in state and "decoder.layers.mlp.linear_fc1.weight" not in state
    assert state["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"].shape[0] == experts
    q_norm = "self_attention.q_layernorm.weight" if norms == "local" else \
        "self_attention.linear_q_up_proj.layer_norm_weight"
    for key, value in state.items():
        m = re.fullmatch(r"(decoder\.layers\.\d+\.|mtp\.layers\.\d+\.transformer_layer\.)mlp\.experts\.experts\.(.+)",
                         key)
        if m:
            for e in range(experts):
                name = f"{m.group(1)}mlp.experts.local_experts.{e}.{m.group(2)}"
                assert torch.equal(value[e], expected_megatron(hf, config, name, norms)), name
            continue
        if key.startswith("mtp.") or key.startswith("decoder."):
            assert torch.equal(value, expected_megatron(hf, config, key, norms)), key
    if config.get("q_lora_rank"):
        assert f"decoder.layers.2.{q_norm}" in state
    assert any(k.startswith("mtp.layers.0.transformer_layer.") for k in state) == (model == "v3_mtp")
    args = torch.load(os.path.join(it, "common.pt"), weights_only=False)["args"]
    assert args.multi_latent_attention and args.kv_lora_rank == 16 and args.qk_pos_emb_head_dim == 4
    assert args.moe_layer_freq == [0, 1, 1] and args.moe_router_score_function == "sigmoid"
    assert args.moe_router_enable_expert_bias and args.moe_shared_expert_intermediate_size == 32
    assert args.ffn_hidden_size == 48 and args.moe_ffn_hidden_size == 16
    assert args.mtp_num_layers == (1 if model == "v3_mtp" else None)

    for kept in (True, False):  # Trestle's kept model, then Megatron's args alone
        if not kept:
            os.remove(os.path.join(it, "trestle_model.json"))
        back = tmp_path / f"back_{kept}"
        trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", back, "-q")
        got, want = load_hf_tensors(back), load_hf_tensors(src)
        assert sorted(got) == sorted(want)  # the MTP layer's copies of embedding and head included
        for k in got:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k].float(), want[k].float()), k
        torch.testing.assert_close(hf_logits(back, TOKENS), hf_logits(src, TOKENS), rtol=0, atol=0)


MCORE_MODEL = dict(BASE, vocab_size=128, q_lora_rank=24, num_experts_per_tok=4, n_group=2, topk_group=2,
                   routed_scaling_factor=2.5, rms_norm_eps=1e-6, num_nextn_predict_layers=1)

@pytest.mark.parametrize("layout", ci_cases(["Et|ttmL", "Ett|tmL"], ["Et|ttmL"]))
def test_megatron_core_legacy_tree_with_a_pipeline_layout_converts_back(tmp_path, trestle_convert, layout):
    """A legacy tree megatron-core saves at pp 2 with --pipeline-model-parallel-layout (its args keep the string):
    each stage's file numbers its layers from 0, so only the layout says which global layer each is; `convert --from
    megatron-legacy` reads it from the args and gives back every source tensor's value (1 + 2 layers, or 2 + 1; the
    harness's MTP block needs a decoder layer on its stage). Converted to a Trestle checkpoint at pp 2 and on to torch_dist
    at pp 2, the args record the layout (megatron-core parses it to the same split) and the tensors come back the same."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    hf_dir = mcore_hf_dir(tmp_path)
    assert_mtp_moe_tree_converts_back(trestle_convert, MCORE_MLA, hf_dir, tmp_path, 1, 2, 1, layout=layout)
    # Kept through a Trestle checkpoint's layout into the args of a torch_dist written at it, which read back the same.
    trestle_convert.run("convert", "--from", "megatron-legacy", tmp_path / "legacy", "--to", "trestle",
                        tmp_path / "kept", "--hf-config", hf_dir, "--pp", 2, "-q")
    trestle_convert.run("convert", "--from", "trestle", tmp_path / "kept", "--to", "megatron-dist", tmp_path / "md",
                        "--pp", 2, "-q")
    args = torch.load(os.path.join(iteration_dir(tmp_path / "md"), "common.pt"), weights_only=False)["args"]
    assert args.pipeline_model_parallel_layout is not None, vars(args)
    parsed = PipelineParallelLayerLayout(args.pipeline_model_parallel_layout, 2)
    parsed.validate_layer_layout(3, 1)
    assert [[len(chunk) - chunk.count(LayerType.embedding) - chunk.count(LayerType.loss) -
             chunk.count(LayerType.mtp) for chunk in stage] for stage in parsed.layout] == \
        [[layout.split("|")[0].count("t")], [layout.split("|")[1].count("t")]]
    trestle_convert.run("convert", "--from", "megatron-dist", tmp_path / "md", "--to", "hf", tmp_path / "back2", "-q")
    source, back = load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "back2")
    assert sorted(back) == sorted(source)
    assert all(torch.equal(back[n].float(), v.float()) for n, v in source.items())


MCORE_MLA = MCORE.split("def build(")[0] + textwrap.dedent("""
    def build(c, port):  # DeepSeek-V3's GPTModel (local spec, MLA, MTP) of HF config c, fp32, random weights
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.transformer_config import MLATransformerConfig
        import megatron.core.transformer.multi_latent_attention as mla
        mla.HAVE_TE = False  # without Transformer Engine its TELinear is a stand-in that isinstance() rejects
        parallel_state.initialize_model_parallel(1, 1)
        torch.manual_seed(3)
        layers, dense = c["num_hidden_layers"], c["first_k_dense_replace"]
        config = MLATransformerConfig(
            num_layers=layers, hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
            num_attention_heads=c["num_attention_heads"], q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
            qk_head_dim=c["qk_nope_head_dim"], qk_pos_emb_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
            kv_channels=c["v_head_dim"], normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False,
            gated_linear_unit=True, activation_func=F.silu, layernorm_epsilon=c["rms_norm_eps"], rope_type="rope",
            rotary_base=10000, num_moe_experts=c["n_routed_experts"], moe_ffn_hidden_size=c["moe_intermediate_size"],
            moe_shared_expert_intermediate_size=c["n_shared_experts"] * c["moe_intermediate_size"],
            moe_layer_freq=[0] * dense + [1] * (layers - dense), moe_router_topk=c["num_experts_per_tok"],
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_num_groups=c["n_group"], moe_router_group_topk=c["topk_group"],
            moe_router_topk_scaling_factor=c["routed_scaling_factor"], moe_router_pre_softmax=True,
            moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", mtp_num_layers=1,
            use_cpu_initialization=True, params_dtype=torch.float32)
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")

        class Attention(DotProductAttention):  # 0.16's MLA passes k/v channels the local attention does not take
            def __init__(self, *a, k_channels=None, v_channels=None, **k):
                super().__init__(*a, **k)
        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = Attention
        mtp = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False)
        model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=c["vocab_size"],
                         max_sequence_length=64, position_embedding_type="none",
                         share_embeddings_and_output_weights=False, mtp_block_spec=mtp)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
            for name, b in model.named_buffers():
                if name.endswith("expert_bias"):
                    b.copy_(torch.randn_like(b))
        return config, model
""") + "\ndef main():" + MCORE.split("\ndef main():")[1].replace(
    "model.state_dict().items() if torch.is_tensor(v)}",
    "model.state_dict().items() if torch.is_tensor(v) and not k.endswith('local_tokens_per_expert')}")


def run_mcore_mla(tmp_path, mode, ckpt, port):
    result, out = run_mcore(tmp_path, mode, ckpt, port, None, script_text=MCORE_MLA, config=MCORE_MODEL)
    assert result.returncode == 0, result.stderr[-4000:]
    return safetensors_torch.load_file(out / "model.safetensors")


def check_megatron_state(hf_dir, state):
    checked = check_state_against_mapping(hf_dir, state,
                                          lambda hf, config, name: expected_megatron(hf, config, name, "local"))
    assert checked > 60 and any(n.startswith("mtp.layers.0.transformer_layer.mlp.experts.") for n in state)


def mcore_hf_dir(tmp_path):
    src = tmp_path / "hf_plain"
    save_tiny_model(str(src), "DeepseekV3Config", MCORE_MODEL, seed=5, dtype=torch.float32)
    add_mtp_layer(src, tmp_path / "hf")
    return str(tmp_path / "hf")


def test_megatron_core_loads_trestle_checkpoint(tmp_path, trestle_convert):
    hf_dir = mcore_hf_dir(tmp_path)
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", tmp_path / "d", "--norms", "local",
                        "-q")
    state = run_mcore_mla(tmp_path, "load", iteration_dir(tmp_path / "d"), free_port())  # a strict load of every key
    check_megatron_state(hf_dir, state)


def test_trestle_reads_megatron_core_save(tmp_path, trestle_convert):
    (tmp_path / "mc").mkdir()
    state = run_mcore_mla(tmp_path, "save", tmp_path / "mc", free_port())
    config = transformers.DeepseekV3Config(**MCORE_MODEL)
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(tmp_path / "cfg")
    trestle_convert.run("convert", "--from", "megatron-dist", tmp_path / "mc", "--to", "hf", tmp_path / "hf",
                        "--hf-config", tmp_path / "cfg", "-q")
    check_megatron_state(str(tmp_path / "hf"), state)


LEGACY_LAYOUTS = ci_cases([(2, 1, 1), (1, 1, 2), (2, 1, 2)], [(2, 1, 2)])  # (3 layers: GLM-4.5's test has pp 2)


@pytest.mark.parametrize("tp,pp,ep", LEGACY_LAYOUTS, ids=[f"tp{t}-pp{p}-ep{e}" for t, p, e in LEGACY_LAYOUTS])
def test_megatron_core_legacy_tree_converts_back(tmp_path, trestle_convert, tp, pp, ep):
    """A legacy mp_rank tree as Megatron-LM saves megatron-core's own DeepSeek-V3 (MCORE_MLA: multi-latent attention
    with low-rank queries, a dense first layer, the sigmoid router with its expert bias, shared experts, one MTP layer)
    at tp x ep, from the weights of Trestle's torch_dist: each rank's experts numbered from 0 (the MTP layer's too),
    the router's token counter beside its bias. `convert --from megatron-legacy` gives back every source tensor's
    value."""
    assert_mtp_moe_tree_converts_back(trestle_convert, MCORE_MLA, mcore_hf_dir(tmp_path), tmp_path, tp, pp, ep)


# --- FP8 block-quantised checkpoints (DeepSeek-V3's release format) ---------------------------------------------------

BLOCK = 16  # small blocks, so the tiny weights have several, with partial ones at the edges (20 rows, 24 columns)


def fp8_quantise(src, dst):
    """`src` as DeepSeek-V3 ships its weights: the layers' linear weights (not the router's or the MTP projection's)
    float8_e4m3fn, with a float32
    <name>_scale_inv per BLOCK x BLOCK block and quantization_config naming the block size. Returns the bf16 tensors
    those dequantise to (w = fp8 * scale per block), computed here."""
    tensors, out, reference = load_hf_tensors(src), {}, {}
    for name, w in tensors.items():
        linear = w.dim() == 2 and not any(x in name for x in ("embed_tokens", "lm_head", "shared_head.head", "eh_proj")) \
            and not name.endswith("mlp.gate.weight")
        if not linear:
            out[name] = reference[name] = w
            continue
        rows, cols = w.shape
        grid = (-(-rows // BLOCK), -(-cols // BLOCK))
        scale = torch.empty(grid, dtype=torch.float32)
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        for i in range(grid[0]):
            for j in range(grid[1]):
                block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
                scale[i, j] = block.abs().max().clamp(min=1e-12) / 448.0
                q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / scale[i, j]).to(torch.float8_e4m3fn)
        out[name], out[name + "_scale_inv"] = q, scale
        expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
        reference[name] = (q.float() * expanded).to(torch.bfloat16)
    os.makedirs(dst)
    config = json.load(open(os.path.join(src, "config.json")))
    json.dump(config, open(os.path.join(dst, "reference_config.json"), "w"))
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [BLOCK, BLOCK]}
    json.dump(config, open(os.path.join(dst, "config.json"), "w"), indent=2)
    safetensors_torch.save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return reference


def test_fp8_checkpoint_is_dequantised_on_import(trestle_convert, hf_models, tmp_path):
    fp8 = tmp_path / "fp8"
    reference = fp8_quantise(hf_models["v3_mtp"], fp8)
    assert sum(t.dtype == torch.float8_e4m3fn for t in load_hf_tensors(fp8).values()) > 40
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    trestle_convert.run("convert", "--from", "hf", fp8, "--to", "trestle", ckpt, "--tp", 2, "--ep", 2, "-q")
    assert "max abs diff 0, 0 above tolerance" in trestle_convert.run("verify", "--against", fp8, ckpt)
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    got = load_hf_tensors(back)
    want = reference
    assert sorted(got) == sorted(want)
    for k in got:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].float(), want[k].float()), k
    config = json.load(open(back / "config.json"))
    assert "quantization_config" not in config  # the weights are bfloat16 now
    assert config == json.load(open(fp8 / "reference_config.json"))
    # transformers computes with the written model what it computes with the dequantised reference.
    ref_dir = tmp_path / "reference"
    os.makedirs(ref_dir)
    json.dump(config, open(ref_dir / "config.json", "w"))
    safetensors_torch.save_file(want, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    torch.testing.assert_close(hf_logits(back, TOKENS), hf_logits(ref_dir, TOKENS), rtol=0, atol=0)
    # Straight to torch_dist as well.
    trestle_convert.run("convert", "--from", "hf", fp8, "--to", "megatron-dist", tmp_path / "dist", "--pp", 2,
                        "--first-stage-layers", 1, "-q")
    state = read_dcp(iteration_dir(tmp_path / "dist"))
    assert state["decoder.layers.2.self_attention.linear_kv_down_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(state["decoder.layers.2.self_attention.linear_kv_down_proj.weight"].float(),
                       want["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"].float())


def test_fp8_problems_are_named(trestle_convert, hf_models, tmp_path):
    fp8 = tmp_path / "fp8"
    fp8_quantise(hf_models["v3"], fp8)
    other = rewrite_config(fp8, str(tmp_path / "other"), quantization_config={"quant_method": "bitsandbytes"})
    result = trestle_convert.run_raw("convert", "--from", "hf", other, "--to", "trestle", str(tmp_path / "x"))
    assert result.returncode == 1 and "bitsandbytes" in result.stderr and "fp8" in result.stderr, result.stderr
    tensors = load_hf_tensors(fp8)
    for name, change, needle in [
            ("model.layers.1.self_attn.kv_b_proj.weight_scale_inv", None, "has no"),
            ("model.layers.1.self_attn.kv_b_proj.weight_scale_inv", lambda t: t[:1].contiguous(), "expected f32"),
    ]:
        bad = rewrite_config(fp8, str(tmp_path / f"bad_{needle.replace(' ', '_')}"))
        os.remove(os.path.join(bad, "model.safetensors"))  # a hard link to the good one
        edited = dict(tensors)
        if change is None:
            del edited[name]
        else:
            edited[name] = change(edited[name])
        safetensors_torch.save_file(edited, os.path.join(bad, "model.safetensors"), metadata={"format": "pt"})
        result = trestle_convert.run_raw("convert", "--from", "hf", bad, "--to", "trestle", str(tmp_path / "x"))
        assert result.returncode == 1 and "kv_b_proj.weight" in result.stderr and needle in result.stderr, \
            result.stderr
        assert not os.path.exists(tmp_path / "x")

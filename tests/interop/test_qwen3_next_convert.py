"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5 (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) through `trestle convert`:
Gated DeltaNet layers among gated full-attention ones, checked against transformers and megatron-core's layouts.

- tiny random models of awkward sizes (key head dim 8, value head dim 6, two value heads per key head, head_dim 16 with
  RoPE over a quarter of it) go hf -> trestle -> hf bit-exactly at several tp / pp / ep layouts, and transformers'
  logits are unchanged by the round trip;
- every chunk of the Trestle checkpoint holds what megatron-core's names say, computed here from the HF tensors by
  megatron-core's own layouts (ssm/gated_delta_net.py: in_proj = [q; k; v; z; beta; alpha] saved as
  in_proj.weight.{query,key,value,z,beta,alpha}, conv1d over [q; k; v] saved as conv1d.weight.{query,key,value};
  attention.py with attention_output_gate: linear_qkv per group [queries; gates; key; value]) and Megatron-Bridge's
  qwen3_next_bridge.py (the gated norm stored zero-centred: HF weight - 1), on the stage Megatron puts it;
- torch_dist: per-layer keys (the layers differ), the split parts as their own keys, Megatron-LM's args, and back to
  hf bit-exactly; args alone are refused naming --hf-config;
- tp that does not divide the Gated DeltaNet's heads, and options megatron-core computes differently, are refused.
"""
import json
import os
import re
import subprocess
import sys
import textwrap
import zlib

import pytest
import safetensors.torch as safetensors_torch
import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from models import hf_logits, iteration_dir, load_hf_tensors, save_tiny_model  # noqa: E402
from ports import free_port  # noqa: E402
from test_megatron_bridge import (  # noqa: E402
    TORCH_DTYPES, assert_same_tensors, read_manifest, rewrite_config, rewrite_tensors)
from test_megatron_dist_convert import MCORE, read_dcp  # noqa: E402
from ci_scope import ci_cases  # noqa: E402
from mcore_legacy import legacy_tree_from_hf  # noqa: E402

TOKENS = torch.tensor([[1, 5, 17, 42, 7, 99, 3, 11, 64, 2]])

BASE = dict(vocab_size=301, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, pad_token_id=0,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
MODELS = {
    # (config class, config, save_original_format: per-expert tensors as the hub's checkpoints hold them)
    "next": ("Qwen3NextConfig", dict(BASE, **MOE), True),
    "next_fused": ("Qwen3NextConfig", dict(BASE, **MOE, layer_types=None, full_attention_interval=2), False),
    "q35": ("Qwen3_5TextConfig", BASE, False),
    "q35_moe": ("Qwen3_5MoeTextConfig", dict(BASE, **MOE), False),
    # One key head (two value heads): tp 2 divides the attention's groups but not the Gated DeltaNet's heads.
    "one_key_head": ("Qwen3_5TextConfig", dict(BASE, linear_num_key_heads=1, linear_num_value_heads=2), False),
}


def add_mtp_layer(src, dst):
    """A copy of `src` with the multi-token-prediction layer Qwen3-Next's releases hold (which transformers neither
    saves nor loads): mtp.fc joining two norms, mtp.norm, and a full-attention decoder layer mtp.layers.0.*."""
    os.makedirs(dst)
    tensors = load_hf_tensors(src)
    generator = torch.Generator().manual_seed(7)
    h = json.load(open(os.path.join(src, "config.json")))["hidden_size"]
    extra = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
             "mtp.norm.weight": (h,)}
    for key, shape in extra.items():
        tensors[key] = torch.randn(shape, generator=generator).to(torch.bfloat16)
    for key in [k for k in tensors if k.startswith("model.layers.1.")]:
        tensors["mtp.layers.0." + key[len("model.layers.1."):]] = \
            torch.randn(tensors[key].shape, generator=generator).to(tensors[key].dtype)
    safetensors_torch.save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(src, "config.json")))
    config["num_nextn_predict_layers"] = 1
    json.dump(config, open(os.path.join(dst, "config.json"), "w"), indent=2)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for name, (cls, config, original) in MODELS.items():
        save_tiny_model(str(root / name), cls, {k: v for k, v in config.items() if v is not None},
                        seed=zlib.crc32(name.encode()), dtype=torch.bfloat16, save_original_format=original)
    add_mtp_layer(str(root / "next"), str(root / "next_mtp"))
    return {name: str(root / name) for name in (*MODELS, "next_mtp")}


def qkv_gated(q_proj, k, v, groups, d):
    """megatron-core's linear_qkv with attention_output_gate: per group its heads' queries, their gates, key, value;
    transformers' q_proj holds each head's query rows then its gate rows."""
    heads = q_proj.reshape(-1, 2, d, q_proj.shape[-1])  # [heads, (query, gate), d, hidden]
    per = heads.shape[0] // groups
    out = []
    for g in range(groups):
        mine = heads[g * per:(g + 1) * per]
        out += [mine[:, 0].reshape(-1, q_proj.shape[-1]), mine[:, 1].reshape(-1, q_proj.shape[-1]),
                k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    return torch.cat(out)


def gdn_parts(hf, g, c):
    """megatron-core's in_proj parts (query, key, value, z, beta, alpha) from either HF form: Qwen3-Next's per-key-head
    in_proj_qkvz / in_proj_ba, or Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a."""
    hk, dk, dv = c["linear_num_key_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    r = c["linear_num_value_heads"] // hk
    if g + "in_proj_qkvz.weight" in hf:
        qkvz = hf[g + "in_proj_qkvz.weight"].reshape(hk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=1)
        b, a = torch.split(hf[g + "in_proj_ba.weight"].reshape(hk, 2 * r, -1), [r, r], dim=1)
        flat = [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z, b, a)]
    else:
        q, k, v = torch.split(hf[g + "in_proj_qkv.weight"], [hk * dk, hk * dk, hk * r * dv])
        flat = [q, k, v, hf[g + "in_proj_z.weight"], hf[g + "in_proj_b.weight"], hf[g + "in_proj_a.weight"]]
    return dict(zip(("query", "key", "value", "z", "beta", "alpha"), flat, strict=True))


def mlp_tensor(hf, p, rest, experts):
    """The dense MLP's, the shared expert's (with its gate) or a routed expert's tensors, either expert layout."""
    m = p + "mlp."
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
    if rest == "mlp.linear_fc2.weight":
        return hf[m + "down_proj.weight"]
    simple = {"mlp.router.weight": "gate.weight", "mlp.shared_experts.gate_weight": "shared_expert_gate.weight",
              "mlp.shared_experts.linear_fc2.weight": "shared_expert.down_proj.weight"}
    if rest in simple:
        return hf[m + simple[rest]]
    if rest == "mlp.shared_experts.linear_fc1.weight":
        return torch.cat([hf[m + "shared_expert.gate_proj.weight"], hf[m + "shared_expert.up_proj.weight"]])
    e = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", rest)
    assert e, rest
    x, i = int(e.group(1)), e.group(2)
    if m + "experts.gate_up_proj" in hf:  # transformers 5's fused experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        return hf[m + ("experts.gate_up_proj" if i == "1" else "experts.down_proj")][x]
    if i == "2":
        return hf[m + f"experts.{x}.down_proj.weight"]
    return torch.cat([hf[m + f"experts.{x}.gate_proj.weight"], hf[m + f"experts.{x}.up_proj.weight"]])


def expected_megatron(hf, c, name):
    """The global tensor megatron-core names `name` (Transformer Engine or local norm names), from the HF tensors."""
    fixed = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight",
             "decoder.final_layernorm.weight": "model.norm.weight",
             # The multi-token-prediction layer's own (Megatron-Bridge's qwen3_next_bridge.py names).
             "mtp.layers.0.eh_proj.weight": "mtp.fc.weight", "mtp.layers.0.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
             "mtp.layers.0.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.final_layernorm.weight": "mtp.norm.weight"}
    if name in fixed:
        return hf[fixed[name]]
    if name.startswith("mtp.layers.0.transformer_layer."):
        p, rest = "mtp.layers.0.", name[len("mtp.layers.0.transformer_layer."):]
    else:
        layer, rest = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name).groups()
        p = f"model.layers.{layer}."
    a, g = p + "self_attn.", p + "linear_attn."
    direct = {
        "input_layernorm.weight": p + "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": p + "input_layernorm.weight",
        "self_attention.in_proj.layer_norm_weight": p + "input_layernorm.weight",
        "pre_mlp_layernorm.weight": p + "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": p + "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": a + "q_norm.weight",
        "self_attention.k_layernorm.weight": a + "k_norm.weight",
        "self_attention.linear_proj.weight": a + "o_proj.weight",
        "self_attention.dt_bias": g + "dt_bias",
        "self_attention.A_log": g + "A_log",
        "self_attention.out_proj.weight": g + "out_proj.weight",
    }
    if rest in direct:
        return hf[direct[rest]]
    if rest == "self_attention.out_norm.weight":  # zero-centred in megatron-core (Megatron-Bridge: weight - 1)
        return hf[g + "norm.weight"] - 1
    if rest == "self_attention.linear_qkv.weight":
        return qkv_gated(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"],
                         c["num_key_value_heads"], c["head_dim"])
    if rest.startswith("self_attention.in_proj.weight."):
        return gdn_parts(hf, g, c)[rest.rsplit(".", 1)[1]]
    if rest.startswith("self_attention.conv1d.weight."):
        keys = c["linear_num_key_heads"] * c["linear_key_head_dim"]
        q, k, v = torch.split(hf[g + "conv1d.weight"], [keys, keys, hf[g + "conv1d.weight"].shape[0] - 2 * keys])
        return dict(query=q, key=k, value=v)[rest.rsplit(".", 1)[1]]
    return mlp_tensor(hf, p, rest, c.get("num_experts", 0))


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


def check_trestle_checkpoint(hf_dir, ckpt, tp, pp, ep, vpp=1):
    """Every canonical tensor, put together from its chunks (each element exactly once), equals the HF-made one and
    sits on its layer's stage (experts on their EP rank)."""
    hf = load_hf_tensors(hf_dir)
    c = json.load(open(os.path.join(hf_dir, "config.json")))
    layers = c["num_hidden_layers"]
    iteration_dir_, manifest = read_manifest(ckpt)
    names = set(manifest["tensors"])
    for i, kind in enumerate(c["layer_types"]):
        linear = kind == "linear_attention"
        assert (f"decoder.layers.{i}.self_attention.in_proj.weight.alpha" in names) == linear, i
        assert (f"decoder.layers.{i}.self_attention.linear_qkv.weight" in names) == (not linear), i
    for name, entry in manifest["tensors"].items():
        expected = expected_megatron(hf, c, name)
        assert list(expected.shape) == entry["global_shape"], name
        whole = torch.zeros(expected.shape, dtype=TORCH_DTYPES[entry["dtype"]])
        count = torch.zeros(expected.shape, dtype=torch.int32)
        layer = re.match(r"decoder\.layers\.(\d+)\.", name)
        # Megatron's interleaved schedule: chunk k of layers // (pp * vpp) layers on stage k % pp.
        chunk = int(layer.group(1)) // (layers // (pp * vpp)) if layer else None
        stage = chunk % pp if layer else (0 if name.startswith("embedding") else pp - 1)
        expert = re.search(r"local_experts\.(\d+)\.", name)
        for chunk in entry["chunks"]:
            rank = int(re.fullmatch(r"rank_(\d+)\.bin", chunk["file"]).group(1))
            assert rank // (tp * ep) == stage, f"{name} on pipeline rank {rank // (tp * ep)}, expected {stage}"
            if expert:
                assert (rank // tp) % ep == int(expert.group(1)) // (c["num_experts"] // ep), name
            with open(os.path.join(iteration_dir_, chunk["file"]), "rb") as f:
                f.seek(chunk["byte_offset"])
                data = bytearray(f.read(chunk["stored_bytes"]))
            piece = torch.frombuffer(data, dtype=whole.dtype).reshape(chunk["shape"])
            box = tuple(slice(o, o + s) for o, s in zip(chunk["offset"], chunk["shape"], strict=True))
            whole[box] = piece
            count[box] += 1
            # Split by heads as megatron-core splits them: each tp rank's rows are whole heads of this part.
            if name.endswith(("in_proj.weight.query", "in_proj.weight.key", "conv1d.weight.query")) and tp > 1:
                assert chunk["shape"][0] == expected.shape[0] // tp and chunk["offset"][0] % c["linear_key_head_dim"] == 0
        assert torch.all(count == 1), f"{name}: elements not written exactly once"
        assert torch.equal(bits(whole), bits(expected)), name
    return manifest


# (model, tp, pp, ep, norms)
LAYOUTS = [
    ("q35", 1, 2, 1, "te-vpp2"),
    ("next", 1, 1, 1, "te"),
    ("next_mtp", 2, 2, 2, "local"),
    ("next_fused", 2, 1, 2, "te"),
    ("q35", 2, 2, 1, "te"),
    ("q35", 1, 1, 1, "local"),
    ("q35_moe", 1, 2, 2, "te"),
]


@pytest.mark.parametrize("model,tp,pp,ep,norms", LAYOUTS, ids=[f"{m}-tp{t}-pp{p}-ep{e}-{n}" for m, t, p, e, n in LAYOUTS])
def test_round_trip_megatron_names_and_logits(trestle_convert, hf_models, tmp_path, model, tp, pp, ep, norms):
    src = hf_models[model]
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    vpp = 2 if norms.endswith("-vpp2") else 1  # the interleaved schedule's virtual stages
    norms = norms.removesuffix("-vpp2")
    trestle_convert.run("convert", "--from", "hf", src, "--to", "trestle", ckpt, "--tp", tp, "--pp", pp, "--vpp", vpp,
                        "--ep", ep, "--norms", norms, "--codec", "raw", "-q")
    manifest = check_trestle_checkpoint(src, ckpt, tp, pp, ep, vpp)
    megatron = manifest["model"]["megatron"]
    config = json.load(open(os.path.join(src, "config.json")))
    assert megatron["experimental_attention_variant"] == "gated_delta_net"
    assert megatron["linear_attention_freq"] == [int(t == "linear_attention") for t in config["layer_types"]]
    assert megatron["attention_output_gate"] and megatron["layernorm_zero_centered_gamma"]
    assert megatron["rotary_percent"] == 0.25 and megatron["kv_channels"] == 16
    assert (megatron["linear_num_key_heads"], megatron["linear_num_value_heads"], megatron["linear_key_head_dim"],
            megatron["linear_value_head_dim"], megatron["linear_conv_kernel_dim"]) == (2, 4, 8, 6, 4)
    assert megatron["mtp_num_layers"] == (model == "next_mtp")
    assert ("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight" in manifest["tensors"]) == \
        (model == "next_mtp")

    verified = trestle_convert.run("verify", "--against", src, ckpt)
    assert "max abs diff 0, 0 above tolerance" in verified

    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_same_tensors(src, back)
    assert json.load(open(os.path.join(back, "config.json"))) == config
    if (tp, pp, ep) in ((1, 1, 1), (2, 2, 2), (1, 2, 2)):
        torch.testing.assert_close(hf_logits(back, TOKENS), hf_logits(src, TOKENS), rtol=0, atol=0)


def test_logits_depend_on_what_is_converted(hf_models, tmp_path):
    """The tiny model's logits change when any Gated DeltaNet part or the attention gate moves, so the logits check
    above would see a misplaced one."""
    src = hf_models["next"]
    base = hf_logits(src, TOKENS)
    for key in ("model.layers.0.linear_attn.in_proj_ba.weight", "model.layers.0.linear_attn.in_proj_qkvz.weight",
                "model.layers.2.linear_attn.conv1d.weight", "model.layers.2.linear_attn.norm.weight",
                "model.layers.0.linear_attn.A_log", "model.layers.1.self_attn.q_proj.weight"):
        tensors = load_hf_tensors(src)
        tensors[key] = tensors[key].flip(0)
        changed = rewrite_tensors(src, str(tmp_path / key.replace(".", "_")), tensors)
        assert not torch.equal(hf_logits(changed, TOKENS), base), key


DIST_LAYOUTS = [("next_mtp", 2, 2, 2, "te"), ("q35", 1, 1, 1, "local"), ("q35_moe", 1, 1, 2, "te")]


@pytest.mark.parametrize("model,tp,pp,ep,norms", DIST_LAYOUTS,
                         ids=[f"{m}-tp{t}-pp{p}-ep{e}-{n}" for m, t, p, e, n in DIST_LAYOUTS])
def test_torch_dist_keys_args_and_back(trestle_convert, hf_models, tmp_path, model, tp, pp, ep, norms):
    src = hf_models[model]
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", src, "--to", "megatron-dist", dist, "--tp", tp, "--pp", pp, "--ep",
                        ep, "--norms", norms, "-q")
    it = iteration_dir(dist)
    assert len([f for f in os.listdir(it) if f.endswith(".distcp")]) == tp * pp * ep
    hf = load_hf_tensors(src)
    c = json.load(open(os.path.join(src, "config.json")))
    state = read_dcp(it)
    # Per-layer keys (hetereogenous_dist_checkpoint), the Gated DeltaNet's parts under megatron-core's split names,
    # Transformer Engine's norm names whatever the spec.
    assert "decoder.layers.0.self_attention.in_proj.weight.query" in state
    assert "decoder.layers.0.self_attention.in_proj.layer_norm_weight" in state
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in state
    assert not any(k.startswith("decoder.layers.self_attention") for k in state)
    assert ("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight" in state) == (model == "next_mtp")
    compared = 0
    for key, value in state.items():
        m = re.fullmatch(r"(decoder\.layers\.\d+\.|mtp\.layers\.0\.transformer_layer\.)mlp\.experts\.experts\.(.+)",
                         key)
        if m:
            for e in range(c["num_experts"]):
                name = f"{m.group(1)}mlp.experts.local_experts.{e}.{m.group(2)}"
                assert torch.equal(bits(value[e]), bits(expected_megatron(hf, c, name))), name
            compared += 1
        elif key.startswith(("decoder.", "embedding.", "output_layer.", "mtp.")) and "_extra_state" not in key:
            expected = expected_megatron(hf, c, key)
            assert torch.equal(bits(value[:expected.shape[0]]), bits(expected)), key
            compared += 1
    assert compared > 30
    args = torch.load(os.path.join(it, "common.pt"), weights_only=False)["args"]
    assert args.experimental_attention_variant == "gated_delta_net" and args.attention_output_gate
    assert args.linear_attention_freq == [1, 0, 1, 0] and args.apply_layernorm_1p
    assert (args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim,
            args.linear_value_head_dim, args.linear_conv_kernel_dim) == (2, 4, 8, 6, 4)
    assert args.rotary_percent == 0.25 and args.qk_layernorm
    assert args.mtp_num_layers == (1 if model == "next_mtp" else None)
    if "num_experts" in c:  # the top-k softmax weights renormalised (norm_topk_prob; Qwen3.5-MoE's router always):
        assert args.moe_router_pre_softmax is False  # Megatron's softmax over the top-k logits

    back = tmp_path / "back"
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", back, "-q")
    assert_same_tensors(src, back)
    os.remove(os.path.join(it, "trestle_model.json"))
    result = trestle_convert.run_raw("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "x")
    assert result.returncode == 1 and "--hf-config" in result.stderr, result.stderr
    back_cfg = tmp_path / "back_cfg"
    # Without the kept model's record of the source's expert layout, the hub's (per expert) is written unless asked.
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", back_cfg, "--hf-config", src, "-q",
                        *(["--hf-expert-layout", "fused"] if model == "q35_moe" else []))
    assert_same_tensors(src, back_cfg)


def test_inspect_reshard_and_diff(trestle_convert, hf_models, tmp_path):
    info = json.loads(trestle_convert.run("inspect", hf_models["next"], "--json"))
    assert info["config"]["bridge"]["convertible"] and info["config"]["bridge"]["family"] == "Qwen3-Next"
    a, b = tmp_path / "a", tmp_path / "b"
    trestle_convert.run("convert", "--from", "hf", hf_models["next"], "--to", "trestle", a, "-q")
    trestle_convert.run("reshard", a, b, "--tp", 2, "--pp", 2, "-q")
    assert trestle_convert.run_raw("diff", a, b, "-q").returncode == 0  # the same model in two layouts
    check_trestle_checkpoint(hf_models["next"], b, 2, 2, 1)


def test_what_megatron_cannot_hold_is_refused(trestle_convert, hf_models, tmp_path):
    # megatron-core splits the Gated DeltaNet's key and value heads over the tp ranks.
    result = trestle_convert.run_raw("convert", "--from", "hf", hf_models["one_key_head"], "--to", "trestle",
                                     tmp_path / "x", "--tp", 2)
    assert result.returncode == 1 and "Gated DeltaNet key heads" in result.stderr, result.stderr
    assert not os.path.exists(tmp_path / "x")
    src = hf_models["next"]
    cases = [(dict(attention_bias=True), "attention_bias"),
             (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.25}), "rope type 'yarn'"),
             (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3}),
              "partial_rotary_factor"),
             (dict(layer_types=["linear_attention", "sliding_attention"] * 2), "sliding_attention"),
             (dict(linear_num_value_heads=3), "linear_num_value_heads"),
             (dict(mlp_only_layers=[0]), "mlp_only_layers")]
    for changes, needle in cases:
        bad = rewrite_config(src, str(tmp_path / re.sub(r"\W", "_", needle)), **changes)
        result = trestle_convert.run_raw("convert", "--from", "hf", bad, "--to", "trestle", str(tmp_path / "y"))
        assert result.returncode == 1 and needle in result.stderr and "Qwen3NextForCausalLM" in result.stderr, \
            (changes, result.stderr)
        assert not os.path.exists(tmp_path / "y")


# --- megatron-core's own GatedDeltaNet -----------------------------------------------------------------------------

# flash-linear-attention holds GPU kernels only, yet megatron-core's GatedDeltaNet refuses to be built without it. A
# stand-in gives it fla's l2norm formula (x * rsqrt(sum x^2 + 1e-6)); the delta rule itself runs as megatron-core's own
# torch_chunk_gated_delta_rule (deterministic_mode), the convolution as its nn.Conv1d path. (Needs sys, types, torch.)
FLA_STAND_IN = textwrap.dedent("""
    def _l2norm(x, dim=-1, eps=1e-6):
        return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)
    for _name in ("fla", "fla.modules", "fla.modules.l2norm", "fla.ops", "fla.ops.gated_delta_rule"):
        sys.modules[_name] = types.ModuleType(_name)
    sys.modules["fla.modules.l2norm"].l2norm = _l2norm
    sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = None
""")
MCORE_GDN = textwrap.dedent("""
    import json, os, sys, types, torch, torch.distributed as dist
    import torch.nn.functional as F
""") + FLA_STAND_IN + textwrap.dedent("""
    torch.cuda.current_device = lambda: "cpu"  # its conv1d and parameters are made on the current CUDA device
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    ckpt, config_path, inputs, out, port = sys.argv[1:6]
    c = json.load(open(config_path))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_key_value_heads"], kv_channels=c["head_dim"], normalization="RMSNorm",
        layernorm_epsilon=c["rms_norm_eps"], activation_func=F.silu, add_bias_linear=False,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(t == "linear_attention") for t in c["layer_types"]],
        linear_conv_kernel_dim=c["linear_conv_kernel_dim"], linear_key_head_dim=c["linear_key_head_dim"],
        linear_value_head_dim=c["linear_value_head_dim"], linear_num_key_heads=c["linear_num_key_heads"],
        linear_num_value_heads=c["linear_num_value_heads"], use_cpu_initialization=True, params_dtype=torch.float32,
        deterministic_mode=True, perform_initialization=False)
    gdn = GatedDeltaNet(config, GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                                        out_proj=RowParallelLinear),
                        layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    prefix = "decoder.layers.0.self_attention."
    sharded = {k: v for k, v in gdn.sharded_state_dict(prefix=prefix).items() if "_extra_state" not in k}
    loaded = dist_checkpointing.load(sharded, ckpt)
    # (load also returns common.pt's entries: args, iteration, ...)
    weights = {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}
    missing, unexpected = gdn.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    with torch.no_grad():
        gdn.out_norm.weight += 1  # Transformer Engine's zero-centred gamma, which the torch norm does not have
        x = torch.load(inputs)
        y, bias = gdn(x.transpose(0, 1).contiguous(), None)
    assert bias is None

    # Layer 1: megatron-core's SelfAttention (its local GPT layer spec) with the output gate, q/k norms and RoPE over a
    # quarter of each head.
    import dataclasses
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    config = dataclasses.replace(config, attention_output_gate=True, qk_layernorm=True, experimental_attention_variant=None,
                                 linear_attention_freq=None)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    attention = build_module(spec.submodules.self_attention, config=config, layer_number=2)
    prefix = "decoder.layers.1.self_attention."
    sharded = {k: v for k, v in attention.sharded_state_dict(prefix=prefix).items() if "_extra_state" not in k}
    loaded = dist_checkpointing.load(sharded, ckpt)
    missing, unexpected = attention.load_state_dict(
        {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    rope = RotaryEmbedding(kv_channels=c["head_dim"], rotary_percent=c["rope_parameters"]["partial_rotary_factor"],
                           rotary_base=c["rope_parameters"]["rope_theta"], use_cpu_initialization=True)
    import contextlib
    from megatron.core import tensor_parallel
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # no dropout (eval)
    attention.eval()
    n = x.shape[1]
    with torch.no_grad():
        attention.q_layernorm.weight += 1  # zero-centred, as above
        attention.k_layernorm.weight += 1
        z, _ = attention(x.transpose(0, 1).contiguous(), torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool), 1),
                         rotary_pos_emb=rope(n))
    torch.save({"gdn": y.transpose(0, 1).contiguous(), "attention": z.transpose(0, 1).contiguous(),
                "keys": sorted(sharded)}, out)
""")


def test_megatron_core_layers_load_and_compute_what_transformers_does(trestle_convert, hf_models, tmp_path):
    """megatron-core's GatedDeltaNet (local linear layers, on the CPU) loads layer 0 of a Trestle-written torch_dist
    checkpoint through dist_checkpointing, every part under megatron-core's own split keys and global shapes, and its
    forward equals transformers' Qwen3NextGatedDeltaNet of the same layer on the same input: the in_proj and conv1d
    parts, the heads' order, A_log, dt_bias and the zero-centred gated norm all land where megatron-core reads them.
    Likewise megatron-core's gated SelfAttention loads layer 1 and equals transformers' Qwen3NextAttention: the output
    gate's rows in linear_qkv, the q/k norms and the partial RoPE."""
    src = hf_models["next"]
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", src, "--to", "megatron-dist", dist, "-q")
    torch.manual_seed(5)
    x = torch.randn(2, 9, 32)
    torch.save(x, tmp_path / "x.pt")
    script = tmp_path / "mcore_gdn.py"
    script.write_text(MCORE_GDN)
    result = subprocess.run([sys.executable, script, iteration_dir(dist), os.path.join(src, "config.json"),
                             tmp_path / "x.pt", tmp_path / "y.pt", str(free_port())],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    got = torch.load(tmp_path / "y.pt")
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in got["keys"], got["keys"]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    n = x.shape[1]
    with torch.no_grad():
        torch.testing.assert_close(got["gdn"], model.model.layers[0].linear_attn(x), rtol=1e-4, atol=1e-5)
        position_embeddings = model.model.rotary_emb(x, torch.arange(n).unsqueeze(0))
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        expected, _ = model.model.layers[1].self_attn(x, position_embeddings=position_embeddings, attention_mask=causal)
    torch.testing.assert_close(got["attention"], expected, rtol=1e-4, atol=1e-5)


def test_gated_norm_weights_far_from_one_are_named_not_lost_silently(trestle_convert, hf_models, tmp_path):
    """megatron-core holds the gated norm zero-centred (weight - 1), rounded in the tensor's dtype as Megatron-Bridge
    rounds it: weights near 1 survive exactly (the round trips above), far ones may not. The conversion names the
    tensor and the loss, and --dtype float32 keeps every bit."""
    src = hf_models["q35"]
    tensors = load_hf_tensors(src)
    key = "model.layers.2.linear_attn.norm.weight"
    tensors[key] = torch.tensor([0.35, 0.001, 1.0, 1.5, 0.75, 300.0], dtype=torch.bfloat16)
    far = rewrite_tensors(src, str(tmp_path / "far"), tensors)
    result = trestle_convert.run_raw("convert", "--from", "hf", far, "--to", "trestle", tmp_path / "ckpt", "-q")
    assert result.returncode == 0, result.stderr
    note = f"note: 2 of 6 elements of '{key}'"
    assert note in result.stderr and "--dtype float32" in result.stderr, result.stderr  # even when quiet
    result = trestle_convert.run_raw("convert", "--from", "hf", far, "--to", "megatron-dist", tmp_path / "dist", "-q")
    assert result.returncode == 0 and note in result.stderr, result.stderr
    trestle_convert.run("convert", "--from", "trestle", tmp_path / "ckpt", "--to", "hf", tmp_path / "back", "-q")
    back = load_hf_tensors(tmp_path / "back")[key]
    assert torch.equal(back[2:], tensors[key][2:]) and not torch.equal(back[:2], tensors[key][:2])
    trestle_convert.run("convert", "--from", "hf", far, "--to", "trestle", tmp_path / "ckpt32", "--dtype", "float32",
                        "-q")
    trestle_convert.run("convert", "--from", "trestle", tmp_path / "ckpt32", "--to", "hf", tmp_path / "back32",
                        "--dtype", "bfloat16", "-q")
    assert_same_tensors(far, tmp_path / "back32")


# Qwen3-Next's whole GPTModel in megatron-core, for the trainer's first-step test (test_train_families.py): the local
# spec's layers on the CPU, with GatedDeltaNet (flash-linear-attention stood in for, as in MCORE_GDN above) in the layers
# linear_attention_freq marks, gated attention with q/k norms in the others, Qwen2-MoE's experts with the gated shared
# expert, and one MTP layer of the last layer's kind. Without Transformer Engine the norms are plain torch RMSNorms
# (no zero-centred gamma): the checkpoint stores every norm weight - 1, which is what Megatron's zero-centred (1 + w)
# weights are for the same function (exact in fp32 for weights in [0.5, 2]). The Gated DeltaNet layers' input norm is
# saved under Transformer Engine's name (self_attention.in_proj.layer_norm_weight), as the attention layers' are.
MCORE_MODEL = dict(BASE, **MOE, vocab_size=128, hidden_size=64, head_dim=16, linear_key_head_dim=8,
                   linear_value_head_dim=12, num_nextn_predict_layers=1, rms_norm_eps=1e-6, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
MCORE_QWEN3_NEXT = MCORE.split("def build(")[0] + "import copy, types\n" + FLA_STAND_IN + textwrap.dedent("""
    def build(c, port):  # Qwen3-Next's GPTModel (local spec, Gated DeltaNet hybrid, MTP) of HF config c, fp32
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
        from megatron.core.transformer.transformer_config import TransformerConfig
        parallel_state.initialize_model_parallel(1, 1)
        import contextlib
        from megatron.core import tensor_parallel  # GatedDeltaNet's initialisation forks the CUDA RNG tracker
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        torch.manual_seed(3)
        pattern = [int(t == "linear_attention") for t in c["layer_types"]]
        config = TransformerConfig(
            num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
            num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_key_value_heads"],
            kv_channels=c["head_dim"], normalization="RMSNorm", qk_layernorm=True, attention_output_gate=True,
            add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, layernorm_epsilon=c["rms_norm_eps"],
            num_moe_experts=c["num_experts"], moe_ffn_hidden_size=c["moe_intermediate_size"],
            moe_shared_expert_intermediate_size=c["shared_expert_intermediate_size"], moe_shared_expert_gate=True,
            moe_router_topk=c["num_experts_per_tok"], moe_router_pre_softmax=False, moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather", experimental_attention_variant="gated_delta_net",
            linear_attention_freq=pattern, linear_conv_kernel_dim=c["linear_conv_kernel_dim"],
            linear_key_head_dim=c["linear_key_head_dim"], linear_value_head_dim=c["linear_value_head_dim"],
            linear_num_key_heads=c["linear_num_key_heads"], linear_num_value_heads=c["linear_num_value_heads"],
            mtp_num_layers=1, deterministic_mode=True, use_cpu_initialization=True, params_dtype=torch.float32)
        attention = get_gpt_layer_local_spec(num_experts=c["num_experts"], moe_grouped_gemm=False, qk_layernorm=True,
                                             normalization="RMSNorm")
        linear = copy.deepcopy(attention)
        linear.submodules.self_attention = ModuleSpec(
            module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear))
        linear.submodules.sharded_state_dict_keys_map = dict(attention.submodules.sharded_state_dict_keys_map,
                                                             **{"input_layernorm.": "self_attention.in_proj.layer_norm_"})
        block = TransformerBlockSubmodules(layer_specs=[linear if p else attention for p in pattern],
                                           layer_norm=WrappedTorchNorm)
        mtp = get_gpt_mtp_block_spec(config, attention, use_transformer_engine=False)
        model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=c["vocab_size"],
                         max_sequence_length=64, position_embedding_type="rope",
                         rotary_percent=0.25, rotary_base=10000.0, share_embeddings_and_output_weights=False,
                         mtp_block_spec=mtp)
        norms = [p for n, p in model.named_parameters() if "norm" in n]
        save = dist_checkpointing.save

        def save_zero_centred(state, *args, **kwargs):  # the norms as Megatron's (1 + w) weights, then back
            with torch.no_grad():
                for p in norms:
                    p.sub_(1.0)
            try:
                return save(state, *args, **kwargs)
            finally:
                with torch.no_grad():
                    for p in norms:
                        p.add_(1.0)
        dist_checkpointing.save = save_zero_centred
        return config, model
""")


LEGACY_LAYOUTS = ci_cases([("next_mtp", 2, 1), ("next_mtp", 1, 2), ("next_mtp", 2, 2), ("q35_moe_mtp", 2, 1)],
                          [("next_mtp", 2, 2), ("q35_moe_mtp", 2, 1)])


@pytest.mark.parametrize("model,tp,ep", LEGACY_LAYOUTS, ids=[f"{m}-tp{t}-ep{e}" for m, t, e in LEGACY_LAYOUTS])
def test_megatron_core_legacy_tree_converts_back(trestle_convert, hf_models, tmp_path, model, tp, ep):
    """A legacy mp_rank tree as Megatron-LM saves megatron-core's own Qwen3-Next (MCORE_QWEN3_NEXT: the Gated DeltaNet
    hybrid, gated attention, experts with the gated shared expert, one MTP layer; and Qwen3.5-MoE with one) at tp x ep,
    from the weights of
    Trestle's torch_dist: each rank's Gated DeltaNet in_proj and conv1d are whole (their parts' tp slices one after
    another), its experts numbered from 0, its norms zero-centred. `convert --from megatron-legacy` gives back every
    source tensor bit-exactly."""
    src = hf_models.get(model)
    if model == "q35_moe_mtp":
        src = str(tmp_path / model)
        add_mtp_layer(hf_models["q35_moe"], src)
    root = legacy_tree_from_hf(trestle_convert, MCORE_QWEN3_NEXT, src, tmp_path, tp, ep, "--norms", "local")
    c = json.load(open(os.path.join(src, "config.json")))
    rank = torch.load(root / "iter_0000001" / ("mp_rank_00" + ("_000" if ep > 1 else "")) / "model_optim_rng.pt",
                      weights_only=False)["model"]
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    in_proj = (2 * hk * dk + 2 * hv * dv + 2 * hv) // tp  # [q; k; v; z; beta; alpha], each part's tp slice
    assert rank["decoder.layers.0.self_attention.in_proj.weight"].shape == (in_proj, c["hidden_size"])
    assert rank["decoder.layers.0.self_attention.conv1d.weight"].shape[0] == (2 * hk * dk + hv * dv) // tp
    assert "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight" in rank
    out = tmp_path / "hf"
    trestle_convert.run("convert", "--from", "megatron-legacy", root, "--to", "hf", out, "--hf-config", src, "-q",
                        *(["--hf-expert-layout", "fused"] if model == "q35_moe_mtp" else []))  # (as the source)
    assert_same_tensors(src, out)

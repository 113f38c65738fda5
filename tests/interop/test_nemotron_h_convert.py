"""Nemotron-H (NemotronHForCausalLM: Mamba-2 layers mixed with attention, MLP and, as in Nemotron 3, MoE layers)
through `trestle convert`, checked against transformers and against megatron-core's own MambaModel.

- tiny random models of awkward sizes (Mamba head dim 6, state 5, two groups; vocab 301; the hub's
  hybrid_override_pattern or transformers 5's layers_block_type) go hf -> trestle -> hf bit-exactly at several tp / pp
  layouts, and transformers' logits are unchanged by the round trip;
- every chunk of the Trestle checkpoint holds what megatron-core's MambaMixer names say (in_proj = [z; x; B; C; dt]
  saved as in_proj.weight.{z,x,B,C,dt}, conv1d over [x; B; C] as conv1d.{weight,bias}.{x,B,C}, each split over tp by
  heads or groups; the norms fused into the mixers' first linears under Transformer Engine's names), computed here
  from the HF tensors, on the stage Megatron puts its layer;
- MoE layers: the sigmoid router with its score bias, squared-ReLU experts (per expert on the hub; over ep), shared
  experts, the latent projections where moe_latent_size is set;
- torch_dist: per-layer keys, Megatron-LM's MambaModel args, and back to hf bit-exactly; inspect, reshard and diff;
- megatron-core's MambaModel (local layers on the CPU, mamba_ssm's GPU kernels replaced by torch code) loads the
  torch_dist checkpoint Trestle writes and computes transformers' logits; a checkpoint megatron-core saves converts to a
  Hugging Face model with megatron-core's weights and logits;
- what megatron-core cannot hold is refused naming it (`trestle train` trains the family: test_train_families.py).
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
from models import iteration_dir, load_hf_tensors, save_tiny_model  # noqa: E402
from ports import free_port  # noqa: E402
from test_megatron_bridge import (  # noqa: E402
    assembled, assert_same_tensors, read_manifest, rewrite_config, rewrite_tensors)
from script_server import reference_scripts  # noqa: E402
from test_megatron_dist_convert import MCORE_TIMEOUT_S, read_dcp  # noqa: E402
from ci_scope import ci_cases  # noqa: E402
from mcore_legacy import assert_converts_back, legacy_tree_from_hf  # noqa: E402

TOKENS = torch.tensor([[1, 5, 17, 42, 7, 99, 3, 11, 64, 2, 250, 13]])

BASE = dict(vocab_size=301, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            intermediate_size=40, mamba_num_heads=4, mamba_head_dim=6, ssm_state_size=5, n_groups=2, conv_kernel=4,
            chunk_size=8, max_position_embeddings=64, pad_token_id=0, time_step_min=0.01)
# (transformers' grouped-GEMM experts want rows of a multiple of 16 bytes: 24 and 16 bfloat16 elements)
MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, moe_shared_expert_intermediate_size=20,
           routed_scaling_factor=1.5)
MODELS = {
    "hybrid": dict(BASE, hybrid_override_pattern="M*M-M-"),
    # transformers' NemotronH keeps lm_head its own whatever tie_word_embeddings says: so does the bridge.
    "tied": dict(BASE, hybrid_override_pattern="M-*M", tie_word_embeddings=True),
    "one_group": dict(BASE, hybrid_override_pattern="M*M-", n_groups=1),  # tp 2 cannot split one group
    "no_attention": dict(BASE, hybrid_override_pattern="M-M-"),  # no attention layer to tell the norm names by
    # MoE layers (Nemotron 3): sigmoid router with the score bias, squared-ReLU experts and shared experts, the routed
    # experts in a latent space or not.
    "moe": dict(BASE, **MOE, hybrid_override_pattern="ME*M-E"),
    "moe_latent": dict(BASE, **MOE, hybrid_override_pattern="ME*M-E", moe_latent_size=16),
}


def hf_logits(directory, tokens):
    """transformers' logits for `tokens` (without its cache, which fails on a model without attention layers)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(tokens, use_cache=False).logits


def pattern_of(c):
    kinds = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
    if "layers_block_type" in c:
        return "".join(kinds[t] for t in c["layers_block_type"])
    return c["hybrid_override_pattern"]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for name, config in MODELS.items():
        model = save_tiny_model(str(root / name), "NemotronHConfig", config, seed=zlib.crc32(name.encode()),
                                dtype=torch.bfloat16)
        assert "layers_block_type" in json.load(open(root / name / "config.json"))  # transformers 5 saves the list
        del model
    # The hub's form of the same config: hybrid_override_pattern and num_hidden_layers instead of the list.
    hub = rewrite_config(str(root / "hybrid"), str(root / "hub"))
    c = json.load(open(os.path.join(hub, "config.json")))
    c["hybrid_override_pattern"] = pattern_of(c)
    c["num_hidden_layers"] = len(c.pop("layers_block_type"))
    json.dump(c, open(os.path.join(hub, "config.json"), "w"), indent=2)
    return {name: str(root / name) for name in (*MODELS, "hub")}


def mamba_sizes(c):
    inner, groups = c["mamba_num_heads"] * c["mamba_head_dim"], c["n_groups"] * c["ssm_state_size"]
    return inner, groups, c["mamba_num_heads"]


def interleave_qkv(q, k, v, groups, d):
    """megatron-core's linear_qkv: per query group its heads' queries, then its key and value."""
    per = q.shape[0] // (groups * d)
    out = []
    for g in range(groups):
        out += [q[g * per * d:(g + 1) * per * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    return torch.cat(out)


def expected_megatron(hf, c, name):
    """The canonical Megatron tensor `name` made from the HF tensors as megatron-core's MambaModel lays it out
    (Trestle's norm names under either spec)."""
    simple = {"embedding.word_embeddings.weight": "backbone.embeddings.weight",
              "decoder.final_norm.weight": "backbone.norm_f.weight", "output_layer.weight": "lm_head.weight"}
    if name in simple:
        return hf[simple[name]]
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    assert m, name
    p, rest = f"backbone.layers.{m.group(1)}.", m.group(2)
    x = p + "mixer."
    if rest in ("mixer.in_proj.layer_norm_weight", "norm.weight", "self_attention.linear_qkv.layer_norm_weight",
                "input_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"):
        return hf[p + "norm.weight"]
    inner, groups, heads = mamba_sizes(c)
    part = re.fullmatch(r"mixer\.in_proj\.weight\.(z|x|B|C|dt)", rest)
    if part:
        parts = torch.split(hf[x + "in_proj.weight"], [inner, inner, groups, groups, heads])
        return dict(zip("z x B C dt".split(), parts, strict=True))[part.group(1)]
    part = re.fullmatch(r"mixer\.conv1d\.(weight|bias)\.(x|B|C)", rest)
    if part:
        return dict(zip("x B C".split(), torch.split(hf[x + "conv1d." + part.group(1)], [inner, groups, groups]),
                        strict=True))[part.group(2)]
    if rest == "self_attention.linear_qkv.weight":
        return interleave_qkv(hf[x + "q_proj.weight"], hf[x + "k_proj.weight"], hf[x + "v_proj.weight"],
                              c["num_key_value_heads"], c["head_dim"])
    expert = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", rest)
    if expert:
        return hf[x + f"experts.{expert.group(1)}." + ("up_proj.weight" if expert.group(2) == "1" else "down_proj.weight")]
    renamed = {"self_attention.linear_proj.weight": "o_proj.weight", "mlp.linear_fc1.weight": "up_proj.weight",
               "mlp.linear_fc2.weight": "down_proj.weight", "mlp.router.weight": "gate.weight",
               "mlp.router.expert_bias": "gate.e_score_correction_bias",
               "mlp.shared_experts.linear_fc1.weight": "shared_experts.up_proj.weight",
               "mlp.shared_experts.linear_fc2.weight": "shared_experts.down_proj.weight",
               "mlp.fc1_latent_proj.weight": "fc1_latent_proj.weight", "mlp.fc2_latent_proj.weight":
               "fc2_latent_proj.weight"}
    if rest in renamed:
        return hf[x + renamed[rest]]
    assert rest.startswith("mixer."), rest
    return hf[x + rest[len("mixer."):]]  # A_log, D, dt_bias, norm.weight, out_proj.weight


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


def check_trestle_checkpoint(hf_dir, ckpt, tp, pp, ep=1):
    """Every canonical tensor, put together from its chunks (each element exactly once), equals the HF-made one and
    sits on its layer's stage (experts on their EP rank); Mamba parts split over tp as whole heads (z, x, dt) or whole
    groups (B, C)."""
    hf = load_hf_tensors(hf_dir)
    c = json.load(open(os.path.join(hf_dir, "config.json")))
    pattern = pattern_of(c)
    iteration_dir_, manifest = read_manifest(ckpt)
    names = set(manifest["tensors"])
    for i, kind in enumerate(pattern):
        assert (f"decoder.layers.{i}.mixer.in_proj.weight.z" in names) == (kind == "M"), i
        assert (f"decoder.layers.{i}.self_attention.linear_qkv.weight" in names) == (kind == "*"), i
        assert (f"decoder.layers.{i}.mlp.linear_fc1.weight" in names) == (kind == "-"), i
        assert (f"decoder.layers.{i}.mlp.router.expert_bias" in names) == (kind == "E"), i
    inner, groups, heads = mamba_sizes(c)
    for name, entry in manifest["tensors"].items():
        expected = expected_megatron(hf, c, name)
        assert list(expected.shape) == entry["global_shape"], name
        layer = re.match(r"decoder\.layers\.(\d+)\.", name)
        first = name.startswith("embedding")
        stage = int(layer.group(1)) // (len(pattern) // pp) if layer else (0 if first else pp - 1)
        expert = re.search(r"local_experts\.(\d+)\.", name)
        whole, placed = assembled(iteration_dir_, entry)
        for rank, chunk in placed:
            assert rank // (tp * ep) == stage, f"{name} on pipeline rank {rank // (tp * ep)}, expected {stage}"
            if expert:
                assert (rank // tp) % ep == int(expert.group(1)) // (c["n_routed_experts"] // ep), name
            if tp > 1 and re.search(r"\.(in_proj\.weight|conv1d\.(weight|bias))\.(B|C)$", name):
                assert chunk["shape"][0] == groups // tp and chunk["offset"][0] % c["ssm_state_size"] == 0, name
            if tp > 1 and re.search(r"\.in_proj\.weight\.(z|x)$|conv1d\.weight\.x$|mixer\.norm\.weight$", name):
                assert chunk["shape"][0] == inner // tp and chunk["offset"][0] % c["mamba_head_dim"] == 0, name
        assert torch.equal(bits(whole), bits(expected)), name
    return manifest


# (model, tp, pp, ep, norms)
LAYOUTS = [
    ("hybrid", 1, 1, 1, "te"),
    ("hybrid", 2, 2, 1, "local"),
    ("hub", 2, 1, 1, "te"),
    ("tied", 1, 2, 1, "local"),
    ("tied", 2, 2, 1, "te"),
    ("no_attention", 2, 2, 1, "te"),
    ("moe", 2, 2, 2, "te"),
    ("moe_latent", 1, 2, 2, "local"),
    ("moe_latent", 2, 1, 1, "te"),
]


@pytest.mark.parametrize("model,tp,pp,ep,norms", LAYOUTS,
                         ids=[f"{m}-tp{t}-pp{p}-ep{e}-{n}" for m, t, p, e, n in LAYOUTS])
def test_round_trip_megatron_names_and_logits(trestle_convert, hf_models, tmp_path, model, tp, pp, ep, norms):
    src = hf_models[model]
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    trestle_convert.run("convert", "--from", "hf", src, "--to", "trestle", ckpt, "--tp", tp, "--pp", pp, "--ep", ep,
                        "--norms", norms, "--codec", "raw", "-q")
    manifest = check_trestle_checkpoint(src, ckpt, tp, pp, ep)
    megatron = manifest["model"]["megatron"]
    config = json.load(open(os.path.join(src, "config.json")))
    assert megatron["hybrid_override_pattern"] == pattern_of(config)
    assert (megatron["mamba_num_heads"], megatron["mamba_head_dim"], megatron["mamba_state_dim"],
            megatron["mamba_num_groups"], megatron["mamba_conv_kernel"]) == (4, 6, 5, config["n_groups"], 4)
    assert megatron["activation"] == "squared_relu" and megatron["position_embedding_type"] == "none"
    assert megatron["num_layers"] == len(pattern_of(config))
    te = norms == "te"
    assert ("decoder.layers.0.mixer.in_proj.layer_norm_weight" in manifest["tensors"]) == te
    assert ("decoder.layers.0.norm.weight" in manifest["tensors"]) == (not te)
    assert "output_layer.weight" in manifest["tensors"]  # (transformers' NemotronH never ties it)
    if model.startswith("moe"):
        assert (megatron["num_experts"], megatron["moe_ffn_hidden_size"], megatron["dense_ffn_hidden_size"],
                megatron["moe_shared_expert_intermediate_size"]) == (4, 24, 40, 20)
        assert megatron["moe_router_score_function"] == "sigmoid" and megatron["moe_router_enable_expert_bias"]
        assert megatron["moe_router_topk_scaling_factor"] == 1.5
        assert megatron.get("moe_latent_size") == config.get("moe_latent_size")

    verified = trestle_convert.run("verify", "--against", src, ckpt)
    assert "max abs diff 0, 0 above tolerance" in verified

    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_same_tensors(src, back)
    assert json.load(open(os.path.join(back, "config.json"))) == config
    if (tp, pp) in ((1, 1), (2, 2)) or model == "moe_latent":
        torch.testing.assert_close(hf_logits(back, TOKENS), hf_logits(src, TOKENS), rtol=0, atol=0)


def test_logits_depend_on_what_is_converted(hf_models, tmp_path):
    """The tiny model's logits change when any Mamba part, the attention or the MLP moves, so the logits check above
    would see a misplaced one."""
    src = hf_models["hybrid"]
    base = hf_logits(src, TOKENS)
    for key in ("backbone.layers.0.mixer.in_proj.weight", "backbone.layers.0.mixer.conv1d.weight",
                "backbone.layers.0.mixer.conv1d.bias", "backbone.layers.2.mixer.A_log", "backbone.layers.2.mixer.D",
                "backbone.layers.2.mixer.dt_bias", "backbone.layers.4.mixer.norm.weight",
                "backbone.layers.1.mixer.k_proj.weight", "backbone.layers.3.mixer.up_proj.weight",
                "backbone.layers.3.norm.weight"):
        tensors = load_hf_tensors(src)
        tensors[key] = tensors[key].flip(0)
        changed = rewrite_tensors(src, str(tmp_path / key.replace(".", "_")), tensors)
        assert not torch.equal(hf_logits(changed, TOKENS), base), key


DIST_LAYOUTS = [("hybrid", 2, 2, 1, "te"), ("tied", 1, 1, 1, "local"), ("moe_latent", 2, 2, 2, "local")]


@pytest.mark.parametrize("model,tp,pp,ep,norms", DIST_LAYOUTS,
                         ids=[f"{m}-tp{t}-pp{p}-ep{e}-{n}" for m, t, p, e, n in DIST_LAYOUTS])
def test_torch_dist_keys_args_and_back(trestle_convert, hf_models, tmp_path, model, tp, pp, ep, norms):
    src = hf_models[model]
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", src, "--to", "megatron-dist", dist, "--tp", tp, "--pp", pp,
                        "--ep", ep, "--norms", norms, "-q")
    it = iteration_dir(dist)
    assert len([f for f in os.listdir(it) if f.endswith(".distcp")]) == tp * pp * ep
    hf = load_hf_tensors(src)
    c = json.load(open(os.path.join(src, "config.json")))
    state = read_dcp(it)
    # Per-layer keys, the Mamba parts under megatron-core's split names, Transformer Engine's norm names whatever the
    # spec, MambaModel's final norm.
    assert "decoder.layers.0.mixer.in_proj.weight.z" in state and "decoder.layers.0.mixer.conv1d.bias.C" in state
    assert "decoder.layers.0.mixer.in_proj.layer_norm_weight" in state
    assert "decoder.final_norm.weight" in state
    assert not any(k.startswith("decoder.layers.mixer") for k in state)
    compared = 0
    for key, value in state.items():
        experts = re.fullmatch(r"(decoder\.layers\.\d+\.)mlp\.experts\.experts\.(.+)", key)
        if experts:  # [experts, ...] (MoE layers: the pre-MLP norm saved under its own name, not fused)
            for e in range(c["n_routed_experts"]):
                name = f"{experts.group(1)}mlp.experts.local_experts.{e}.{experts.group(2)}"
                assert torch.equal(bits(value[e]), bits(expected_megatron(hf, c, name))), name
            compared += 1
        elif key.startswith(("decoder.", "embedding.", "output_layer.")) and "_extra_state" not in key:
            expected = expected_megatron(hf, c, key)
            assert torch.equal(bits(value[:expected.shape[0]]), bits(expected)), key
            compared += 1
    assert compared == len([k for k in state if "_extra_state" not in k and k.startswith(("decoder", "embedding",
                                                                                           "output"))]) > 30
    if model.startswith("moe"):
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in state and "decoder.layers.1.mlp.router.expert_bias" in state
        from torch.distributed.checkpoint import FileSystemReader
        keys = FileSystemReader(str(it)).read_metadata().state_dict_metadata
        assert "decoder.layers.1.mlp.fc1_latent_proj._extra_state/shard_0_1" in keys  # asked for by its TE linear
    args = torch.load(os.path.join(it, "common.pt"), weights_only=False)["args"]
    assert args.is_hybrid_model and args.hybrid_override_pattern == pattern_of(c)
    assert (args.mamba_num_heads, args.mamba_head_dim, args.mamba_state_dim, args.mamba_num_groups) == (4, 6, 5, 2)
    assert args.squared_relu and not args.swiglu and args.position_embedding_type == "none"
    assert args.spec == ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
    if model.startswith("moe"):
        assert (args.num_experts, args.moe_ffn_hidden_size, args.ffn_hidden_size, args.moe_latent_size) == (4, 24, 40, 16)
        assert args.moe_router_score_function == "sigmoid" and args.moe_router_enable_expert_bias
        assert args.moe_shared_expert_intermediate_size == 20 and args.moe_router_topk_scaling_factor == 1.5

    back = tmp_path / "back"
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", back, "-q")
    assert_same_tensors(src, back)
    os.remove(os.path.join(it, "trestle_model.json"))
    back_cfg = tmp_path / "back_cfg"
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", back_cfg, "--hf-config", src, "-q")
    assert_same_tensors(src, back_cfg)


def test_inspect_reshard_and_diff(trestle_convert, hf_models, tmp_path):
    out = trestle_convert.run("inspect", hf_models["hub"])
    assert "Nemotron-H family -> Megatron-Core MambaModel (layers M*M-M-)" in out, out
    assert "layers 6," in out
    info = json.loads(trestle_convert.run("inspect", hf_models["moe_latent"], "--json"))
    assert info["config"]["bridge"]["hybrid_override_pattern"] == "ME*M-E"
    a, b, dist = tmp_path / "a", tmp_path / "b", tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", hf_models["moe_latent"], "--to", "trestle", a, "-q")
    trestle_convert.run("reshard", a, b, "--tp", 2, "--pp", 2, "--ep", 2, "-q")
    assert trestle_convert.run_raw("diff", a, b, "-q").returncode == 0  # the same model in two layouts
    check_trestle_checkpoint(hf_models["moe_latent"], b, 2, 2, 2)
    trestle_convert.run("convert", "--from", "trestle", b, "--to", "megatron-dist", dist, "--tp", 1, "--pp", 3, "-q")
    assert trestle_convert.run_raw("diff", a, dist, "-q").returncode == 0  # and through torch_dist
    described = trestle_convert.run("inspect", b)  # the model the checkpoint keeps, in a line
    assert "model         NemotronHForCausalLM: 6 layers (ME*M-E), hidden 32, ffn 24, heads 4 (2 KV groups), vocab " \
           "301, 4 experts (top-2); the whole description: inspect --json" in described, described[:2000]
    kept = json.loads(trestle_convert.run("inspect", b, "--json"))["model"]["megatron"]
    assert kept["hybrid_override_pattern"] == "ME*M-E" and kept["moe_latent_size"] == 16


def test_what_megatron_cannot_hold_is_refused(trestle_convert, hf_models, tmp_path):
    src = hf_models["hybrid"]
    result = trestle_convert.run_raw("convert", "--from", "hf", hf_models["one_group"], "--to", "trestle",
                                     str(tmp_path / "x"), "--tp", "2")
    assert result.returncode == 1 and "number of Mamba groups (n_groups)" in result.stderr, result.stderr
    assert not os.path.exists(tmp_path / "x")
    moe_types = ["linear_attention", "full_attention", "moe", "linear_attention", "mlp", "linear_attention"]
    cases = [
        (dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=False,
              layers_block_type=moe_types), "norm_topk_prob = false"),
        (dict(conv_kernel=3), "conv_kernel 3"),
        (dict(mlp_hidden_act="silu"), "mlp_hidden_act 'silu'"),
        (dict(use_conv_bias=False), "use_conv_bias = false"),
        (dict(use_bias=True), "use_bias = true"),
        (dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon"),
        (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers 1"),
        (dict(mamba_num_heads=3), "mamba_num_heads (3) is not a multiple of n_groups (2)"),
        (dict(num_hidden_layers=5), "num_hidden_layers 5 but the layer pattern names 6 layers"),
        (dict(layers_block_type=["linear_attention", "cross_attention"] * 3), "layer type \"cross_attention\""),
    ]
    for changes, needle in cases:
        bad = rewrite_config(src, str(tmp_path / re.sub(r"\W", "_", needle)), **changes)
        result = trestle_convert.run_raw("convert", "--from", "hf", bad, "--to", "trestle", str(tmp_path / "y"))
        assert result.returncode == 1 and needle in result.stderr and "NemotronHForCausalLM" in result.stderr, \
            (changes, result.stderr)
        assert not os.path.exists(tmp_path / "y")


# --- megatron-core's own MambaModel --------------------------------------------------------------------------------

# megatron-core 0.16 ships no MambaModel spec without Transformer Engine, and its MambaMixer imports mamba_ssm's GPU
# kernels. This builds the model from megatron-core's own local layers (ColumnParallelLinear, SelfAttention, MLP,
# WrappedTorchNorm) with the norm-key maps its TE spec implies, and stands in for mamba_ssm with torch code: its gated
# RMSNorm (silu(z) gate first, then RMSNorm over groups) and the SSD scan as transformers' torch implementation of the
# same Mamba-2 chunked scan. Run as a script: save or load a torch_dist checkpoint, dump the model's weights and logits.
MCORE_MAMBA = textwrap.dedent("""
    import contextlib, json, os, sys, types
    import torch, torch.nn as nn
    import torch.distributed as dist

    class GatedRMSNorm(nn.Module):  # mamba_ssm.ops.triton.layernorm_gated.RMSNorm
        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
            super().__init__()
            self.eps, self.group_size, self.norm_before_gate = eps, group_size or hidden_size, norm_before_gate
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
            self.register_parameter("bias", None)

        def forward(self, x, z=None):
            dtype = x.dtype
            x = x.float()
            assert not self.norm_before_gate
            if z is not None:
                x = x * torch.nn.functional.silu(z.float())
            g = x.view(*x.shape[:-1], -1, self.group_size)
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
            return (g.view_as(x) * self.weight.float()).to(dtype)

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m

    from transformers.models.nemotron_h import modeling_nemotron_h
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):
        module(name)
    module("mamba_ssm.ops.triton.layernorm_gated", RMSNorm=GatedRMSNorm)
    module("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=modeling_nemotron_h.mamba2_chunk_scan,
           mamba_split_conv1d_scan_combined=None)
    module("mamba_ssm.ops.triton.selective_state_update", selective_state_update=None)
    torch.cuda.current_device = lambda: "cpu"  # MambaMixer makes its parameters on the current CUDA device

    class NoRng:
        def fork(self, *a, **k):
            return contextlib.nullcontext()

    def build(c, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import parallel_state, tensor_parallel
        parallel_state.initialize_model_parallel(1, 1)
        import megatron.core.ssm.mamba_block as mamba_block
        import megatron.core.ssm.mamba_mixer as mamba_mixer
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
        from megatron.core.models.mamba.mamba_model import MambaModel
        from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
        from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
        from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
        from megatron.core.ssm.mlp_layer import MLPLayer
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.mlp import MLP, MLPSubmodules
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.torch_norm import WrappedTorchNorm as Norm
        from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,
                                                                 TransformerLayerSubmodules)
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        import megatron.core.transformer.moe.moe_utils as moe_utils
        moe_utils.te_general_gemm = None  # (its CPU path checks for Transformer Engine's GEMM by name)
        mamba_mixer.get_cuda_rng_tracker = tensor_parallel.get_cuda_rng_tracker = lambda: NoRng()
        experts = c.get("n_routed_experts", 0) if "E" in c["pattern"] else 0
        mamba_block.TENorm = Norm  # the stack's final norm is Transformer Engine's whatever the spec
        spec = ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
            mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
                norm=Norm, mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                    in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
                mamba_bda=get_bias_dropout_add, sharded_state_dict_keys_map={"norm.": "mixer.in_proj.layer_norm_"})),
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
                input_layernorm=Norm, self_attention=ModuleSpec(
                    module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                    submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear,
                                                       core_attention=DotProductAttention,
                                                       linear_proj=RowParallelLinear)),
                self_attn_bda=get_bias_dropout_add,
                sharded_state_dict_keys_map={"input_layernorm.": "self_attention.linear_qkv.layer_norm_"})),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=Norm, mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(
                    linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
                mlp_bda=get_bias_dropout_add,
                sharded_state_dict_keys_map={"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"})),
            moe_layer=ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=Norm, mlp=get_moe_module_spec(use_te=False, num_experts=max(experts, 1),
                                                                moe_grouped_gemm=False),
                mlp_bda=get_bias_dropout_add)),
        ))
        moe = dict(num_moe_experts=experts, moe_router_topk=c["num_experts_per_tok"],
                   moe_ffn_hidden_size=c["moe_intermediate_size"],
                   moe_shared_expert_intermediate_size=c["moe_shared_expert_intermediate_size"],
                   moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                   moe_router_topk_scaling_factor=c["routed_scaling_factor"], moe_token_dispatcher_type="allgather",
                   moe_router_dtype="fp32") if experts else {}
        config = TransformerConfig(
            num_layers=len(c["pattern"]), hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
            num_query_groups=c["num_key_value_heads"], kv_channels=c["head_dim"],
            ffn_hidden_size=c["intermediate_size"],
            normalization="RMSNorm", layernorm_epsilon=c["layer_norm_epsilon"], add_bias_linear=False,
            gated_linear_unit=False, activation_func=lambda x: torch.relu(x).pow(2), is_hybrid_model=True,
            mamba_state_dim=c["ssm_state_size"], mamba_head_dim=c["mamba_head_dim"], mamba_num_groups=c["n_groups"],
            mamba_num_heads=c["mamba_num_heads"], use_cpu_initialization=True, use_mamba_mem_eff_path=False,
            params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
            persist_layer_norm=False, **moe)
        model = MambaModel(config=config, mamba_stack_spec=spec, vocab_size=c["vocab_size"],
                           max_sequence_length=c["max_position_embeddings"], hybrid_override_pattern=c["pattern"],
                           share_embeddings_and_output_weights=c.get("tie_word_embeddings", False),
                           position_embedding_type="none")
        return model.eval()

    def main():
        mode, ckpt, out, port, config = sys.argv[1:6]
        c = json.loads(config)
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
        from safetensors.torch import save_file
        model = build(c, port)
        sharded = model.sharded_state_dict()
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import apply_factories
        probe = model.sharded_state_dict()
        apply_factories(probe)  # in_proj and conv1d become their parts
        keys = sorted(v.key for v in nested_values(probe) if hasattr(v, "key") and "_extra_state" not in v.key)
        if mode == "save":  # megatron-core's own weights: random, its norms moved off 1
            torch.manual_seed(11)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.dim() == 1:
                        p.add_(torch.randn_like(p) * 0.1)
            torch.cuda.synchronize = lambda *a: None
            dist_checkpointing.save(sharded, ckpt, sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1,
                                                                                                thread_count=1))
        else:
            loaded = dist_checkpointing.load({k: v for k, v in sharded.items() if "_extra_state" not in k}, ckpt)
            missing, unexpected = model.load_state_dict(
                {k: v for k, v in loaded.items() if k in model.state_dict()}, strict=False)
            assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
        tokens = torch.tensor(c["tokens"])
        n = tokens.shape[1]
        with torch.no_grad():
            logits = model(tokens, torch.arange(n)[None], torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool), 1))
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        save_file(state, os.path.join(out, "model.safetensors"))
        torch.save({"logits": logits, "keys": keys}, os.path.join(out, "logits.pt"))
        dist.destroy_process_group()

    if __name__ == "__main__":  # megatron-core's checkpoint writer starts a process that imports this file
        main()
""")


def fp32_logits(directory, tmp_path):
    """transformers' logits in fp32 without its clamp of each Mamba step size dt at time_step_min, which megatron-core's
    MambaMixer does not apply (the weights are the same either way; the clamp is the one place the two frameworks
    compute differently, for steps below the minimum)."""
    unclamped = rewrite_config(directory, str(tmp_path / ("unclamped_" + os.path.basename(directory))),
                               time_step_min=1e-30)
    model = transformers.AutoModelForCausalLM.from_pretrained(unclamped, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS, use_cache=False).logits


def run_mcore_mamba(tmp_path, mode, ckpt, src):
    c = json.load(open(os.path.join(src, "config.json")))
    c["pattern"] = pattern_of(c)
    c["tokens"] = TOKENS.tolist()
    c["vocab_size"] = -(-c["vocab_size"] // 128) * 128  # Megatron's padded vocab (make_vocab_size_divisible_by 128)
    script = tmp_path / f"mcore_mamba_{mode}.py"
    script.write_text(MCORE_MAMBA)
    out = tmp_path / f"mcore_{mode}"
    out.mkdir()
    result = reference_scripts().run([script, mode, ckpt, out, str(free_port()), json.dumps(c)],
                                     timeout=MCORE_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-4000:]
    got = torch.load(out / "logits.pt")
    return got["logits"], got["keys"], safetensors_torch.load_file(out / "model.safetensors")


@pytest.mark.parametrize("model", ["hybrid", "moe"])
def test_megatron_core_mamba_model_loads_trestle_and_saves_for_trestle(trestle_convert, hf_models, tmp_path, model):
    """megatron-core's MambaModel loads the torch_dist checkpoint Trestle writes (every key it asks for, under its own
    split names and global shapes), holds exactly the mapped weights, and computes transformers' logits; the other way,
    a checkpoint megatron-core saves from weights of its own converts (with --hf-config) to a Hugging Face model that
    holds them and computes megatron-core's logits. With MoE layers (not latent: megatron-core builds latent MoE with
    Transformer Engine only) its router, experts and shared experts too."""
    src = hf_models[model]
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", src, "--to", "megatron-dist", dist, "-q")
    logits, keys, state = run_mcore_mamba(tmp_path, "load", iteration_dir(dist), src)
    assert "decoder.layers.0.mixer.in_proj.weight.dt" in keys and "decoder.layers.0.mixer.conv1d.weight.B" in keys
    hf = {k: v.float() for k, v in load_hf_tensors(src).items()}
    c = json.load(open(os.path.join(src, "config.json")))
    inner, groups, heads = mamba_sizes(c)
    for name, value in state.items():
        if name.endswith(("_extra_state", "local_tokens_per_expert")):  # (the router's load counter, not a weight)
            continue
        if name.endswith(("mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.conv1d.bias")):  # the parts joined
            expected = hf["backbone." + name[len("decoder."):]]
        else:
            key = {"norm.weight": "mixer.in_proj.layer_norm_weight", "input_layernorm.weight":
                   "self_attention.linear_qkv.layer_norm_weight", "pre_mlp_layernorm.weight":
                   "mlp.linear_fc1.layer_norm_weight"}
            m = re.fullmatch(r"(decoder\.layers\.\d+\.)(.+)", name)
            canonical = m.group(1) + key.get(m.group(2), m.group(2)) if m else name
            expected = expected_megatron(hf, c, canonical)
        assert torch.equal(value[:expected.shape[0]], expected), name
    transformers_logits = fp32_logits(src, tmp_path)
    torch.testing.assert_close(logits[:, :, :c["vocab_size"]], transformers_logits, rtol=1e-4, atol=1e-4)


    saved = tmp_path / "mcore_ckpt"
    saved.mkdir()
    logits, _, state = run_mcore_mamba(tmp_path, "save", saved, src)
    back = tmp_path / "from_mcore"
    trestle_convert.run("convert", "--from", "megatron-dist", saved, "--to", "hf", back, "--hf-config", src, "-q")
    converted = load_hf_tensors(back)
    for i, kind in enumerate(pattern_of(c)):
        p, x = f"decoder.layers.{i}.", f"backbone.layers.{i}.mixer."
        if kind == "M":
            assert torch.equal(converted[x + "in_proj.weight"], state[p + "mixer.in_proj.weight"])
            assert torch.equal(converted[x + "conv1d.weight"], state[p + "mixer.conv1d.weight"])
            assert torch.equal(converted[f"backbone.layers.{i}.norm.weight"], state[p + "norm.weight"])
    torch.testing.assert_close(fp32_logits(str(back), tmp_path), logits[:, :, :c["vocab_size"]], rtol=1e-4, atol=1e-4)


LEGACY_LAYOUTS = ci_cases([("hybrid", 2, 1), ("moe", 2, 1), ("moe", 1, 2), ("moe", 2, 2)], [("moe", 2, 2)])


@pytest.mark.parametrize("model,tp,ep", LEGACY_LAYOUTS, ids=[f"{m}-tp{t}-ep{e}" for m, t, e in LEGACY_LAYOUTS])
def test_megatron_core_legacy_tree_converts_back(trestle_convert, hf_models, tmp_path, model, tp, ep):
    """A legacy mp_rank tree as Megatron-LM saves megatron-core's own MambaModel (MCORE_MAMBA) at tp x ep, from the
    weights of Trestle's torch_dist: each rank's mixer in_proj and conv1d whole (their parts' tp slices one after
    another: z, x, B, C, dt), experts numbered from 0 on each ep rank, the router's token counter beside its bias.
    `convert --from megatron-legacy` gives back every source tensor's value."""
    src = hf_models[model]
    c = json.load(open(os.path.join(src, "config.json")))
    root = legacy_tree_from_hf(trestle_convert, MCORE_MAMBA, src, tmp_path, tp, ep, config={"pattern": pattern_of(c)})
    rank = torch.load(root / "iter_0000001" / (f"mp_rank_{tp - 1:02d}" + ("_001" if ep > 1 else "")) /
                      "model_optim_rng.pt",
                      weights_only=False)["model"]
    inner, groups, heads = mamba_sizes(c)
    assert rank["decoder.layers.0.mixer.in_proj.weight"].shape == ((2 * inner + 2 * groups + heads) // tp,
                                                                   c["hidden_size"])
    assert_converts_back(trestle_convert, root, src, tmp_path / "back")

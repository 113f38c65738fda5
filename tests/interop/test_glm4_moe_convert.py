"""GLM-4.5 / GLM-4.7 (Glm4MoeForCausalLM) through `trestle convert`, checked against transformers and megatron-core:

- tiny random models (2 dense + 2 MoE layers with q/k/v biases, q/k norms and group-limited routing; 1 dense + 3 MoE
  layers with neither; RoPE over half of each head, partial_rotary_factor 0.5) go hf -> trestle in tp 1/2 x pp 1/2 x
  ep 1/2 -> hf bit-exactly, transformers' logits equal on the way back;
- every chunk of the Trestle checkpoint holds what Megatron-Core's names say (Megatron-Bridge's glm45_bridge.py:
  q/k/v -> linear_qkv (bias too), q_norm -> q_layernorm, gate.e_score_correction_bias -> router.expert_bias,
  shared_experts -> mlp.shared_experts, MTP layer model.layers.<L>.* -> mtp.layers.0.*), computed here from the HF
  tensors, on the pipeline stage and expert-parallel rank Megatron puts it;
- a checkpoint with a multi-token-prediction layer (model.layers.<num_layers>.*, which transformers neither saves nor
  loads) carries it as mtp.layers.0.* on the last stage;
- `inspect`, `verify` and `diff` see the family; what Megatron-Core would compute differently is refused naming the
  config field;
- torch_dist: per-layer keys (the first layers are dense), Megatron-LM's args (rotary_percent, moe_layer_freq, sigmoid
  router, qk_layernorm, add_qkv_bias), back to hf bit-exactly; megatron-core's own GPTModel (local spec, GQA with
  rotary_percent 0.5, sigmoid router with expert bias, shared experts, MTP, on CPU) loads a Trestle-written
  checkpoint strictly and its save converts to the same tensors.
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
from test_deepseek_convert import add_mtp_layer, gated_mlp_tensor, layer_tensor_name  # noqa: E402
from test_megatron_bridge import (  # noqa: E402
    TORCH_DTYPES, assert_same_tensors, read_manifest, rewrite_config, rewrite_tensors)
from test_megatron_dist_convert import MCORE, read_dcp, run_mcore  # noqa: E402
from ci_scope import ci_cases  # noqa: E402
from mcore_legacy import assert_mtp_moe_tree_converts_back  # noqa: E402

TOKENS = torch.tensor([[1, 5, 17, 42, 7, 99, 3, 11, 64, 2]])

BASE = dict(vocab_size=301, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
            pad_token_id=0)
MODELS = {
    # GLM-4.5's shape: q/k/v biases, q/k norms, two shared experts, 2 groups of which 1 is kept, scaled weights.
    "qk": dict(BASE, first_k_dense_replace=2, n_shared_experts=2, attention_bias=True, use_qk_norm=True, n_group=2,
               topk_group=1, routed_scaling_factor=2.5),
    # GLM-4.5-Air's: no norms or biases, one dense layer, one group.
    "plain": dict(BASE, first_k_dense_replace=1, n_shared_experts=1, attention_bias=False, use_qk_norm=False,
                  n_group=1, topk_group=1),
}


def save_glm(directory, name, config=None, dtype=torch.bfloat16):
    save_tiny_model(str(directory), "Glm4MoeConfig", config or MODELS[name], seed=zlib.crc32(name.encode()),
                    dtype=dtype, save_original_format=True)
    # The router's correction bias is a buffer (zeros at init): make it tell experts apart, as a trained one does.
    tensors = load_hf_tensors(directory)
    for key in tensors:
        if key.endswith("e_score_correction_bias"):
            tensors[key] = torch.randn(tensors[key].shape, generator=torch.Generator().manual_seed(len(key)))
    for f in os.listdir(directory):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(directory, f))
    safetensors_torch.save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for name in MODELS:
        save_glm(root / name, name)
    add_mtp_layer(root / "qk", root / "qk_mtp")
    return {name: str(root / name) for name in (*MODELS, "qk_mtp")}


def qkv(q, k, v, groups):
    """Megatron's per-group order: each KV group's query rows, then its key rows, then its value rows."""
    def per_group(t):
        return t.reshape(groups, -1, *t.shape[1:])
    return torch.cat([per_group(q), per_group(k), per_group(v)], dim=1).reshape(-1, *q.shape[1:])


def expected_megatron(hf, config, name, norms):
    """The global canonical tensor Megatron-Core names `name`, made from the HF tensors (Megatron-Bridge's mapping)."""
    layers, groups = config["num_hidden_layers"], config["num_key_value_heads"]
    whole, p, rest = layer_tensor_name(hf, name, layers)
    if whole is not None:
        return whole
    # Local names in a Trestle checkpoint under local norms; Transformer Engine's (also the local spec's torch_dist keys,
    # by its sharded_state_dict_keys_map) otherwise.
    a = p + "self_attn."
    direct = {
        "input_layernorm.weight": p + "input_layernorm.weight",
        "self_attention.linear_qkv.layer_norm_weight": p + "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": p + "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": a + "q_norm.weight",
        "self_attention.k_layernorm.weight": a + "k_norm.weight",
        "self_attention.linear_proj.weight": a + "o_proj.weight",
        "pre_mlp_layernorm.weight": p + "post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": p + "mlp.down_proj.weight",
        "mlp.router.weight": p + "mlp.gate.weight",
        "mlp.router.expert_bias": p + "mlp.gate.e_score_correction_bias",
        "mlp.shared_experts.linear_fc2.weight": p + "mlp.shared_experts.down_proj.weight",
    }
    if rest in direct:
        return hf[direct[rest]]
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.split(".")[-1]
        return qkv(hf[a + f"q_proj.{kind}"], hf[a + f"k_proj.{kind}"], hf[a + f"v_proj.{kind}"], groups)
    return gated_mlp_tensor(hf, p, rest, name)


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


def check_trestle_checkpoint(hf_dir, ckpt, tp, pp, ep, norms):
    """Every canonical tensor, put together from its chunks (each element exactly once), equals the HF-made one;
    layer tensors sit on their layer's stage, the MTP layer and the head on the last, experts on their EP rank."""
    hf = load_hf_tensors(hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    layers, experts, dense = config["num_hidden_layers"], config["n_routed_experts"], config["first_k_dense_replace"]
    iteration_dir_, manifest = read_manifest(ckpt)
    names = set(manifest["tensors"])
    assert f"decoder.layers.{dense - 1}.mlp.linear_fc1.weight" in names
    assert f"decoder.layers.{dense - 1}.mlp.router.weight" not in names  # the dense layers
    assert f"decoder.layers.{dense}.mlp.router.expert_bias" in names
    assert f"decoder.layers.{dense}.mlp.shared_experts.linear_fc1.weight" in names
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in names) == config["attention_bias"]
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in names) == config["use_qk_norm"]
    covered = set()
    for name, entry in manifest["tensors"].items():
        expected = expected_megatron(hf, config, name, norms)
        covered.add(name)
        assert list(expected.shape) == entry["global_shape"], name
        whole = torch.zeros(expected.shape, dtype=TORCH_DTYPES[entry["dtype"]])
        count = torch.zeros(expected.shape, dtype=torch.int32)
        layer = re.match(r"decoder\.layers\.(\d+)\.", name)
        stage = int(layer.group(1)) * pp // layers if layer else (0 if name.startswith("embedding") else pp - 1)
        expert = re.search(r"local_experts\.(\d+)\.", name)
        for chunk in entry["chunks"]:
            rank = int(re.fullmatch(r"rank_(\d+)\.bin", chunk["file"]).group(1))
            assert rank // (tp * ep) == stage, f"{name} on pipeline rank {rank // (tp * ep)}, expected {stage}"
            if expert:
                assert (rank // tp) % ep == int(expert.group(1)) // (experts // ep), f"{name} on the wrong EP rank"
            with open(os.path.join(iteration_dir_, chunk["file"]), "rb") as f:
                f.seek(chunk["byte_offset"])
                data = bytearray(f.read(chunk["stored_bytes"]))
            piece = torch.frombuffer(data, dtype=whole.dtype).reshape(chunk["shape"])
            box = tuple(slice(o, o + s) for o, s in zip(chunk["offset"], chunk["shape"], strict=True))
            whole[box] = piece
            count[box] += 1
        assert torch.all(count == 1), f"{name}: elements not written exactly once"
        assert torch.equal(bits(whole), bits(expected)), name
    return names


# (model, tp, pp, ep, norms)
LAYOUTS = [
    ("qk", 1, 1, 1, "te"),
    ("qk", 2, 1, 1, "local"),
    ("plain", 1, 2, 1, "te"),
    ("plain", 1, 1, 2, "local"),
    ("qk", 2, 2, 2, "te"),
    ("qk_mtp", 2, 2, 2, "local"),
    ("qk_mtp", 1, 1, 1, "te"),
]


@pytest.mark.parametrize("model,tp,pp,ep,norms", LAYOUTS, ids=[f"{m}-tp{t}-pp{p}-ep{e}-{n}" for m, t, p, e, n in LAYOUTS])
def test_round_trip_megatron_names_and_logits(trestle_convert, hf_models, tmp_path, model, tp, pp, ep, norms):
    src = hf_models[model]
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    trestle_convert.run("convert", "--from", "hf", src, "--to", "trestle", ckpt, "--tp", tp, "--pp", pp, "--ep", ep,
                        "--norms", norms, "--codec", "raw", "-q")
    names = check_trestle_checkpoint(src, ckpt, tp, pp, ep, norms)
    assert any(n.startswith("mtp.layers.0.transformer_layer.mlp.experts.") for n in names) == (model == "qk_mtp")
    megatron = read_manifest(ckpt)[1]["model"]["megatron"]
    config = json.load(open(os.path.join(src, "config.json")))
    assert megatron["rotary_percent"] == 0.5 and megatron["kv_channels"] == 12
    assert megatron["moe_first_dense_layers"] == config["first_k_dense_replace"]
    assert megatron["dense_ffn_hidden_size"] == 48 and megatron["moe_ffn_hidden_size"] == 16
    assert megatron["moe_shared_expert_intermediate_size"] == 16 * config["n_shared_experts"]
    assert not megatron["moe_shared_expert_gate"]
    assert megatron["mtp_num_layers"] == (1 if model == "qk_mtp" else 0)
    assert megatron["moe_router_score_function"] == "sigmoid" and megatron["moe_router_enable_expert_bias"]
    assert megatron["add_qkv_bias"] == megatron["qk_layernorm"] == (model != "plain")
    assert (megatron["moe_router_num_groups"], megatron["moe_router_group_topk"]) == \
        ((2, 1) if model != "plain" else (1, 1))
    assert megatron["moe_router_topk_scaling_factor"] == (2.5 if model != "plain" else 1.0)
    assert "multi_latent_attention" not in megatron

    verified = trestle_convert.run("verify", "--against", src, ckpt)
    assert "max abs diff 0, 0 above tolerance" in verified

    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_same_tensors(src, back)  # the MTP layer's copies of embedding and head written again
    assert json.load(open(os.path.join(back, "config.json"))) == config
    if (tp, pp, ep) in ((1, 1, 1), (2, 2, 2)):
        torch.testing.assert_close(hf_logits(back, TOKENS), hf_logits(src, TOKENS), rtol=0, atol=0)


def test_logits_depend_on_what_is_converted(hf_models, tmp_path):
    """The tiny model's logits change when the correction bias, a q/k norm, a q/k/v bias or the rotary half of a query
    head changes, so the logits check above would see a lost or misplaced tensor."""
    src = hf_models["qk"]
    base = hf_logits(src, TOKENS)
    for key in ("model.layers.2.mlp.gate.e_score_correction_bias", "model.layers.3.self_attn.k_norm.weight",
                "model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.weight"):
        tensors = load_hf_tensors(src)
        tensors[key] = tensors[key].flip(0)
        changed = rewrite_tensors(src, str(tmp_path / key.replace(".", "_")), tensors)
        assert not torch.equal(hf_logits(changed, TOKENS), base), key


def test_partial_rotary_factor_is_carried(trestle_convert, hf_models, tmp_path):
    """transformers 5 keeps partial_rotary_factor in rope_parameters (which wins), GLM's releases at the top level; an
    absent one is transformers' default 0.5. Each reaches Megatron's rotary_percent as transformers reads it."""
    src = hf_models["plain"]
    config = json.load(open(os.path.join(src, "config.json")))
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5
    rope = {k: v for k, v in config["rope_parameters"].items() if k != "partial_rotary_factor"}
    for name, changes, percent in [("top", dict(partial_rotary_factor=1.0, rope_parameters=rope), None),
                                   ("absent", dict(rope_parameters=rope), 0.5),
                                   ("both", dict(partial_rotary_factor=1.0), 0.5),
                                   ("whole", dict(rope_parameters=dict(rope, partial_rotary_factor=1.0)), None)]:
        changed = rewrite_config(src, str(tmp_path / name), **changes)
        ckpt = tmp_path / f"ckpt_{name}"
        trestle_convert.run("convert", "--from", "hf", changed, "--to", "trestle", ckpt, "-q")
        assert read_manifest(ckpt)[1]["model"]["megatron"].get("rotary_percent") == percent, name
        # ... as transformers reads the same config.
        read = transformers.AutoConfig.from_pretrained(changed).rope_parameters.get("partial_rotary_factor", 1.0)
        assert read == (percent or 1.0), (name, read)


def test_inspect_and_diff(trestle_convert, hf_models, tmp_path):
    info = json.loads(trestle_convert.run("inspect", hf_models["qk_mtp"], "--json"))
    assert info["config"]["bridge"]["convertible"] and info["config"]["bridge"]["family"] == "GLM-4.5 (MoE)"
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    trestle_convert.run("convert", "--from", "hf", hf_models["qk_mtp"], "--to", "trestle", a, "-q")
    trestle_convert.run("convert", "--from", "hf", hf_models["qk_mtp"], "--to", "trestle", b, "--tp", 2, "--pp", 2,
                        "--ep", 2, "-q")
    ckpt_info = json.loads(trestle_convert.run("inspect", b, "--json"))
    assert "mtp.layers.0.eh_proj.weight" in json.dumps(ckpt_info)
    assert trestle_convert.run_raw("diff", a, b, "-q").returncode == 0  # the same model in two layouts
    tensors = load_hf_tensors(hf_models["qk_mtp"])
    key = "model.layers.4.self_attn.k_proj.bias"  # the MTP layer's
    tensors[key] = tensors[key] + 1
    changed = rewrite_tensors(hf_models["qk_mtp"], str(tmp_path / "changed"), tensors)
    trestle_convert.run("convert", "--from", "hf", changed, "--to", "trestle", c, "-q")
    result = trestle_convert.run_raw("diff", a, c, "--json")
    assert result.returncode == 1
    different = [t["name"] for t in json.loads(result.stdout)["tensors"] if t["result"] == "different"]
    assert different == ["mtp.layers.0.transformer_layer.self_attention.linear_qkv.bias"], different


def test_what_megatron_computes_differently_is_refused(trestle_convert, hf_models, tmp_path):
    cases = [(dict(norm_topk_prob=False), "norm_topk_prob"),
             (dict(n_group=2, topk_group=2, num_experts_per_tok=2), "group-limited routing"),
             (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.5}), "rope type 'yarn'"),
             (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3}),
              "partial_rotary_factor"),
             (dict(hidden_act="gelu"), "hidden_act"),
             (dict(n_shared_experts=0), "n_shared_experts"),
             (dict(first_k_dense_replace="two"), "'first_k_dense_replace' must be an integer")]
    for changes, needle in cases:
        bad = rewrite_config(hf_models["qk"], str(tmp_path / re.sub(r"\W", "_", needle)), **changes)
        result = trestle_convert.run_raw("convert", "--from", "hf", bad, "--to", "trestle", str(tmp_path / "x"))
        # (what the bridge refuses names the architecture; a key of the wrong kind, the file and the key)
        named = "config.json" if "must be" in needle else "Glm4MoeForCausalLM"
        assert result.returncode == 1 and needle in result.stderr and named in result.stderr, \
            (changes, result.stderr)
        assert not os.path.exists(tmp_path / "x")
    # A tensor the config does not have (q/k norms in a model without use_qk_norm) is named, not dropped.
    bad = rewrite_config(hf_models["qk"], str(tmp_path / "no_norm"), use_qk_norm=False)
    result = trestle_convert.run_raw("convert", "--from", "hf", bad, "--to", "trestle", str(tmp_path / "x"))
    assert result.returncode == 1 and "not consumed" in result.stderr, result.stderr
    assert re.search(r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight", result.stderr), result.stderr


# --- torch_dist: per-layer keys, Megatron-LM's args, and megatron-core itself -----------------------------------------

DIST_LAYOUTS = [("qk", 1, 1, 1, "te"), ("qk", 2, 2, 2, "te"), ("qk_mtp", 1, 2, 2, "local"), ("plain", 2, 1, 1, "te"),
                ("plain", 1, 2, 1, "local")]


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
    config = json.load(open(os.path.join(src, "config.json")))
    experts, dense = config["n_routed_experts"], config["first_k_dense_replace"]
    state = read_dcp(it)
    # Megatron-Core's keys: one per layer (moe_layer_freq is a list), experts [E, ...], local names under local.
    assert "decoder.layers.0.mlp.linear_fc1.weight" in state and "decoder.layers.mlp.linear_fc1.weight" not in state
    assert state[f"decoder.layers.{dense}.mlp.experts.experts.linear_fc2.weight"].shape[0] == experts
    compared = 0
    for key, value in state.items():
        m = re.fullmatch(r"(decoder\.layers\.\d+\.|mtp\.layers\.\d+\.transformer_layer\.)mlp\.experts\.experts\.(.+)",
                         key)
        if m:
            for e in range(experts):
                name = f"{m.group(1)}mlp.experts.local_experts.{e}.{m.group(2)}"
                assert torch.equal(value[e], expected_megatron(hf, config, name, norms)), name
            compared += 1
            continue
        if key.startswith("mtp.") or key.startswith("decoder."):
            assert torch.equal(value, expected_megatron(hf, config, key, norms)), key
            compared += 1
    assert compared > 30
    assert any(k.startswith("mtp.layers.0.transformer_layer.") for k in state) == (model == "qk_mtp")
    args = torch.load(os.path.join(it, "common.pt"), weights_only=False)["args"]
    assert args.rotary_percent == 0.5 and args.kv_channels == 12 and args.group_query_attention
    assert args.num_query_groups == 2 and not getattr(args, "multi_latent_attention", False)
    assert args.add_qkv_bias == args.qk_layernorm == (model != "plain")
    assert args.moe_layer_freq == [0] * dense + [1] * (4 - dense) and args.moe_router_score_function == "sigmoid"
    assert args.moe_router_enable_expert_bias and not args.moe_shared_expert_gate
    assert args.moe_shared_expert_intermediate_size == 16 * config["n_shared_experts"]
    assert args.ffn_hidden_size == 48 and args.moe_ffn_hidden_size == 16
    assert args.mtp_num_layers == (1 if model == "qk_mtp" else None)

    back = tmp_path / "back"
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", back, "-q")
    assert_same_tensors(src, back)  # the MTP layer's copies of embedding and head included
    # Megatron-LM's args alone would read as another family: they are refused, and config.json is asked for.
    os.remove(os.path.join(it, "trestle_model.json"))
    result = trestle_convert.run_raw("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "x")
    assert result.returncode == 1 and "GLM-4.5" in result.stderr and "--hf-config" in result.stderr, result.stderr
    back_cfg = tmp_path / "back_cfg"
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", back_cfg, "--hf-config", src, "-q")
    assert_same_tensors(src, back_cfg)
    if (tp, pp, ep) == (2, 2, 2):
        torch.testing.assert_close(hf_logits(back_cfg, TOKENS), hf_logits(src, TOKENS), rtol=0, atol=0)


MCORE_MODEL = dict(BASE, vocab_size=128, first_k_dense_replace=2, n_shared_experts=2, attention_bias=True,
                   use_qk_norm=True, n_group=2, topk_group=1, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
                   num_nextn_predict_layers=1)

MCORE_GLM = MCORE.split("def build(")[0] + textwrap.dedent("""
    def build(c, port):  # GLM-4.5's GPTModel (local spec, GQA, partial RoPE, MTP) of HF config c, fp32, random weights
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
        parallel_state.initialize_model_parallel(1, 1)
        torch.manual_seed(3)
        layers, dense = c["num_hidden_layers"], c["first_k_dense_replace"]
        config = TransformerConfig(
            num_layers=layers, hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
            num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_key_value_heads"],
            kv_channels=c["head_dim"], normalization="RMSNorm", qk_layernorm=c["use_qk_norm"],
            add_qkv_bias=c["attention_bias"], add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu,
            layernorm_epsilon=c["rms_norm_eps"], num_moe_experts=c["n_routed_experts"],
            moe_ffn_hidden_size=c["moe_intermediate_size"],
            moe_shared_expert_intermediate_size=c["n_shared_experts"] * c["moe_intermediate_size"],
            moe_layer_freq=[0] * dense + [1] * (layers - dense), moe_router_topk=c["num_experts_per_tok"],
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_num_groups=c["n_group"], moe_router_group_topk=c["topk_group"],
            moe_router_topk_scaling_factor=c["routed_scaling_factor"], moe_router_pre_softmax=False,
            moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", mtp_num_layers=1,
            use_cpu_initialization=True, params_dtype=torch.float32)
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        mtp = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=False)
        model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=c["vocab_size"],
                         max_sequence_length=64, position_embedding_type="rope", rotary_percent=0.5,
                         share_embeddings_and_output_weights=False, mtp_block_spec=mtp)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
            for name, b in model.named_buffers():
                if name.endswith("expert_bias"):
                    b.copy_(torch.randn_like(b))
        return config, model

    def logits(model, tokens):  # the decoder's logits (the MTP block wants labels), on the CPU without Transformer Engine
        import contextlib
        import megatron.core.transformer.moe.moe_utils as moe_utils
        from megatron.core import tensor_parallel
        if not hasattr(moe_utils, "te_general_gemm"):  # the router's GEMM names it; None takes the torch path
            moe_utils.te_general_gemm = None
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # no dropout
        model.eval()
        model.mtp_process, model.config.mtp_num_layers = False, None
        n = tokens.shape[1]
        with torch.no_grad():
            return model(tokens, torch.arange(n).unsqueeze(0), torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool), 1))
""") + f"\nTOKENS = {TOKENS[0].tolist()}\n" + "\ndef main():" + MCORE.split("\ndef main():")[1].replace(
    "model.state_dict().items() if torch.is_tensor(v)}",
    "model.state_dict().items() if torch.is_tensor(v) and not k.endswith('local_tokens_per_expert')}").replace(
    "    json.dump(shapes,",
    "    if mode == 'load':\n"
    "        save_file({'logits': logits(model, torch.tensor([TOKENS]))}, os.path.join(out, 'logits.safetensors'))\n"
    "    json.dump(shapes,")


def run_mcore_glm(tmp_path, mode, ckpt, port):
    """megatron-core's model state after `mode` (save or load), and (load) the logits it computes for TOKENS."""
    result, out = run_mcore(tmp_path, mode, ckpt, port, None, script_text=MCORE_GLM, config=MCORE_MODEL)
    assert result.returncode == 0, result.stderr[-4000:]
    state = safetensors_torch.load_file(out / "model.safetensors")
    return (state, safetensors_torch.load_file(out / "logits.safetensors")["logits"]) if mode == "load" else state


def check_megatron_state(hf_dir, state):
    checked = check_state_against_mapping(hf_dir, state,
                                          lambda hf, config, name: expected_megatron(hf, config, name, "local"))
    assert checked > 50 and any(n.startswith("mtp.layers.0.transformer_layer.mlp.experts.") for n in state)
    assert "decoder.layers.2.mlp.router.expert_bias" in state and "decoder.layers.0.self_attention.linear_qkv.bias" \
        in state and "mtp.layers.0.transformer_layer.self_attention.k_layernorm.weight" in state


def mcore_hf_dir(tmp_path):
    src = tmp_path / "hf_plain"
    save_glm(src, "mcore", MCORE_MODEL, dtype=torch.float32)
    add_mtp_layer(src, tmp_path / "hf")
    return str(tmp_path / "hf")


def test_megatron_core_loads_trestle_checkpoint(tmp_path, trestle_convert):
    """megatron-core's GLM-4.5 model loads the torch_dist checkpoint strictly, holds the mapped tensors, and computes
    transformers' logits with them (RoPE over half of each head, q/k/v biases and norms, the grouped sigmoid router
    with its bias and scaling, shared experts: float32, to rounding)."""
    hf_dir = mcore_hf_dir(tmp_path)
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", tmp_path / "d", "--norms", "local",
                        "-q")
    state, logits = run_mcore_glm(tmp_path, "load", iteration_dir(tmp_path / "d"), free_port())  # a strict load
    check_megatron_state(hf_dir, state)
    expected = hf_logits(hf_dir, TOKENS)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(logits, expected, rtol=0, atol=2e-6)


def test_trestle_reads_megatron_core_save(tmp_path, trestle_convert):
    (tmp_path / "mc").mkdir()
    state = run_mcore_glm(tmp_path, "save", tmp_path / "mc", free_port())
    config = transformers.Glm4MoeConfig(**MCORE_MODEL)
    config.architectures = ["Glm4MoeForCausalLM"]
    config.save_pretrained(tmp_path / "cfg")
    trestle_convert.run("convert", "--from", "megatron-dist", tmp_path / "mc", "--to", "hf", tmp_path / "hf",
                        "--hf-config", tmp_path / "cfg", "-q")
    check_megatron_state(str(tmp_path / "hf"), state)


LEGACY_LAYOUTS = ci_cases([(2, 1, 1), (1, 1, 2), (2, 1, 2), (1, 2, 1), (2, 2, 2)], [(2, 1, 2)])


@pytest.mark.parametrize("tp,pp,ep", LEGACY_LAYOUTS, ids=[f"tp{t}-pp{p}-ep{e}" for t, p, e in LEGACY_LAYOUTS])
def test_megatron_core_legacy_tree_converts_back(tmp_path, trestle_convert, tp, pp, ep):
    """A legacy mp_rank tree as Megatron-LM saves megatron-core's own GLM-4.5 (MCORE_GLM: two dense first layers,
    q/k/v biases and norms, the sigmoid router with its expert bias, shared experts, one MTP layer) at tp x ep, from
    the weights of Trestle's torch_dist: each rank's experts numbered from 0 (the MTP layer's too), the router's token
    counter beside its bias. `convert --from megatron-legacy` gives back every source tensor's value."""
    assert_mtp_moe_tree_converts_back(trestle_convert, MCORE_GLM, mcore_hf_dir(tmp_path), tmp_path, tp, pp, ep)

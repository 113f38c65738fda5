"""GPT-OSS (GptOssForCausalLM) through `trestle convert`, checked against transformers:

- tiny random models (biased QKV / output projections, attention sinks, a biased router, transformers' fused experts
  stored [in, out] with gate / up interleaved, alternating sliding-window layers, YaRN) go hf -> trestle in
  tp 1/2 x pp 1/2 x ep 1/2/4 -> hf bit-exactly, transformers' logits equal on the way back;
- every chunk holds what Megatron-Bridge's mapping says, computed here from the HF tensors: the sinks as
  core_attention.softmax_offset (split by heads), each expert's fc1 = [gate; up] rows de-interleaved and transposed,
  fc1 bias de-interleaved, fc2 transposed;
- torch_dist: stacked keys with the biases and softmax offset, Megatron-LM's args (quick_geglu, glu_linear_offset,
  activation_func_clamp_value, softmax_type learnable, window_attn_skip_freq); back to hf bit-exactly; args alone are
  refused naming what to give;
- what Megatron-Core computes differently (another layer-type pattern, swiglu_alpha) is refused;
- megatron-core's own GPT-OSS GPTModel (local spec, learnable softmax offset, biases, quick-GELU GLU, windows) on CPU
  loads a Trestle torch_dist strictly and its save converts to the same tensors;
- MXFP4-packed experts (the release format: E2M1 nibbles, a power-of-two scale per 32 values) are dequantised to
  transformers' bf16 layout, equal to the formula computed here, and transformers' logits follow.
"""
import json
import os
import re
import sys
import textwrap

import pytest
import safetensors.torch as safetensors_torch
import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from models import check_state_against_mapping, hf_logits, iteration_dir, load_hf_tensors  # noqa: E402
from ports import free_port  # noqa: E402
from test_megatron_bridge import (  # noqa: E402
    TORCH_DTYPES, assert_same_tensors, megatron_qkv, read_manifest, rewrite_config, rewrite_tensors)
from test_megatron_dist_convert import MCORE, read_dcp, run_mcore  # noqa: E402

TOKENS = torch.tensor([[1, 5, 17, 42, 7, 99, 3, 11, 64, 2]])  # longer than the window: the sliding layers matter

CONFIG = dict(vocab_size=301, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
              pad_token_id=0)


def save_gpt_oss(directory, dtype, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**CONFIG)).to(dtype).eval()
    with torch.no_grad():  # biases start at 0 and norms at 1: perturb them so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"bf16": save_gpt_oss(root / "bf16", torch.bfloat16, 1), "fp32": save_gpt_oss(root / "fp32", torch.float32, 2)}


def expected_megatron(hf, config, name):
    fixed = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight",
             "decoder.final_layernorm.weight": "model.norm.weight"}
    if name in fixed:
        return hf[fixed[name]]
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    p, rest = f"model.layers.{m.group(1)}.", m.group(2)
    a = p + "self_attn."
    direct = {"self_attention.linear_qkv.layer_norm_weight": p + "input_layernorm.weight",
              "input_layernorm.weight": p + "input_layernorm.weight",
              "pre_mlp_layernorm.weight": p + "post_attention_layernorm.weight",
              "self_attention.core_attention.softmax_offset": a + "sinks",
              "self_attention.linear_proj.weight": a + "o_proj.weight",
              "self_attention.linear_proj.bias": a + "o_proj.bias",
              "mlp.router.weight": p + "mlp.router.weight", "mlp.router.bias": p + "mlp.router.bias"}
    if rest in direct:
        return hf[direct[rest]]
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        return megatron_qkv(hf[a + "q_proj." + kind], hf[a + "k_proj." + kind], hf[a + "v_proj." + kind],
                            config["num_key_value_heads"])
    e_match = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.(weight|bias)", rest)
    assert e_match, name
    e, fc, kind = int(e_match.group(1)), e_match.group(2), e_match.group(3)
    x = p + "mlp.experts."
    if fc == "2":
        return hf[x + "down_proj"][e].t() if kind == "weight" else hf[x + "down_proj_bias"][e]
    if kind == "bias":
        b = hf[x + "gate_up_proj_bias"][e]
        return torch.cat([b[0::2], b[1::2]])
    w = hf[x + "gate_up_proj"][e]  # [H, 2I], gate / up interleaved along the columns
    return torch.cat([w[:, 0::2].t(), w[:, 1::2].t()])


def check_trestle_checkpoint(hf_dir, ckpt):
    hf = load_hf_tensors(hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    iteration, manifest = read_manifest(ckpt)
    assert "decoder.layers.1.self_attention.core_attention.softmax_offset" in manifest["tensors"]
    assert "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.bias" in manifest["tensors"]
    for name, entry in manifest["tensors"].items():
        expected = expected_megatron(hf, config, name)
        whole = torch.zeros(expected.shape, dtype=TORCH_DTYPES[entry["dtype"]])
        count = torch.zeros(expected.shape, dtype=torch.int32)
        for chunk in entry["chunks"]:
            with open(os.path.join(iteration, chunk["file"]), "rb") as f:
                f.seek(chunk["byte_offset"])
                data = bytearray(f.read(chunk["stored_bytes"]))
            box = tuple(slice(o, o + s) for o, s in zip(chunk["offset"], chunk["shape"], strict=True))
            whole[box] = torch.frombuffer(data, dtype=whole.dtype).reshape(chunk["shape"])
            count[box] += 1
        assert torch.all(count == 1), f"{name}: elements not written exactly once"
        assert torch.equal(whole.float(), expected.float()), name


LAYOUTS = [("bf16", 1, 1, 1), ("bf16", 2, 2, 2), ("fp32", 1, 2, 4), ("fp32", 2, 1, 2)]


@pytest.mark.parametrize("model,tp,pp,ep", LAYOUTS, ids=[f"{m}-tp{t}-pp{p}-ep{e}" for m, t, p, e in LAYOUTS])
def test_round_trip_megatron_names_and_logits(trestle_convert, hf_models, tmp_path, model, tp, pp, ep):
    src = hf_models[model]
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    trestle_convert.run("convert", "--from", "hf", src, "--to", "trestle", ckpt, "--tp", tp, "--pp", pp, "--ep", ep,
                        "--codec", "raw", "-q")
    check_trestle_checkpoint(src, ckpt)
    megatron = read_manifest(ckpt)[1]["model"]["megatron"]
    assert megatron["softmax_type"] == "learnable" and megatron["add_bias_linear"]
    assert megatron["activation"] == "quick_geglu" and megatron["activation_func_clamp_value"] == 7.0
    assert megatron["mixed_attention"] and megatron["window_size"] == [3, 0]
    assert megatron["position_embedding_type"] == "yarn" and megatron["yarn_rotary_scaling_factor"] == 32.0
    assert "max abs diff 0, 0 above tolerance" in trestle_convert.run("verify", "--against", src, ckpt)
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_same_tensors(src, back)
    assert json.load(open(os.path.join(back, "config.json"))) == json.load(open(os.path.join(src, "config.json")))
    if (tp, pp, ep) in ((1, 1, 1), (1, 2, 4)):
        torch.testing.assert_close(hf_logits(back, TOKENS), hf_logits(src, TOKENS), rtol=0, atol=0)


def test_logits_depend_on_the_sinks_and_expert_biases(hf_models, tmp_path):
    src = hf_models["fp32"]
    base = hf_logits(src, TOKENS)
    for key in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.experts.gate_up_proj_bias"):
        tensors = load_hf_tensors(src)
        tensors[key] = tensors[key].flip(-1).contiguous()
        changed = rewrite_tensors(src, str(tmp_path / key.replace(".", "_")), tensors)
        assert not torch.equal(hf_logits(changed, TOKENS), base), key


@pytest.mark.parametrize("model,tp,pp,ep", [("bf16", 2, 1, 2), ("fp32", 1, 2, 4)], ids=["bf16-tp2-ep2", "fp32-pp2-ep4"])
def test_torch_dist_keys_args_and_back(trestle_convert, hf_models, tmp_path, model, tp, pp, ep):
    src = hf_models[model]
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", src, "--to", "megatron-dist", dist, "--tp", tp, "--pp", pp, "--ep",
                        ep, "-q")
    assert len([f for f in os.listdir(iteration_dir(dist)) if f.endswith(".distcp")]) == tp * pp * ep
    it = iteration_dir(dist)
    hf = load_hf_tensors(src)
    config = json.load(open(os.path.join(src, "config.json")))
    state = read_dcp(it)
    assert state["decoder.layers.self_attention.core_attention.softmax_offset"].shape == (4, 4)  # [L, heads]
    assert state["decoder.layers.mlp.experts.experts.linear_fc1.bias"].shape == (4, 4, 48)  # [L, E, 2I]
    for key, value in state.items():
        if not key.startswith("decoder.layers."):
            continue
        param = key[len("decoder.layers."):]
        for i in range(config["num_hidden_layers"]):
            if param.startswith("mlp.experts.experts."):
                for e in range(config["num_local_experts"]):
                    name = f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{param[len('mlp.experts.experts.'):]}"
                    assert torch.equal(value[i, e].float(), expected_megatron(hf, config, name).float()), name
            else:
                name = f"decoder.layers.{i}.{param}"
                assert torch.equal(value[i].float(), expected_megatron(hf, config, name).float()), name
    args = torch.load(os.path.join(it, "common.pt"), weights_only=False)["args"]
    assert args.quick_geglu and not args.swiglu and args.add_bias_linear and args.add_qkv_bias
    assert args.softmax_type == "learnable" and args.glu_linear_offset == 1.0
    assert args.activation_func_clamp_value == 7.0 and args.window_attn_skip_freq == 2
    assert tuple(args.window_size) == (3, 0) and args.position_embedding_type == "yarn"
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "back", "-q")
    assert_same_tensors(src, tmp_path / "back")
    os.remove(os.path.join(it, "trestle_model.json"))  # Megatron-LM's args alone do not describe GPT-OSS
    result = trestle_convert.run_raw("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "x")
    assert result.returncode == 1 and "GPT-OSS" in result.stderr and "--hf-config" in result.stderr, result.stderr
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "back2", "--hf-config",
                        src, "-q")
    assert_same_tensors(src, tmp_path / "back2")


def test_what_megatron_computes_differently_is_refused(trestle_convert, hf_models, tmp_path):
    cases = [(dict(layer_types=["full_attention", "sliding_attention"] * 2), "layer_types"),
             (dict(swiglu_alpha=1.5), "swiglu_alpha"),
             (dict(attention_bias=False), "attention_bias"),
             (dict(quantization_config={"quant_method": "bitsandbytes"}), "bitsandbytes")]
    for changes, needle in cases:
        bad = rewrite_config(hf_models["bf16"], str(tmp_path / needle), **changes)
        result = trestle_convert.run_raw("convert", "--from", "hf", bad, "--to", "trestle", str(tmp_path / "x"))
        assert result.returncode == 1 and needle in result.stderr, (changes, result.stderr)
        assert not os.path.exists(tmp_path / "x")
    info = json.loads(trestle_convert.run("inspect", hf_models["bf16"], "--json"))
    assert info["config"]["bridge"]["convertible"] and info["config"]["bridge"]["family"] == "GPT-OSS"


# --- MXFP4: GPT-OSS's release checkpoints pack the experts as E2M1 nibbles with a power-of-two scale per 32 ---------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_pack(weight):
    """weight [E, R, C] (nn.Linear's [out, in]) -> (blocks uint8 [E, R, C/32, 16], scales uint8 [E, R, C/32], the
    bf16 weight they stand for), packed as the release checkpoints are: low nibble first, scale 2^(s - 127)."""
    e, r, c = weight.shape
    groups = weight.float().reshape(e, r, c // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.pow(2.0, exponent)[..., None]
    codes = (scaled[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)  # the nearest E2M1 value
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    scales = (exponent + 127).to(torch.uint8)
    values = E2M1[codes.long()] * torch.pow(2.0, exponent)[..., None]
    return blocks.contiguous(), scales.contiguous(), values.reshape(e, r, c).to(torch.bfloat16)


def test_mxfp4_experts_are_dequantised_on_import(trestle_convert, tmp_path):
    config = dict(CONFIG, hidden_size=64, intermediate_size=32)
    torch.manual_seed(4)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**config)).to(torch.bfloat16)
    src = tmp_path / "bf16"
    model.save_pretrained(src)
    tensors, reference = load_hf_tensors(src), {}
    packed = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            blocks, scales, values = mxfp4_pack(t.transpose(1, 2))  # transformers keeps them [E, in, out]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            reference[name] = values.transpose(1, 2).contiguous()
        else:
            packed[name] = reference[name] = t
    hf_config = json.load(open(src / "config.json"))
    for directory, tensors_to_save, quantized in ((tmp_path / "mxfp4", packed, True), (tmp_path / "ref", reference, False)):
        os.makedirs(directory)
        c = dict(hf_config, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}) if quantized else hf_config
        json.dump(c, open(directory / "config.json", "w"), indent=2)
        safetensors_torch.save_file(tensors_to_save, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    info = json.loads(trestle_convert.run("inspect", tmp_path / "mxfp4", "--json"))
    assert info["config"]["bridge"]["dequantised_to_bf16"] == "mxfp4"
    ckpt = tmp_path / "ckpt"
    trestle_convert.run("convert", "--from", "hf", tmp_path / "mxfp4", "--to", "trestle", ckpt, "--tp", 2, "--ep", 2,
                        "-q")
    assert "max abs diff 0, 0 above tolerance" in trestle_convert.run("verify", "--against", tmp_path / "mxfp4", ckpt)
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", tmp_path / "back", "-q")
    assert_same_tensors(tmp_path / "ref", tmp_path / "back")
    back_config = json.load(open(tmp_path / "back" / "config.json"))
    assert "quantization_config" not in back_config and back_config == hf_config
    torch.testing.assert_close(hf_logits(tmp_path / "back", TOKENS), hf_logits(tmp_path / "ref", TOKENS), rtol=0, atol=0)
    # A packed tensor without its scales is named.
    del packed["model.layers.1.mlp.experts.down_proj_scales"]
    os.remove(tmp_path / "mxfp4" / "model.safetensors")
    safetensors_torch.save_file(packed, os.path.join(tmp_path / "mxfp4", "model.safetensors"), metadata={"format": "pt"})
    result = trestle_convert.run_raw("convert", "--from", "hf", tmp_path / "mxfp4", "--to", "trestle", tmp_path / "x")
    assert result.returncode == 1 and "model.layers.1.mlp.experts.down_proj_scales" in result.stderr, result.stderr


# --- megatron-core's own GPT-OSS GPTModel (local spec, CPU): it loads a Trestle torch_dist, its save converts --------

MCORE_CONFIG = dict(CONFIG, vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2)

MCORE_GPT_OSS = MCORE.split("def build(")[0] + textwrap.dedent("""
    def build(c, port):  # GPT-OSS's GPTModel (local spec) of HF config c, fp32, random weights, in a gloo world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_bias_geglu import quick_gelu
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
        parallel_state.initialize_model_parallel(1, 1)
        torch.manual_seed(3)
        config = TransformerConfig(
            num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
            num_query_groups=c["num_key_value_heads"], kv_channels=c["head_dim"], ffn_hidden_size=c["intermediate_size"],
            normalization="RMSNorm", add_bias_linear=True, add_qkv_bias=True, gated_linear_unit=True,
            activation_func=quick_gelu, glu_linear_offset=1.0, activation_func_clamp_value=7.0,
            bias_activation_fusion=False, softmax_type="learnable", window_size=(c["sliding_window"] - 1, 0),
            window_attn_skip_freq=2, num_moe_experts=c["num_local_experts"],
            moe_ffn_hidden_size=c["intermediate_size"], moe_router_topk=c["num_experts_per_tok"],
            moe_router_pre_softmax=False, moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False, use_cpu_initialization=True, params_dtype=torch.float32, layernorm_epsilon=1e-5)
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=c["vocab_size"],
                         max_sequence_length=64, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
        return config, model
""") + "\ndef main():" + MCORE.split("\ndef main():")[1]


def run_mcore_gpt_oss(tmp_path, mode, ckpt, port):
    result, out = run_mcore(tmp_path, mode, ckpt, port, None, script_text=MCORE_GPT_OSS, config=MCORE_CONFIG)
    assert result.returncode == 0, result.stderr[-4000:]
    return safetensors_torch.load_file(out / "model.safetensors")


def check_megatron_state(hf_dir, state):
    checked = check_state_against_mapping(hf_dir, state, expected_megatron)
    assert checked > 30 and any(n.endswith("core_attention.softmax_offset") for n in state)


def test_megatron_core_loads_trestle_checkpoint(tmp_path, trestle_convert):
    torch.manual_seed(9)
    hf_dir = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**MCORE_CONFIG)).save_pretrained(hf_dir)
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", tmp_path / "d", "--norms", "local",
                        "-q")
    state = run_mcore_gpt_oss(tmp_path, "load", iteration_dir(tmp_path / "d"), free_port())  # strict: every key
    check_megatron_state(str(hf_dir), state)


def test_trestle_reads_megatron_core_save(tmp_path, trestle_convert):
    (tmp_path / "mc").mkdir()
    state = run_mcore_gpt_oss(tmp_path, "save", tmp_path / "mc", free_port())
    config = transformers.GptOssConfig(**MCORE_CONFIG)
    config.architectures = ["GptOssForCausalLM"]
    config.save_pretrained(tmp_path / "cfg")
    trestle_convert.run("convert", "--from", "megatron-dist", tmp_path / "mc", "--to", "hf", tmp_path / "hf",
                        "--hf-config", tmp_path / "cfg", "-q")
    check_megatron_state(str(tmp_path / "hf"), state)

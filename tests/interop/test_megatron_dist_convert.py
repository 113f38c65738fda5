"""Megatron-Core torch_dist and legacy checkpoints through `trestle convert` / `trestle reshard`, checked against the
real ecosystem:

- tiny `transformers` models (Llama with GQA, Llama 3.2 with one KV head and tied embeddings, Qwen2 with QKV bias,
  Mixtral) go hf -> megatron-dist in several tp/pp/vpp/ep layouts and back to hf bit-exactly; the written checkpoint is
  read with `torch.distributed.checkpoint` and must hold Megatron's keys (stacked `decoder.layers.<param>` with a
  leading [num_layers] axis, experts [num_layers, num_experts, ...]), padded vocab (zeros after the real rows), the
  global linear_fc1 = cat(all gate; all up) and QKV in per-group order, computed here from the HF tensors;
- megatron-dist -> trestle -> hf, megatron-dist -> megatron-dist at another layout, and to trestle by reshard;
- models described only by Megatron's args (common.pt) or by --hf-config;
- a legacy mp_rank tree written here with torch.save in Megatron's layout (per-rank QKV groups, [gate_r; up_r], padded
  vocab split, stage- and chunk-local layer numbers, model0/model1, an argparse.Namespace args) converts to hf
  bit-exactly and loads in transformers with the original logits; its distributed optimizer's distrib_optim.pt is
  refused unless --model-only, a rank directory, rank file or iteration directory that is a link is not followed, and
  verify checks that the ranks' copies of a replicated tensor agree;
- config.json keys left to transformers' defaults (eps, RoPE base, positions, Mistral's window, Gemma's tied
  embeddings) and windows the config turns off (Qwen2's use_sliding_window false, Qwen2-MoE's 0): the args describe
  transformers' model and the args-only way back gives its logits; a tied model that stores its lm_head too converts
  when the copy is the embedding byte for byte;
- megatron-core: a GPTModel built on CPU loads a Trestle-written checkpoint with dist_checkpointing.load, and a
  checkpoint it saves with dist_checkpointing.save converts to hf bit-exactly;
- megatron-core's Adam state (optimizer.state.<exp_avg | exp_avg_sq>.<key>, common_step) survives megatron-dist ->
  trestle -> megatron-dist at other layouts bit-exactly and loads back into its optimizer; unmappable optimizer
  state is refused unless --model-only (the distributed optimizer's dp_reshardable buffers: test_dp_reshardable.py).
"""
import argparse
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import zlib
from collections import OrderedDict

import pytest
import safetensors.torch as safetensors_torch
import torch
import torch.distributed.checkpoint as dcp
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from models import (assert_bit_exact, assert_link_is_not_followed, hf_logits, iteration_dir, load_hf_tensors,  # noqa: E402
                    save_tiny_model)
from ports import free_port  # noqa: E402
from test_megatron_bridge import MegatronReference, megatron_qkv  # noqa: E402  (the reference Megatron layout)
from script_server import reference_scripts  # noqa: E402

TOKENS = torch.tensor([[1, 5, 17, 42, 7, 99, 3, 11]])

MODELS = {
    "llama": ("LlamaConfig", dict(vocab_size=1000, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                                  num_attention_heads=6, num_key_value_heads=2, head_dim=8), torch.bfloat16),
    "llama32_tied": ("LlamaConfig", dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
                     torch.bfloat16),
    "qwen2": ("Qwen2Config", dict(vocab_size=515, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2), torch.float32),
    # Llama 3.1 rope scaling with the parameters Megatron-Core implements (only the factor is an argument there).
    "llama31": ("LlamaConfig", dict(vocab_size=517, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                                    num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                    rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
                torch.float32),
    # Tensors of 1 MiB and more, which readers take with O_DIRECT rather than through a memory map.
    "wide": ("LlamaConfig", dict(vocab_size=4000, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2), torch.float32),
    "mistral_window": ("MistralConfig", dict(vocab_size=401, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=4),
                       torch.float32),
    "mixtral": ("MixtralConfig", dict(vocab_size=300, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2), torch.bfloat16),
    # q/k norms; head_dim x heads differs from hidden
    "qwen3": ("Qwen3Config", dict(vocab_size=333, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16), torch.bfloat16),
    "qwen3_moe": ("Qwen3MoeConfig", dict(vocab_size=259, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         num_experts=4, num_experts_per_tok=2), torch.float32),
    # Qwen2-MoE: a shared expert with its sigmoid gate beside the experts, QKV bias.
    "qwen2_moe": ("Qwen2MoeConfig", dict(vocab_size=263, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2), torch.float32),
    # Gemma 2: post-norms, GeGLU, soft-capping, tied embeddings, head_dim x heads differing from hidden.
    "gemma2": ("Gemma2Config", dict(vocab_size=301, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                    pad_token_id=0), torch.bfloat16),
    # OLMo 2: post-norms only, q/k norms over the whole projection.
    "olmo2": ("Olmo2Config", dict(vocab_size=305, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
                                  num_attention_heads=6, num_key_value_heads=2), torch.bfloat16),
    # Phi-3: fused qkv_proj and gate_up_proj on the Hugging Face side.
    "phi3": ("Phi3Config", dict(vocab_size=311, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
                                num_attention_heads=6, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2, sliding_window=None), torch.bfloat16),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for name, (config_class, config, dtype) in MODELS.items():
        save_tiny_model(str(root / name), config_class, config, seed=zlib.crc32(name.encode()), dtype=dtype,
                        tokenizer_config={"model_max_length": 128}, save_original_format=True)
    return {name: str(root / name) for name in MODELS}


def read_dcp(directory):
    """Every tensor of a DCP checkpoint, loaded whole by torch.distributed.checkpoint (no process group)."""
    metadata = dcp.FileSystemReader(directory).read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    return state


def check_megatron_keys(hf_dir, root, tp):
    """The checkpoint holds exactly Megatron's keys, global shapes and values, computed from the HF tensors."""
    hf = load_hf_tensors(hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    padded = -(-vocab // (128 * tp)) * 128 * tp
    whole = MegatronReference(hf, config, 1, "te")  # tp 1: local tensors are the global canonical ones
    state = read_dcp(iteration_dir(root))
    expected_keys = set()
    for key, value in state.items():
        expected_keys.add(key)
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            real = hf["model.embed_tokens.weight" if key.startswith("embedding") else "lm_head.weight"]
            assert value.shape == (padded, real.shape[1]), key
            assert torch.equal(value[:vocab], real), key
            assert not value[vocab:].any(), f"{key}: padding rows must be zeros"
            continue
        if not key.startswith("decoder.layers."):
            assert torch.equal(value, whole.hf_name_and_kind(key)[1](0)), key
            continue
        param = key[len("decoder.layers."):]
        assert not re.match(r"\d", param), f"{key}: layers must be stacked"
        assert value.shape[0] == layers, key
        for i in range(layers):
            if param.startswith("mlp.experts.experts."):
                assert value.shape[1] == experts, key
                for e in range(experts):
                    name = f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{param[len('mlp.experts.experts.'):]}"
                    assert torch.equal(value[i, e], whole.hf_name_and_kind(name)[1](0)), name
            else:
                name = f"decoder.layers.{i}.{param}"
                assert torch.equal(value[i], whole.hf_name_and_kind(name)[1](0)), name
    # The two Megatron-specific layouts, spelled out once more on layer 0.
    p = "model.layers.0."
    if p + "mlp.gate_up_proj.weight" in hf:  # Phi-3's fused tensors
        gate_up = hf[p + "mlp.gate_up_proj.weight"]
        kv = config["num_key_value_heads"] * config["hidden_size"] // config["num_attention_heads"]
        q, k, v = hf[p + "self_attn.qkv_proj.weight"].split([config["hidden_size"], kv, kv])
    else:
        gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]) \
            if p + "mlp.gate_proj.weight" in hf else None
        q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    if "decoder.layers.mlp.linear_fc1.weight" in state:
        assert torch.equal(state["decoder.layers.mlp.linear_fc1.weight"][0], gate_up)
    groups = config["num_key_value_heads"]
    qkv = state["decoder.layers.self_attention.linear_qkv.weight"][0]
    assert torch.equal(qkv, megatron_qkv(q, k, v, groups))
    assert "embedding.word_embeddings.weight" in expected_keys
    assert ("output_layer.weight" in expected_keys) == (not config.get("tie_word_embeddings", False))


# (model, tp, pp, vpp, ep)
LAYOUTS = [
    ("llama", 1, 1, 1, 1),
    ("llama", 2, 2, 1, 1),
    ("llama", 1, 2, 2, 1),
    ("llama32_tied", 1, 2, 1, 1),
    ("qwen2", 2, 1, 1, 1),
    ("mixtral", 2, 1, 1, 2),
    ("mixtral", 1, 2, 1, 4),
    ("qwen3", 2, 2, 1, 1),
    ("qwen3_moe", 2, 1, 1, 2),
    ("phi3", 2, 2, 1, 1),
    ("qwen2_moe", 2, 1, 1, 2),
    ("gemma2", 2, 2, 1, 1),
    ("olmo2", 2, 2, 1, 1),
    ("olmo2", 1, 2, 1, 1),
]


@pytest.mark.parametrize("name,tp,pp,vpp,ep", LAYOUTS, ids=[f"{m}-tp{t}pp{p}vpp{v}ep{e}" for m, t, p, v, e in LAYOUTS])
def test_hf_to_megatron_dist_and_back(tmp_path, trestle_convert, hf_models, name, tp, pp, vpp, ep):
    hf_dir = hf_models[name]
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", dist, "--tp", tp, "--pp", pp,
                        "--vpp", vpp, "--ep", ep, "--iteration", 5, "-q")
    assert open(dist / "latest_checkpointed_iteration.txt").read().strip() == "5"
    it = dist / "iter_0000005"
    files = sorted(f for f in os.listdir(it) if f.endswith(".distcp"))
    assert len(files) == tp * pp * ep, files  # one file per rank of the layout
    assert json.load(open(it / "metadata.json"))["sharded_backend"] == "torch_dist"
    common = torch.load(it / "common.pt", weights_only=False)
    assert isinstance(common["args"], argparse.Namespace)
    assert (common["args"].tensor_model_parallel_size, common["args"].pipeline_model_parallel_size) == (tp, pp)
    assert common["args"].num_layers == MODELS[name][1]["num_hidden_layers"] and common["iteration"] == 5
    check_megatron_keys(hf_dir, dist, tp)
    info = json.loads(trestle_convert.run("inspect", dist, "--json"))  # the root: its latest iteration
    assert info["format"] == "torch_dist" and info["model"]["layout"]["tp"] == tp, info.get("model")
    assert info["model"]["architecture"] == json.load(open(os.path.join(hf_dir, "config.json")))["architectures"][0]

    out = tmp_path / "hf"
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", out, "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(out))
    assert os.path.exists(out / "tokenizer_config.json")
    assert json.load(open(out / "config.json")) == json.load(open(os.path.join(hf_dir, "config.json")))


def test_megatron_dist_to_trestle_reshard_and_back(tmp_path, trestle_convert, hf_models):
    hf_dir = hf_models["llama"]
    original = load_hf_tensors(hf_dir)
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", dist, "--tp", 2, "--pp", 2, "-q")
    # torch_dist -> trestle (convert) -> hf
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "trestle", tmp_path / "t", "--tp", 1,
                        "--pp", 2, "--vpp", 2, "-q")
    manifest = json.load(open(iteration_dir(tmp_path / "t") + "/manifest.json"))
    assert manifest["layout"]["pp"] == 2 and manifest["layout"]["vpp"] == 2
    trestle_convert.run("convert", "--from", "trestle", tmp_path / "t", "--to", "hf", tmp_path / "hf1", "-q")
    assert_bit_exact(original, load_hf_tensors(tmp_path / "hf1"))
    # torch_dist -> torch_dist at another layout (reshard), checked key by key and back to hf
    trestle_convert.run("reshard", dist, tmp_path / "d2", "--tp", 1, "--pp", 1, "-q")
    assert len([f for f in os.listdir(iteration_dir(tmp_path / "d2")) if f.endswith(".distcp")]) == 1
    check_megatron_keys(hf_dir, tmp_path / "d2", 1)
    trestle_convert.run("convert", "--from", "megatron-dist", tmp_path / "d2", "--to", "hf", tmp_path / "hf2", "-q")
    assert_bit_exact(original, load_hf_tensors(tmp_path / "hf2"))
    # torch_dist -> trestle by reshard, and trestle -> torch_dist by reshard
    trestle_convert.run("reshard", dist, tmp_path / "t2", "--to-format", "trestle", "--tp", 2, "--pp", 1, "-q")
    trestle_convert.run("reshard", tmp_path / "t2", tmp_path / "d3", "--to-format", "megatron-dist", "--pp", 2, "-q")
    check_megatron_keys(hf_dir, tmp_path / "d3", 2)
    for a, b in [(tmp_path / "t", tmp_path / "t2"), (dist, tmp_path / "t"), (dist, tmp_path / "d2")]:
        out = trestle_convert.run_raw("diff", a, b, "--json", "--all")  # across layouts and formats
        assert out.returncode == 0, out.stdout + out.stderr
        assert len(json.loads(out.stdout)["tensors"]) == 4 * 6 + 3  # 6 per layer, embedding, norm, output
    checked = trestle_convert.run("verify", dist, "--against", hf_dir)
    assert "max abs diff 0," in checked and "0 above tolerance" in checked, checked
    trestle_convert.run("convert", "--from", "megatron-dist", tmp_path / "d3", "--to", "hf", tmp_path / "hf3", "-q")
    assert_bit_exact(original, load_hf_tensors(tmp_path / "hf3"))
    # trestle -> torch_dist by convert, in yet another layout
    trestle_convert.run("convert", "--from", "trestle", tmp_path / "t", "--to", "megatron-dist", tmp_path / "d4",
                        "--tp", 2, "--pp", 1, "-q")
    check_megatron_keys(hf_dir, tmp_path / "d4", 2)


def test_an_iteration_is_read_in_its_own_format_in_a_root_of_several(tmp_path, trestle_convert, hf_models):
    """A root that holds a Trestle iteration (the tracker's) and a torch_dist one (a job that moved from Megatron to
    Trestle, or back): --iteration reads each in its own format in verify, diff and reshard."""
    hf_dir = hf_models["llama"]
    root = tmp_path / "root"
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "trestle", root, "--iteration", 5, "-q")
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", tmp_path / "dist", "--tp", 2,
                        "--iteration", 7, "-q")
    shutil.copytree(tmp_path / "dist" / "iter_0000007", root / "iter_0000007")
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    for iteration, directory in ((None, "iter_0000005"), (5, "iter_0000005"), (7, "iter_0000007")):
        out = trestle_convert.run_raw("verify", root, *(["--iteration", iteration] if iteration else []))
        assert out.returncode == 0 and "ok" in out.stdout and directory in out.stdout, (iteration, out.stdout,
                                                                                       out.stderr)
    out = trestle_convert.run_raw("diff", root, root, "--iteration-a", 5, "--iteration-b", 7, "--json", "--all")
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(json.loads(out.stdout)["tensors"]) == 4 * 6 + 3
    trestle_convert.run("reshard", root, tmp_path / "from7", "--iteration", 7, "--tp", 1, "-q")
    check_megatron_keys(hf_dir, tmp_path / "from7", 1)  # a torch_dist source reshards to torch_dist
    trestle_convert.run("convert", "--from", "megatron-dist", tmp_path / "from7", "--to", "hf", tmp_path / "hf7", "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "hf7"))


def test_model_from_args_or_hf_config(tmp_path, trestle_convert, hf_models):
    hf_dir = hf_models["qwen2"]
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", dist, "--tp", 2, "-q")
    it = iteration_dir(dist)
    os.remove(os.path.join(it, "trestle_model.json"))  # now only Megatron's args describe the model
    info = json.loads(trestle_convert.run("inspect", it, "--json"))
    assert info["model"]["architecture"] == "Qwen2ForCausalLM" and info["model"]["vocab_size"] == 515
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "hf", "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "hf"))
    torch.testing.assert_close(hf_logits(tmp_path / "hf", TOKENS), hf_logits(hf_dir, TOKENS), rtol=0, atol=0)
    # No args and no kept model: the error says what to give.
    common = torch.load(os.path.join(it, "common.pt"), weights_only=False)
    del common["args"]
    torch.save(common, os.path.join(it, "common.pt"))
    result = trestle_convert.run_raw("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "x")
    assert result.returncode == 1 and "--hf-config" in result.stderr, result.stderr
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "hf2", "--hf-config",
                        hf_dir, "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "hf2"))


@pytest.mark.parametrize("model, field, value, says", [
    ("qwen2", "rotary_percent", 0.5, "RoPE over part of each head (rotary_percent 0.5)"),
    ("qwen2", "rotary_interleaved", True, "interleaved RoPE (rotary_interleaved)"),
    ("qwen2", "no_rope_freq", 2, "layers without RoPE (no_rope_freq 2)"),
    ("qwen2", "qk_l2_norm", True, "(qk_l2_norm)"),
    ("qwen2", "apply_layernorm_1p", True, "(apply_layernorm_1p)"),
    ("qwen2", "softmax_scale", 0.5, "(softmax_scale)"),
    ("mixtral", "moe_router_pre_softmax", True, "(moe_router_pre_softmax), which Mixtral's router renormalises"),
    ("mixtral", "moe_router_topk_scaling_factor", 2.0, "routing weights scaled by 2"),
    ("mixtral", "moe_router_score_function", "sigmoid", "a sigmoid router (moe_router_score_function)"),
    ("mixtral", "moe_layer_freq", [0, 1], "dense layers between MoE layers"),
])
def test_args_the_family_cannot_say_are_refused(tmp_path, trestle_convert, hf_models, model, field, value, says):
    """Megatron-LM's arguments that change what the model computes and that the family the args name cannot say were
    ignored: megatron-core's own checkpoint with rotary_percent 0.5 (or a pre-softmax, scaled or sigmoid router)
    converted to a model whose logits differ by 5 to 12. Each is refused naming it, pointing to --hf-config."""
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", hf_models[model], "--to", "megatron-dist", dist, "-q")
    it = iteration_dir(dist)
    os.remove(os.path.join(it, "trestle_model.json"))  # only Megatron's args describe the model
    common = torch.load(os.path.join(it, "common.pt"), weights_only=False)
    setattr(common["args"], field, value)
    torch.save(common, os.path.join(it, "common.pt"))
    result = trestle_convert.run_raw("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "x")
    assert result.returncode == 1 and says in result.stderr and "--hf-config" in result.stderr, result.stderr
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("original, warned", [(64, True), (8192, False)])
def test_llama3_rope_parameters_megatron_args_cannot_carry_are_named(tmp_path, trestle_convert, original, warned):
    """Megatron-LM's arguments carry Llama 3.1 RoPE's factor only (megatron-core fixes low 1, high 4 and an original
    context of 8192): a model with other values converts (trestle_model.json keeps them) with a warning naming the one
    Megatron-LM would build otherwise; with megatron-core's values, none."""
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": original}), seed=0)
    out = trestle_convert.run("convert", "--from", "hf", hf, "--to", "megatron-dist", tmp_path / "dist", "-q")
    says = f"original_max_position_embeddings {original} (megatron-core's 8192)"
    assert (says in out) == warned and ("warning" in out) == warned, out
    args = torch.load(os.path.join(iteration_dir(tmp_path / "dist"), "common.pt"), weights_only=False)["args"]
    assert args.use_rope_scaling and args.rope_scaling_factor == 8.0


def test_families_megatron_args_cannot_describe_need_the_model(tmp_path, trestle_convert, hf_models):
    """OLMo 2's layers have no Megatron-LM arguments: without trestle_model.json the args alone (which would read as
    a Qwen3) are refused, naming what to give; with --hf-config the checkpoint converts exactly."""
    hf_dir = hf_models["olmo2"]
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", dist, "--tp", 2, "-q")
    it = iteration_dir(dist)
    args = torch.load(os.path.join(it, "common.pt"), weights_only=False)["args"]
    assert args.qk_layernorm is True and args.trestle_family == "OLMo 2"
    os.remove(os.path.join(it, "trestle_model.json"))
    result = trestle_convert.run_raw("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "x")
    assert result.returncode == 1 and "OLMo 2" in result.stderr and "--hf-config" in result.stderr, result.stderr
    assert not os.path.exists(tmp_path / "x")
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "hf", "--hf-config",
                        hf_dir, "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "hf"))
    torch.testing.assert_close(hf_logits(tmp_path / "hf", TOKENS), hf_logits(hf_dir, TOKENS), rtol=0, atol=0)


def test_sliding_window_travels_as_megatron_window_size(tmp_path, trestle_convert, hf_models):
    hf_dir = hf_models["mistral_window"]
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", dist, "--tp", 2, "-q")
    it = iteration_dir(dist)
    args = torch.load(os.path.join(it, "common.pt"), weights_only=False)["args"]
    assert tuple(args.window_size) == (3, 0)  # Megatron's left window excludes the query itself
    os.remove(os.path.join(it, "trestle_model.json"))  # only the args describe the model now
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "hf", "-q")
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] == 4
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "hf"))
    torch.testing.assert_close(hf_logits(tmp_path / "hf", TOKENS), hf_logits(hf_dir, TOKENS), rtol=0, atol=0)


def test_rope_scaling_travels_as_megatron_args(tmp_path, trestle_convert, hf_models):
    hf_dir = hf_models["llama31"]
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", dist, "-q")
    it = iteration_dir(dist)
    args = torch.load(os.path.join(it, "common.pt"), weights_only=False)["args"]
    assert args.use_rope_scaling is True and args.rope_scaling_factor == 16.0
    os.remove(os.path.join(it, "trestle_model.json"))  # only the args describe the model now
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "hf", "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "hf"))
    # Without the scaling (or with another factor) the rotary frequencies, and so the logits, would differ.
    torch.testing.assert_close(hf_logits(tmp_path / "hf", TOKENS), hf_logits(hf_dir, TOKENS), rtol=0, atol=0)


def test_a_megatron_checkpoint_written_as_megatron_dist_keeps_its_vocab_padding(tmp_path, trestle_convert, hf_models):
    """A checkpoint padded to a multiple of 1 (vocabulary 1000 at tp 2) written as megatron-dist (from trestle, and
    from megatron-dist at tp 1) keeps that padding, as reshard does, unless --make-vocab-size-divisible-by is given
    (re-padded to 128 x tp, a Megatron-LM run padding by 1 could not load it)."""
    hf_dir = hf_models["llama"]
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "trestle", tmp_path / "t", "--tp", 2,
                        "--make-vocab-size-divisible-by", 1, "-q")

    def padding(root):
        it = iteration_dir(root)
        args = torch.load(os.path.join(it, "common.pt"), weights_only=False)["args"]
        rows = dcp.FileSystemReader(it).read_metadata().state_dict_metadata["embedding.word_embeddings.weight"].size
        return args.make_vocab_size_divisible_by, args.padded_vocab_size, rows[0]

    trestle_convert.run("convert", "--from", "trestle", tmp_path / "t", "--to", "megatron-dist", tmp_path / "d",
                        "--tp", 2, "-q")
    assert padding(tmp_path / "d") == (1, 1000, 1000)
    trestle_convert.run("convert", "--from", "megatron-dist", tmp_path / "d", "--to", "megatron-dist",
                        tmp_path / "d1", "-q")
    assert padding(tmp_path / "d1") == (1, 1000, 1000)
    trestle_convert.run("convert", "--from", "trestle", tmp_path / "t", "--to", "megatron-dist", tmp_path / "d64",
                        "--tp", 2, "--make-vocab-size-divisible-by", 64, "-q")
    assert padding(tmp_path / "d64") == (64, 1024, 1024)
    trestle_convert.run("convert", "--from", "megatron-dist", tmp_path / "d1", "--to", "hf", tmp_path / "hf", "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "hf"))


def test_reads_per_layer_keys(tmp_path, trestle_convert, hf_models):
    """Non-homogeneous models are saved with per-layer keys (decoder.layers.<i>.<param>, experts [E, ...]): a DCP
    checkpoint re-saved that way by torch.distributed.checkpoint converts to the same HF tensors."""
    hf_dir = hf_models["mixtral"]
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", tmp_path / "d", "-q")
    per_layer = {}
    for key, value in read_dcp(iteration_dir(tmp_path / "d")).items():
        if key.startswith("decoder.layers."):
            for i in range(value.shape[0]):
                per_layer[f"decoder.layers.{i}.{key[len('decoder.layers.'):]}"] = value[i].clone()
        else:
            per_layer[key] = value
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in per_layer
    dcp.save(per_layer, storage_writer=dcp.FileSystemWriter(str(tmp_path / "p")), no_dist=True)
    trestle_convert.run("convert", "--from", "megatron-dist", tmp_path / "p", "--to", "hf", tmp_path / "hf",
                        "--hf-config", hf_dir, "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "hf"))


def test_bad_input_is_named(tmp_path, trestle_convert, hf_models):
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", hf_models["llama"], "--to", "megatron-dist", dist, "-q")
    result = trestle_convert.run_raw("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "x",
                                     "--hf-config", hf_models["qwen2"])
    # names the key, its stored shape and what the given config expects
    assert result.returncode == 1 and "'embedding.word_embeddings.weight' has global shape [1024, 48], expected " \
        "[1024, 32]" in result.stderr, result.stderr
    result = trestle_convert.run_raw("convert", "--from", "zip", dist, "--to", "hf", tmp_path / "y")
    assert result.returncode == 2 and "unknown checkpoint format 'zip'" in result.stderr
    result = trestle_convert.run_raw("convert", "--from", "megatron-dist", tmp_path, "--to", "hf", tmp_path / "z")
    assert result.returncode == 1 and "latest_checkpointed_iteration.txt" in result.stderr, result.stderr
    # --dry-run plans and writes nothing
    plan = trestle_convert.run("convert", "--from", "hf", hf_models["llama"], "--to", "megatron-dist", tmp_path / "dry",
                               "--tp", 2, "--pp", 2, "--dry-run")
    assert "tp 2, pp 2" in plan and "rank 3" in plan and not os.path.exists(tmp_path / "dry"), plan
    # a rank file gone: the error names the file and the tensor, nothing crashes
    os.remove(dist / "iter_0000000" / "__0_0.distcp")
    result = trestle_convert.run_raw("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "w")
    assert result.returncode == 1 and "__0_0.distcp" in result.stderr and "tensor '" in result.stderr, result.stderr


# --- legacy mp_rank trees, written here as Megatron writes them ------------------------------------------------

def legacy_rank_state(hf, config, tp, pp, vpp, ep, tp_rank, pp_rank, ep_rank, args):
    """The dict Megatron's legacy save writes for one (tp, pp, ep) rank: per model chunk, a state dict whose layers
    are numbered from 0 in the chunk and whose experts from 0 on the EP rank."""
    reference = MegatronReference(hf, config, tp, "te")
    layers = config["num_hidden_layers"]
    experts = config.get("num_local_experts", 0)
    per_chunk, per_rank = layers // (pp * vpp), experts // ep
    attention = ["self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
                 "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight"]
    mlp = ["pre_mlp_layernorm.weight", "mlp.router.weight"] if experts else \
        ["mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]

    def local(name):
        return reference.hf_name_and_kind(name)[1](tp_rank).clone()

    chunks = []
    for v in range(vpp):
        sd = OrderedDict()
        first = (v * pp + pp_rank) * per_chunk
        if pp_rank == 0 and v == 0:
            sd["embedding.word_embeddings.weight"] = local("embedding.word_embeddings.weight")
        for j in range(per_chunk):
            i = first + j
            for param in attention + mlp:
                if param.endswith("bias") and f"model.layers.{i}.self_attn.q_proj.bias" not in hf:
                    continue
                sd[f"decoder.layers.{j}.{param}"] = local(f"decoder.layers.{i}.{param}")
            for e in range(per_rank):
                for fc in ("linear_fc1", "linear_fc2"):
                    sd[f"decoder.layers.{j}.mlp.experts.local_experts.{e}.{fc}.weight"] = local(
                        f"decoder.layers.{i}.mlp.experts.local_experts.{ep_rank * per_rank + e}.{fc}.weight")
            sd[f"decoder.layers.{j}.self_attention.linear_qkv._extra_state"] = None
        if pp_rank == pp - 1 and v == vpp - 1:
            sd["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
            if not config.get("tie_word_embeddings", False):
                sd["output_layer.weight"] = local("output_layer.weight")
            elif pp > 1:  # the last stage keeps its own copy of the tied embedding
                sd["output_layer.weight"] = local("embedding.word_embeddings.weight")
        chunks.append(sd)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": 20}
    if vpp == 1:
        state["model"] = chunks[0]
    else:
        for v, sd in enumerate(chunks):
            state[f"model{v}"] = sd
    state["rng_state"] = [{"random_rng_state": None}]
    state["opt_param_scheduler"] = {"num_steps": 20}
    return state


def megatron_args(config, tp, pp, vpp, ep, with_vocab=True):
    experts = config.get("num_local_experts")
    return argparse.Namespace(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"], num_attention_heads=config["num_attention_heads"],
        group_query_attention=True, num_query_groups=config["num_key_value_heads"],
        kv_channels=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        vocab_size=config["vocab_size"] if with_vocab else None,
        padded_vocab_size=-(-config["vocab_size"] // (128 * tp)) * 128 * tp, make_vocab_size_divisible_by=128,
        max_position_embeddings=config["max_position_embeddings"], swiglu=True, normalization="RMSNorm",
        position_embedding_type="rope", add_bias_linear=False, add_qkv_bias="qwen2" in config["model_type"],
        untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
        rotary_base=config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 10000.0),
        norm_epsilon=config["rms_norm_eps"], bf16=config.get("dtype", config.get("torch_dtype")) == "bfloat16",
        fp16=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, expert_model_parallel_size=ep,
        num_experts=experts, moe_router_topk=config.get("num_experts_per_tok"),
        moe_ffn_hidden_size=config["intermediate_size"] if experts else None, transformer_impl="transformer_engine")


def write_legacy_tree(hf_dir, root, tp, pp, vpp, ep=1, with_vocab=True):
    hf = load_hf_tensors(hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    args = megatron_args(config, tp, pp, vpp, ep, with_vocab)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            for ep_rank in range(ep):  # Megatron's get_checkpoint_name: mp_rank_{tp}[_{pp}][_{ep}]
                name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + \
                    (f"_{ep_rank:03d}" if ep > 1 else "")
                d = root / "iter_0000020" / name
                d.mkdir(parents=True)
                state = legacy_rank_state(hf, config, tp, pp, vpp, ep, tp_rank, pp_rank, ep_rank, args)
                torch.save(state, d / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("20")


LEGACY = [("llama", 2, 2, 1, 1), ("llama32_tied", 1, 2, 2, 1), ("qwen2", 2, 2, 1, 1), ("mixtral", 2, 1, 1, 2),
          ("wide", 2, 1, 1, 1)]


@pytest.mark.parametrize("name,tp,pp,vpp,ep", LEGACY)
def test_legacy_tree_to_hf(tmp_path, trestle_convert, hf_models, name, tp, pp, vpp, ep):
    hf_dir = hf_models[name]
    root = tmp_path / "legacy"
    write_legacy_tree(hf_dir, root, tp, pp, vpp, ep)
    info = json.loads(trestle_convert.run("inspect", root, "--json"))
    layout = info["model"]["layout"]
    assert (layout["tp"], layout["pp"], layout["vpp"], layout["ep"]) == (tp, pp, vpp, ep), info["model"]
    trestle_convert.run("convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "hf", "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "hf"))
    torch.testing.assert_close(hf_logits(tmp_path / "hf", TOKENS), hf_logits(hf_dir, TOKENS), rtol=0, atol=0)
    # legacy -> torch_dist in another layout, checked with torch.distributed.checkpoint
    trestle_convert.run("convert", "--from", "megatron-legacy", root, "--to", "megatron-dist", tmp_path / "d",
                        "--tp", 1, "--pp", 1, "-q")
    check_megatron_keys(hf_dir, tmp_path / "d", 1)
    out = trestle_convert.run_raw("diff", root, tmp_path / "d")
    assert out.returncode == 0, out.stdout + out.stderr


def test_legacy_without_vocab_size_uses_hf_config_and_names_bad_tensors(tmp_path, trestle_convert, hf_models):
    hf_dir = hf_models["llama"]
    root = tmp_path / "legacy"
    write_legacy_tree(hf_dir, root, 2, 2, 1, with_vocab=False)
    trestle_convert.run("convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "hf", "--hf-config",
                        os.path.join(hf_dir, "config.json"), "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "hf"))
    # Optimizer state (indexed by parameter position) is not mapped: refused, never dropped, unless --model-only.
    path = root / "iter_0000020" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    torch.save(dict(state, optimizer={"optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}}}), path)
    result = trestle_convert.run_raw("convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "o",
                                     "--hf-config", hf_dir)
    assert result.returncode == 1 and "optimizer.optimizer.state.0.exp_avg" in result.stderr and \
        "--model-only" in result.stderr, result.stderr
    trestle_convert.run("convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "o", "--hf-config",
                        hf_dir, "--model-only", "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "o"))
    torch.save(state, path)
    # A rank whose QKV was cut wrongly is named with the file, tensor and the shape expected.
    path = root / "iter_0000020" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["decoder.layers.0.self_attention.linear_qkv.weight"] = \
        state["model"]["decoder.layers.0.self_attention.linear_qkv.weight"][:-8].clone()
    torch.save(state, path)
    result = trestle_convert.run_raw("convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "x",
                                     "--hf-config", hf_dir)
    assert result.returncode == 1, result.stderr
    assert "mp_rank_01_001" in result.stderr and "model.decoder.layers.0.self_attention.linear_qkv.weight" in \
        result.stderr and "expected [40, 48]" in result.stderr, result.stderr


def test_legacy_files_that_megatron_reads_otherwise_are_refused(tmp_path, trestle_convert, hf_models):
    """A rank file older than checkpoint version 2.0 (or without one, which Megatron-LM reads as 0), whose query/key/value
    rows Megatron-LM reorders as it loads, and a single stage whose args tie the embeddings but which stores an output
    layer (the args describe another model: with tied embeddings a single stage has none): refused naming the file,
    never converted wrongly or with the weight dropped."""
    hf_dir = hf_models["llama32_tied"]
    root = tmp_path / "legacy"
    write_legacy_tree(hf_dir, root, 1, 1, 1)
    path = root / "iter_0000020" / "mp_rank_00" / "model_optim_rng.pt"
    good = torch.load(path, weights_only=False)

    def refused(state, *messages):
        torch.save(state, path)
        result = trestle_convert.run_raw("convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "x")
        assert result.returncode == 1 and str(path) in result.stderr and \
            all(m in result.stderr for m in messages), result.stderr
        assert not (tmp_path / "x").exists()

    for version, shown in ((1.0, "checkpoint_version 1:"), (0, "checkpoint_version 0:"),
                           (None, "checkpoint_version missing or not a number (Megatron-LM reads it as 0)"),
                           ("3.0", "checkpoint_version missing or not a number")):
        state = dict(good)
        if version is None:
            del state["checkpoint_version"]
        else:
            state["checkpoint_version"] = version
        refused(state, shown, "reorders the query/key/value rows of a checkpoint older than 2.0")
    model = dict(good["model"])
    model["output_layer.weight"] = model["embedding.word_embeddings.weight"].clone()
    refused(dict(good, model=model), "tensor 'model.output_layer.weight' is not a weight of the")
    torch.save(good, path)
    trestle_convert.run("convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "hf", "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(tmp_path / "hf"))


# --- megatron-core: a real GPTModel (local spec, CPU, gloo, world size 1) ---------------------------------------

MCORE_CONFIGS = {
    "dense": ("LlamaConfig", dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5)),
    "moe": ("MixtralConfig", dict(vocab_size=128, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                                  num_local_experts=4, num_experts_per_tok=2)),
    "shared": ("Qwen2MoeConfig", dict(vocab_size=128, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, num_experts=4,
                                      num_experts_per_tok=2)),
}

MCORE = textwrap.dedent("""
    import json, os, sys, torch, torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    # CPU workarounds, at module level so megatron-core's writer process (which imports this file) has them too:
    # its FileSystemWriterAsync calls torch.cuda.synchronize() unconditionally, the save's finalize broadcasts a flag
    # on torch.cuda.current_device(), and the writer measures its RSS with psutil, which the venv does not install.
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
    filesystem_async._process_memory = lambda: 0

    def build(c, port, **extra):  # a GPTModel (local spec, fp32, random weights) of HF config c, in a gloo world of one
        # (extra: more TransformerConfig arguments)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        dist.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig
        parallel_state.initialize_model_parallel(1, 1)
        torch.manual_seed(3)
        experts = c.get("num_local_experts") or c.get("num_experts")
        moe = dict(num_moe_experts=experts, moe_router_topk=c["num_experts_per_tok"],
                   moe_ffn_hidden_size=c.get("moe_intermediate_size", c["intermediate_size"])) if experts else {}
        shared = c.get("shared_expert_intermediate_size")  # Qwen2-MoE: a gated shared expert and QKV bias
        if shared:
            moe.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True, add_qkv_bias=True)
        config = TransformerConfig(
            num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
            num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_key_value_heads"],
            kv_channels=c["head_dim"], normalization="RMSNorm", layernorm_epsilon=c["rms_norm_eps"],
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
            params_dtype=torch.float32, **moe, **extra)
        spec = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm",
                                        qk_layernorm=extra.get("qk_layernorm", False))
        model = GPTModel(config=config, transformer_layer_spec=spec,
                         vocab_size=c["vocab_size"], max_sequence_length=64, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
        with torch.no_grad():  # norms start at 1: randomise so misplacing them shows
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
        return config, model

    def main():
        mode, ckpt, out, port = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
        c = json.loads(sys.argv[6])
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
        from safetensors.torch import save_file
        _, model = build(c, port)
        sharded = model.sharded_state_dict()
        # checkpoint key -> global shape, as Megatron-Core expects to find them
        shapes = {v.key: list(v.global_shape) for v in sharded.values() if hasattr(v, "global_shape")}
        if mode == "save":
            dist_checkpointing.save(sharded, ckpt, sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1,
                                                                                                thread_count=1))
        else:
            loaded = dist_checkpointing.load(sharded, ckpt)
            model.load_state_dict(loaded, strict=False)
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        save_file(state, os.path.join(out, "model.safetensors"))
        json.dump(shapes, open(os.path.join(out, "sharded_shapes.json"), "w"))
        dist.destroy_process_group()

    if __name__ == "__main__":  # megatron-core's async writer starts a process that imports this file
        main()
""")


# Megatron-Core's optimizer: the same model, one Adam step (fp32 and non-distributed: its mixed-precision and distributed
# optimizers need CUDA), model + optimizer sharded state dicts saved (or loaded) as Megatron-LM's checkpointing does:
# the optimizer's sharded state dict asked for as the checkpoint's content metadata says. Either way the optimizer's
# state tensors (by param id) and its common step are dumped for comparison. Mode load-into-optimizer goes on as
# Megatron-LM's load_checkpoint does: the loaded state goes to the optimizer's load_state_dict (which takes the param
# groups from common.pt; the optimizer is built with other hyper-parameters), and every parameter's Adam state as the
# optimizer then holds it, its steps and each group's hyper-parameters are dumped too.
MCORE_OPTIM = MCORE.split("\ndef main():")[0] + textwrap.dedent("""
    def main():
        mode, ckpt, out, port = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
        c = json.loads(sys.argv[6])
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from safetensors.torch import save_file
        if not torch.cuda.is_available():  # FP32Optimizer keeps its loss-scale constant on 'cuda'
            tensor = torch.tensor
            torch.tensor = lambda *a, **k: tensor(*a, **(dict(k, device="cpu") if k.get("device") == "cuda" else k))
        config, model = build(c, port)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        lr = 1e-3 if mode == "save" else 0.5
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=lr, clip_grad=0.0), [ddp])
        sharded = model.sharded_state_dict()
        if mode == "save":
            for _ in range(2):
                for p in ddp.parameters():
                    p.grad = torch.randn_like(p)
                optimizer.optimizer.step()  # Adam itself: MegatronOptimizer.step() computes the grad norm on CUDA
            sharded["optimizer"] = optimizer.sharded_state_dict(sharded)
            state = {k: (v if k == "common_step" else {s: t.data.clone() for s, t in v.items()})
                     for k, v in sharded["optimizer"]["state"].items()}
            dist_checkpointing.save(sharded, ckpt, sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1,
                                                                                                thread_count=1))
        else:
            common = torch.load(os.path.join(ckpt, "common.pt"), weights_only=False)
            metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
            sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=True, metadata=metadata)
            loaded = dist_checkpointing.load(sharded, ckpt)["optimizer"]
            state = loaded["state"]
        tensors = {f"{i}.{s}": t.contiguous() for i, v in state.items() if i != "common_step" for s, t in v.items()}
        save_file(tensors, os.path.join(out, "optimizer.safetensors"))
        json.dump({"step": float(state["common_step"])}, open(os.path.join(out, "step.json"), "w"))
        if mode == "load-into-optimizer":
            optimizer.load_state_dict(loaded)
            inner = optimizer.optimizer
            held = {f"{i}.{s}": inner.state[p][s].contiguous() for i, p in enumerate(optimizer.get_parameters())
                    for s in ("exp_avg", "exp_avg_sq")}
            save_file(held, os.path.join(out, "optimizer_held.safetensors"))
            steps = sorted({float(inner.state[p]["step"]) for p in optimizer.get_parameters()})
            groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
            json.dump({"steps": steps, "groups": groups, "metadata": metadata},
                      open(os.path.join(out, "state.json"), "w"))
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
""")


# megatron-core on CPU takes over a minute per run on a busy machine (importing it alone takes ~30 s); a run that
# does not finish in this time is a failure.
MCORE_TIMEOUT_S = 600


def run_mcore(tmp_path, mode, ckpt, port, kind, script_text=MCORE, config=None):
    """Runs a megatron-core script (mode save or load) on the HF config of MCORE_CONFIGS[kind] or `config`. A free
    port can be taken by another test between free_port() and the script's listen: a run that fails only on that
    (EADDRINUSE) runs again on a new port, at most twice more; any other failure is the caller's to assert."""
    script = tmp_path / f"mcore_{mode}.py"
    script.write_text(script_text)
    out = tmp_path / f"mcore_{mode}"
    for attempt in range(3):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        try:
            result = reference_scripts().run([script, mode, ckpt, out, port, "",
                                              json.dumps(config if config is not None else MCORE_CONFIGS[kind][1])],
                                             timeout=MCORE_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"megatron-core {mode} did not finish within {MCORE_TIMEOUT_S} s\nstderr:\n{e.stderr}")
        if result.returncode == 0 or "EADDRINUSE" not in (result.stderr or ""):
            break
        port = free_port()
    return result, out


def mcore_hf_config(kind):
    config_class, kwargs = MCORE_CONFIGS[kind]
    config = getattr(transformers, config_class)(**kwargs)
    config.architectures = [config_class.replace("Config", "ForCausalLM")]
    return config


def mcore_hf_model(directory, kind):
    config_class, config = MCORE_CONFIGS[kind]
    save_tiny_model(directory, config_class, config, seed=11)
    return directory


def check_against_megatron_model(hf_dir, state):
    """Every parameter of the Megatron-Core model equals what Megatron's layout makes of the HF tensors."""
    reference = MegatronReference(load_hf_tensors(hf_dir), json.load(open(os.path.join(hf_dir, "config.json"))), 1, "local")
    assert len(state) > 10
    for name, value in state.items():
        expected = reference.hf_name_and_kind(name)[1](0)
        assert value.shape == expected.shape and torch.equal(value, expected), name


@pytest.mark.parametrize("kind", list(MCORE_CONFIGS))
def test_megatron_core_loads_trestle_checkpoint(tmp_path, trestle_convert, kind):
    hf_dir = mcore_hf_model(str(tmp_path / "hf"), kind)
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "megatron-dist", tmp_path / "d", "--norms", "local",
                        "-q")
    it = iteration_dir(tmp_path / "d")
    result, out = run_mcore(tmp_path, "load", it, free_port(), kind)  # the model's whole sharded state dict
    assert result.returncode == 0, result.stderr[-3000:]
    shapes = json.load(open(out / "sharded_shapes.json"))
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == [2, 64, 32]  # stacked [L, ...]
    assert shapes["embedding.word_embeddings.weight"] == [128, 32]
    if kind == "moe":
        assert shapes["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == [2, 4, 32, 40]  # [L, E, ...]
    if kind == "shared":
        # (linear_fc1 is a swiglu factory without a global shape in this listing; the strict load above covers it)
        assert shapes["decoder.layers.mlp.shared_experts.linear_fc2.weight"] == [2, 32, 48]
        assert shapes["decoder.layers.mlp.shared_experts.gate_weight"] == [2, 1, 32]
        assert shapes["decoder.layers.self_attention.linear_qkv.bias"] == [2, 64]
    metadata = dcp.FileSystemReader(it).read_metadata().state_dict_metadata
    for key, shape in shapes.items():
        if not key.endswith("_extra_state"):
            assert list(metadata[key].size) == shape, key
    check_against_megatron_model(hf_dir, safetensors_torch.load_file(out / "model.safetensors"))


@pytest.mark.parametrize("kind", list(MCORE_CONFIGS))
def test_trestle_reads_megatron_core_save(tmp_path, trestle_convert, kind):
    (tmp_path / "mc").mkdir()
    result, out = run_mcore(tmp_path, "save", tmp_path / "mc", free_port(), kind)
    assert result.returncode == 0, result.stderr[-3000:]
    mcore_hf_config(kind).save_pretrained(tmp_path / "cfg")
    trestle_convert.run("convert", "--from", "megatron-dist", tmp_path / "mc", "--to", "hf", tmp_path / "hf",
                        "--hf-config", tmp_path / "cfg", "-q")
    state = safetensors_torch.load_file(out / "model.safetensors")
    state = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    check_against_megatron_model(str(tmp_path / "hf"), state)


def test_optimizer_state_through_trestle(tmp_path, trestle_convert):
    """Megatron-Core saves model + Adam state -> trestle (tp 2, dp 2: distributed-optimizer flat shards) ->
    megatron-dist (tp 1) -> Megatron-Core loads it: every optimizer tensor and the step equal what it saved, bit for
    bit; optimizer state that cannot be mapped is refused unless --model-only."""
    (tmp_path / "mc").mkdir()
    result, saved = run_mcore(tmp_path, "save", tmp_path / "mc", free_port(), "dense", MCORE_OPTIM)
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = tmp_path / "cfg"
    mcore_hf_config("dense").save_pretrained(cfg)
    original = read_dcp(tmp_path / "mc")
    moments = [k for k in original if k.startswith("optimizer.state.")]
    assert "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight" in moments
    assert original["optimizer.state.exp_avg_sq.decoder.layers.self_attention.linear_qkv.weight"].shape == (2, 64, 32)
    assert len(moments) == 2 * 9  # exp_avg and exp_avg_sq of each of the 9 (stacked) model keys

    trestle_convert.run("reshard", tmp_path / "mc", tmp_path / "t", "--to-format", "trestle", "--tp", 2, "--dp", 2,
                        "--hf-config", cfg, "-q")
    names = json.load(open(iteration_dir(tmp_path / "t") + "/manifest.json"))["tensors"]
    weights = [n for n in names if not n.startswith("optimizer.")]
    assert len(weights) == 15 and "optimizer.step" in names
    assert all(f"optimizer.{s}.{w}" in names for s in ("exp_avg", "exp_avg_sq") for w in weights)
    out = trestle_convert.run_raw("diff", tmp_path / "mc", tmp_path / "t", "--hf-config", cfg, "--json", "--all")
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(json.loads(out.stdout)["tensors"]) == 3 * len(weights) + 1

    trestle_convert.run("reshard", tmp_path / "t", tmp_path / "d", "--to-format", "megatron-dist", "--tp", 1, "-q")
    rewritten = read_dcp(iteration_dir(tmp_path / "d"))
    for key in moments:
        assert torch.equal(original[key], rewritten[key]), key
    result, loaded = run_mcore(tmp_path, "load", iteration_dir(tmp_path / "d"), free_port(), "dense", MCORE_OPTIM)
    assert result.returncode == 0, result.stderr[-3000:]
    before = safetensors_torch.load_file(saved / "optimizer.safetensors")
    after = safetensors_torch.load_file(loaded / "optimizer.safetensors")
    assert sorted(before) == sorted(after) and len(before) == 2 * 15
    for key, value in before.items():
        assert torch.equal(value, after[key]), key
    assert json.load(open(saved / "step.json")) == json.load(open(loaded / "step.json")) == {"step": 2.0}

    # optimizer entries that are neither model-space Adam state nor dp_reshardable bucket buffers (a flat tensor without
    # a bucket index): refused, or --model-only
    flat = dict(original, **{"optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_0.exp_avg": torch.zeros(8),
                             "optimizer.distributed.dp_group_idx_0.per_bucket_numel/shard_0_1": io.BytesIO(b"[]")})
    dcp.save(flat, checkpoint_id=str(tmp_path / "flat"), no_dist=True)
    shutil.copy(tmp_path / "mc" / "common.pt", tmp_path / "flat" / "common.pt")
    refused = trestle_convert.run_raw("reshard", tmp_path / "flat", tmp_path / "t2", "--to-format", "trestle",
                                      "--hf-config", cfg, "-q")
    assert refused.returncode != 0 and "2 optimizer entries" in refused.stderr and "dp_reshardable" in \
        refused.stderr and "--model-only" in refused.stderr, refused.stderr
    assert not os.path.exists(tmp_path / "t2" / "latest_checkpointed_iteration.txt")
    trestle_convert.run("reshard", tmp_path / "flat", tmp_path / "t3", "--to-format", "trestle", "--hf-config", cfg,
                        "--model-only", "-q")
    names = json.load(open(iteration_dir(tmp_path / "t3") + "/manifest.json"))["tensors"]
    assert sorted(names) == sorted(weights)


def test_a_flipped_bit_in_a_distcp_item_is_detected(tmp_path, trestle_convert, hf_models):
    """DCP keeps no checksums, but every tensor item is a torch.save zip whose records carry a CRC-32: a bit flipped
    inside any tensor's data fails the conversion naming the file and tensor, wherever it lands (whole-record reads
    are checked as they are copied, partial ones by reading the record through once)."""
    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", hf_models["llama"], "--to", "megatron-dist", dist, "--tp", 2, "-q")
    it = pathlib.Path(iteration_dir(dist))
    metadata = dcp.FileSystemReader(str(it)).read_metadata()
    storage = metadata.storage_data
    original = {f: (it / f).read_bytes() for f in os.listdir(it) if f.endswith(".distcp")}
    tested = 0
    for index, info in storage.items():
        if index.fqn not in ("decoder.layers.mlp.linear_fc1.weight", "embedding.word_embeddings.weight"):
            continue
        data = bytearray(original[info.relative_path])
        data[info.offset + info.length // 2] ^= 0x08  # inside the tensor data, which fills most of the item
        (it / info.relative_path).write_bytes(bytes(data))
        result = trestle_convert.run_raw("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / f"o{tested}")
        assert result.returncode == 1, result.stdout
        assert "(the file is corrupt)" in result.stderr and info.relative_path in result.stderr, result.stderr
        assert index.fqn in result.stderr, result.stderr
        (it / info.relative_path).write_bytes(original[info.relative_path])
        tested += 1
    assert tested >= 2
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "clean", "-q")


def test_legacy_distributed_optimizer_state_is_not_dropped(tmp_path, trestle_convert, hf_models):
    """Megatron-LM's legacy save with --use-distributed-optimizer keeps Adam's state in mp_rank_*/distrib_optim.pt
    (model_optim_rng.pt holds the param groups alone): refused, naming it, unless --model-only (it converted as
    "0 optimizer states", exit 0)."""
    root = tmp_path / "legacy"
    write_legacy_tree(hf_models["llama"], root, 2, 1, 1)
    for rank in (0, 1):
        torch.save({0: {(torch.bfloat16, torch.float32): {"exp_avg": torch.zeros(8)}}},
                   root / "iter_0000020" / f"mp_rank_{rank:02d}" / "distrib_optim.pt")
    result = trestle_convert.run_raw("convert", "--from", "megatron-legacy", root, "--to", "trestle", tmp_path / "t")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "mp_rank_00/distrib_optim.pt: the distributed optimizer's state" in result.stderr, result.stderr
    assert "--model-only" in result.stderr and not (tmp_path / "t").exists()
    trestle_convert.run("convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "hf", "--model-only",
                        "-q")
    assert_bit_exact(load_hf_tensors(hf_models["llama"]), load_hf_tensors(str(tmp_path / "hf")))


def test_legacy_replicas_that_disagree_fail_verify(tmp_path, trestle_convert, hf_models):
    """A replicated tensor (a norm in every tensor-parallel rank's file) is read from the first rank; verify checks the
    other copies agree with it (a copy changed in mp_rank_01 passed verify and diff before)."""
    root = tmp_path / "legacy"
    write_legacy_tree(hf_models["llama"], root, 2, 1, 1)
    trestle_convert.run("verify", root)
    path = root / "iter_0000020" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    key = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    state["model"][key] = state["model"][key] + 1
    torch.save(state, path)
    result = trestle_convert.run_raw("verify", root)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert ("tensor 'decoder.layers.0.self_attention.linear_qkv.layer_norm_weight' [0:" in result.stderr and
            "mp_rank_00/model_optim_rng.pt" in result.stderr and "mp_rank_01/model_optim_rng.pt" in result.stderr and
            "which hold the same copy of it" in result.stderr), result.stderr


def test_a_legacy_weight_that_is_not_a_tensor_says_what_it_holds(tmp_path, trestle_convert, hf_models):
    root = tmp_path / "legacy"
    write_legacy_tree(hf_models["llama"], root, 2, 1, 1)
    path = root / "iter_0000020" / "mp_rank_01" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    key = "decoder.layers.1.mlp.linear_fc2.weight"
    state["model"][key] = 7
    torch.save(state, path)
    result = trestle_convert.run_raw("convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "out")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert f"mp_rank_01/model_optim_rng.pt: 'model.{key}' is not a tensor (it holds 7)" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_legacy_rank_directories_giving_an_impossible_layout_are_named(tmp_path, trestle_convert, hf_models):
    """A stray mp_rank_02 makes the directories say tp 3, which 2 KV heads cannot be split over: the error names the
    tree and where the 3 came from (it named neither)."""
    root = tmp_path / "legacy"
    write_legacy_tree(hf_models["llama"], root, 2, 1, 1)
    shutil.copytree(root / "iter_0000020" / "mp_rank_01", root / "iter_0000020" / "mp_rank_02")
    result = trestle_convert.run_raw("convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "out")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "iter_0000020 (the layout its mp_rank_* directories give: tp 3, pp 1, ep 1): " in result.stderr, \
        result.stderr


@pytest.mark.parametrize("linked", ["mp_rank_01", "mp_rank_01/model_optim_rng.pt", "iteration"])
def test_legacy_entries_replaced_by_links_are_not_followed(tmp_path, trestle_convert, hf_models, linked):
    root = tmp_path / "legacy"
    write_legacy_tree(hf_models["llama"], root, 2, 1, 1)
    entry = root / "iter_0000020" if linked == "iteration" else root / "iter_0000020" / linked
    commands = [["verify", root], ["convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "out"]]
    assert_link_is_not_followed(trestle_convert.run_raw, entry, tmp_path / "elsewhere", commands, tmp_path / "out")


def test_a_flipped_bit_in_a_legacy_rank_file_is_detected(tmp_path, trestle_convert, hf_models):
    """A legacy mp_rank file is one torch.save zip: a bit flipped anywhere either fails the conversion (a tensor's data
    fails its record's CRC-32, naming the file and tensor) or lands where no weight is read, and the output is then
    still bit-exact; never a silently different weight."""
    root = tmp_path / "legacy"
    write_legacy_tree(hf_models["llama"], root, 2, 1, 1)
    path = root / "iter_0000020" / "mp_rank_01" / "model_optim_rng.pt"
    original = path.read_bytes()
    detected = 0
    for step, fraction in enumerate((0.2, 0.35, 0.5, 0.65, 0.8, 0.95)):
        data = bytearray(original)
        data[int(len(data) * fraction)] ^= 0x20
        path.write_bytes(bytes(data))
        out = tmp_path / f"o{step}"
        result = trestle_convert.run_raw("convert", "--from", "megatron-legacy", root, "--to", "hf", out,
                                         "--hf-config", hf_models["llama"])
        if result.returncode == 0:
            assert_bit_exact(load_hf_tensors(hf_models["llama"]), load_hf_tensors(str(out)))
            continue
        assert "(the file is corrupt)" in result.stderr, (fraction, result.stderr)
        assert "mp_rank_01/model_optim_rng.pt: tensor 'model." in result.stderr, result.stderr
        detected += 1
    assert detected >= 3
    path.write_bytes(original)
    trestle_convert.run("convert", "--from", "megatron-legacy", root, "--to", "hf", tmp_path / "clean",
                        "--hf-config", hf_models["llama"], "-q")


def damaged_versions(data, flips, region=None):
    """(what, bytes): `data` cut to half and one byte short, and `flips` single-bit flips spread evenly over `region`
    (a (start, end) byte range; default the whole file)."""
    start, end = region or (0, len(data))
    out = [("cut to half", data[:len(data) // 2]), ("one byte short", data[:-1])]
    for k in range(flips):
        at = start + (2 * k + 1) * (end - start) // (2 * flips)
        damaged = bytearray(data)
        damaged[at] ^= 1 << (k % 8)
        out.append((f"bit {k % 8} of byte {at} flipped", bytes(damaged)))
    return out


def test_every_file_of_every_format_torn_or_flipped_fails_naming_it_or_converts_exactly(tmp_path, trestle_convert,
                                                                                        hf_models):
    """The corruption matrix: each file of a Trestle checkpoint (rank files, manifest, carried HF files), a torch_dist
    checkpoint (.distcp, .metadata, common.pt, metadata.json, side files), a legacy tree (mp_rank files) and a Hugging
    Face model (safetensors: its header; its data has no checksum to catch a flip), cut short or with one bit flipped
    at 8 places, converted to Hugging Face (the Hugging Face model to Trestle): the conversion fails naming the file (torch_dist's JSON descriptions, which
    have no checksum: failing on what the damaged text now says), or (the damage landed where nothing is read, or in
    a description that still means the same) its tensors equal the original's bit for bit."""
    hf = hf_models["llama"]
    expected = load_hf_tensors(hf)
    trestle_convert.run("convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "t", "--tp", 2, "-q")
    trestle_convert.run("convert", "--from", "hf", hf, "--to", "megatron-dist", tmp_path / "d", "--tp", 2, "-q")
    write_legacy_tree(hf, tmp_path / "l", 2, 1, 1)
    shutil.copytree(hf, tmp_path / "h")
    formats = {  # name: (root converted, the directory whose files are damaged, conversion arguments)
        "trestle": (tmp_path / "t", pathlib.Path(iteration_dir(tmp_path / "t")), ["--from", "trestle"]),
        "megatron-dist": (tmp_path / "d", pathlib.Path(iteration_dir(tmp_path / "d")), ["--from", "megatron-dist"]),
        "megatron-legacy": (tmp_path / "l", tmp_path / "l", ["--from", "megatron-legacy", "--hf-config", hf]),
        "hf": (tmp_path / "h", None, ["--from", "hf"]),
    }
    runs = failed = 0
    for name, (root, directory, args) in formats.items():
        if directory is None:  # Hugging Face: the safetensors file, flips in its header only
            header = 8 + int.from_bytes((root / "model.safetensors").read_bytes()[:8], "little")
            targets = [(root / "model.safetensors", (0, header))]
        else:
            targets = [(p, None) for p in sorted(directory.rglob("*")) if p.is_file() and not p.name.endswith(".txt")]
        assert len(targets) >= {"trestle": 3, "megatron-dist": 4, "megatron-legacy": 2, "hf": 1}[name], (name, targets)
        for path, region in targets:
            original = path.read_bytes()
            if not original:
                continue
            relative = str(path.relative_to(directory if directory is not None else root))
            for what, data in damaged_versions(original, 8, region):
                path.write_bytes(data)
                out = tmp_path / f"out{runs}"
                # (a Hugging Face model goes to Trestle: the mapping, not a pass-through of names, reads it)
                result = trestle_convert.run_raw("convert", *args, root, "--to", "trestle" if name == "hf" else "hf", out)
                runs += 1
                if result.returncode == 0 and name == "hf":
                    check = trestle_convert.run_raw("verify", out, "--against", hf)
                    assert check.returncode == 0, f"{name} {relative} {what}: converted to different weights"
                elif result.returncode == 0:
                    got = load_hf_tensors(str(out))
                    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got), \
                        f"{name} {relative} {what}: converted to different weights"
                else:
                    failed += 1
                    assert result.returncode == 1, (name, relative, what, result.stderr)
                    # torch_dist's JSON descriptions carry no checksum: a damaged one fails on what it now says
                    # (an unknown architecture, a side file that is not there), which need not name it
                    # (a safetensors tensor whose name was changed is named with its model directory)
                    if not (name == "megatron-dist" and path.suffix == ".json"):
                        assert path.name in result.stderr or (name == "hf" and str(root) in result.stderr), \
                            f"{name} {relative} {what}: {result.stderr[-800:]}"
                shutil.rmtree(out, ignore_errors=True)
            path.write_bytes(original)
    print(f"\ncorruption matrix: {runs} damaged conversions, {failed} refused, {runs - failed} exact")
    assert failed >= runs // 2


# config.json keys left out (transformers' per-class defaults) or a window the config keeps but does not use: the
# Megatron args (common.pt) must describe the model transformers builds, and the torch_dist converted back from its
# args alone must give transformers' logits.
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
DEFAULTED = {
    # (name: config class, sizes, keys taken out of config.json, keys set in it)
    "llama-minimal": ("LlamaConfig", SMALL, ["rms_norm_eps", "rope_parameters", "rope_theta",
                                             "max_position_embeddings"], {}),
    "mixtral-no-rope": ("MixtralConfig", dict(SMALL, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
                        ["rope_parameters", "rope_theta"], {}),
    "mistral-default-window": ("MistralConfig", SMALL, ["sliding_window"], {}),
    # Qwen2.5's and the R1 distillations' configs keep a window with use_sliding_window false
    "qwen2-unused-window": ("Qwen2Config", dict(SMALL, max_position_embeddings=64), [],
                            {"sliding_window": 4, "use_sliding_window": False}),
    # transformers 5 saves Qwen2-MoE's "no window" as 0
    "qwen2moe-window-0": ("Qwen2MoeConfig", dict(SMALL, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                 num_experts=4, num_experts_per_tok=2), [],
                          {"sliding_window": 0, "use_sliding_window": False}),
}


@pytest.mark.parametrize("name", DEFAULTED)
def test_configs_leaving_keys_to_transformers_defaults(tmp_path, trestle_convert, name):
    config_class, sizes, taken_out, set_in = DEFAULTED[name]
    hf = tmp_path / "hf"
    save_tiny_model(hf, config_class, sizes, seed=2, dtype=torch.float32)
    config = json.loads((hf / "config.json").read_text())
    for key in taken_out:
        config.pop(key, None)
    config.update(set_in)
    (hf / "config.json").write_text(json.dumps(config))
    resolved = transformers.AutoConfig.from_pretrained(hf)
    tokens = torch.randint(0, sizes["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(hf, tokens)

    dist = tmp_path / "dist"
    trestle_convert.run("convert", "--from", "hf", hf, "--to", "megatron-dist", dist, "-q")
    it = pathlib.Path(iteration_dir(dist))
    args = vars(torch.load(it / "common.pt", weights_only=False)["args"])
    window = getattr(resolved, "sliding_window", None)
    if getattr(resolved, "use_sliding_window", True) is False:
        window = None
    assert args["window_size"] == ((window - 1, 0) if window else None), (args["window_size"], window)
    assert args["norm_epsilon"] == resolved.rms_norm_eps
    assert args["rotary_base"] == resolved.rope_parameters["rope_theta"]
    assert args["max_position_embeddings"] == resolved.max_position_embeddings
    # What goes back out is config.json as given: the defaults stay transformers' to fill.
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "kept", "-q")
    kept = json.loads((tmp_path / "kept" / "config.json").read_text())
    assert not [key for key in taken_out if key in kept], kept
    # From the args alone (a Megatron-LM checkpoint keeps no trestle_model.json): the same model.
    (it / "trestle_model.json").unlink()
    shutil.rmtree(it / "hf_files", ignore_errors=True)
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", tmp_path / "back", "-q")
    got = hf_logits(tmp_path / "back", tokens)
    assert torch.allclose(got, expected, rtol=0, atol=1e-6), (got - expected).abs().max()


def test_gemma2_without_tie_word_embeddings_is_tied(tmp_path, trestle_convert):
    """Gemma's transformers default is tied embeddings: a config.json leaving the key out, with no lm_head stored, was
    refused ("missing: lm_head.weight")."""
    hf = tmp_path / "hf"
    save_tiny_model(hf, "Gemma2Config", dict(SMALL, head_dim=16), seed=3, dtype=torch.float32)
    config = json.loads((hf / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (hf / "config.json").write_text(json.dumps(config))
    trestle_convert.run("convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "t", "-q")
    trestle_convert.run("convert", "--from", "trestle", tmp_path / "t", "--to", "hf", tmp_path / "back", "-q")
    assert_bit_exact(load_hf_tensors(str(hf)), load_hf_tensors(str(tmp_path / "back")))


def test_tied_model_storing_its_lm_head_too(tmp_path, trestle_convert):
    """Some exporters store a tied model's lm_head beside the embedding it is (transformers loads it): taken as the
    embedding when equal byte for byte (refused as "not consumed" before), refused naming both when it differs."""
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", dict(SMALL, tie_word_embeddings=True), seed=4, dtype=torch.float32)
    weights = safetensors_torch.load_file(hf / "model.safetensors")
    assert "lm_head.weight" not in weights
    tokens = torch.randint(0, SMALL["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(hf, tokens)
    original = load_hf_tensors(str(hf))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    safetensors_torch.save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    trestle_convert.run("convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "t", "-q")
    trestle_convert.run("verify", tmp_path / "t", "--against", hf)
    trestle_convert.run("convert", "--from", "trestle", tmp_path / "t", "--to", "hf", tmp_path / "back", "-q")
    assert_bit_exact(original, load_hf_tensors(str(tmp_path / "back")))
    assert torch.equal(hf_logits(tmp_path / "back", tokens), expected)
    weights["lm_head.weight"][0, 0] += 1
    safetensors_torch.save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    result = trestle_convert.run_raw("convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "t2")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "'lm_head.weight' differs from 'model.embed_tokens.weight', which tie_word_embeddings makes the same" \
        in result.stderr, result.stderr

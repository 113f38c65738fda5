"""Gemma 4's text model (Gemma4ForCausalLM) through `trestle convert`, checked against transformers.

Two tiny random models of awkward sizes:
- dense: 5 layers (sliding, full, sliding, sliding, full), per-layer input embeddings 6 wide over a vocabulary of their
  own, the last 2 layers sharing earlier layers' keys and values with a double-wide MLP, the full-attention layers'
  keys as their values with heads 16 wide (the sliding ones' 8), final-logit soft-capping;
- MoE: 4 layers with the experts beside the MLP (5 experts of width 12, 2 per token), untied embeddings, per-layer
  KV heads from transformers' per_layer_config.
Each goes hf -> trestle -> hf bit-exactly at several tp / pp (/ ep) layouts (pp with uneven stages for the dense one, interleaved for the MoE one), every Megatron tensor holding what the
mapping says, with transformers' logits unchanged by the round trip; verify, reshard and diff work on them. torch_dist
and training, which cannot hold them, are refused naming why.
"""
import json
import os
import re
import shutil
import sys

import pytest
import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from models import assert_bit_exact, load_hf_tensors  # noqa: E402
from test_megatron_bridge import assembled, megatron_qkv, read_manifest  # noqa: E402

BASE = dict(vocab_size=301, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, sliding_window=4, rms_norm_eps=1e-6, max_position_embeddings=64)
DENSE = dict(BASE, num_hidden_layers=5, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                     "sliding_attention", "full_attention"],
             global_head_dim=16, attention_k_eq_v=True, num_global_key_value_heads=2, num_kv_shared_layers=2,
             use_double_wide_mlp=True, hidden_size_per_layer_input=6, vocab_size_per_layer_input=263,
             final_logit_softcapping=30.0)
MOE = dict(BASE, num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, global_head_dim=16,
           hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=5, top_k_experts=2,
           moe_intermediate_size=12, tie_word_embeddings=False)


def save_tiny_gemma4(directory, options, seed, qk_norm_scale=1.0):
    """A random Gemma 4 text model; its q / k norm weights times qk_norm_scale (a trained model's attention logits are
    softer than those of normed heads of weight 1 at softmax scale 1, whose near one-hot softmaxes have gradients of
    rounding noise that AdamW makes steps of)."""
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**options)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "experts" in name:  # norms and scales start at 1, experts at 0: moved
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(qk_norm_scale)
        for layer in model.model.layers:  # the layer scalars are buffers, saved
            layer.layer_scalar.fill_(1.0).add_(torch.randn(1) * 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    return {"dense": save_tiny_gemma4(root / "dense", DENSE, 3), "moe": save_tiny_gemma4(root / "moe", MOE, 4)}


def logits(directory):
    model = transformers.Gemma4ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([[2, 5, 17, 42, 7, 99, 3, 250, 11, 64, 1, 8]])
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def expected_megatron(hf, c, name):
    """What Trestle's tensor `name` holds, from the HF tensors, as the Gemma 4 mapping says."""
    model_level = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                   "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight",
                   "per_layer_embedding.weight": "model.embed_tokens_per_layer.weight",
                   "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                   "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
    if name in model_level:
        return hf[model_level[name]]
    i, rest = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name).groups()
    p = f"model.layers.{i}."
    if rest == "self_attention.linear_qkv.weight":
        q = hf[p + "self_attn.q_proj.weight"]
        k = hf[p + "self_attn.k_proj.weight"]
        d = hf[p + "self_attn.q_norm.weight"].shape[0]
        groups = k.shape[0] // d
        q, k = q.view(-1, d, q.shape[1]), k.view(-1, d, k.shape[1])
        if p + "self_attn.v_proj.weight" not in hf:  # keys as values: [queries; key] per group
            per = q.shape[0] // groups
            return torch.cat([torch.cat([q[g * per:(g + 1) * per], k[g:g + 1]]) for g in range(groups)]).reshape(
                -1, q.shape[2])
        v = hf[p + "self_attn.v_proj.weight"].view(-1, d, q.shape[2])
        return megatron_qkv(q, k, v, groups).reshape(-1, q.shape[2])
    fc1 = re.fullmatch(r"mlp\.(shared_experts\.)?linear_fc1\.weight", rest)
    if fc1:
        return torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    expert = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", rest)
    if expert:
        e, which = int(expert.group(1)), expert.group(2)
        return hf[p + ("experts.gate_up_proj" if which == "1" else "experts.down_proj")][e]
    moe = c.get("enable_moe_block", False)
    return hf[p + {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "self_attention.linear_proj.post_layernorm.weight": "post_attention_layernorm.weight",
        "post_self_attn_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_feedforward_layernorm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        "post_mlp_layernorm.weight": "post_feedforward_layernorm.weight",
        "pre_mlp_layernorm.weight": "pre_feedforward_layernorm_2.weight" if moe else "pre_feedforward_layernorm.weight",
        "pre_shared_expert_layernorm.weight": "pre_feedforward_layernorm.weight",
        "mlp.shared_experts.linear_fc2.weight": "mlp.down_proj.weight",
        "mlp.post_shared_expert_layernorm.weight": "post_feedforward_layernorm_1.weight",
        "mlp.router.weight": "router.proj.weight",
        "mlp.router.scale": "router.scale",
        "mlp.router.per_expert_scale": "router.per_expert_scale",
        "mlp.post_moe_layernorm.weight": "post_feedforward_layernorm_2.weight",
        "post_ffn_layernorm.weight": "post_feedforward_layernorm.weight",
        "per_layer_input_gate.weight": "per_layer_input_gate.weight",
        "per_layer_projection.weight": "per_layer_projection.weight",
        "post_per_layer_input_norm.weight": "post_per_layer_input_norm.weight",
        "layer_scalar": "layer_scalar"}[rest]]


def check_trestle_checkpoint(hf_dir, ckpt):
    """Every Megatron tensor, put together from its chunks, is what the mapping makes of the HF tensors, and every HF
    tensor feeds one."""
    hf = load_hf_tensors(hf_dir)
    c = json.load(open(hf_dir / "config.json"))
    iteration, manifest = read_manifest(ckpt)
    for name, entry in manifest["tensors"].items():
        expected = expected_megatron(hf, c, name)
        assert list(expected.shape) == entry["global_shape"], name
        whole, _ = assembled(iteration, entry)
        assert torch.equal(whole, expected.to(whole.dtype)), name
    return manifest


@pytest.mark.parametrize("kind,layout", [("dense", ("--tp", 1)), ("dense", ("--tp", 2)), ("dense", ("--pp", 2, "--first-stage-layers", 3)),
                                         ("moe", ("--tp", 2, "--ep", 5)), ("moe", ("--pp", 2, "--vpp", 2))])
def test_round_trip_bit_exact_with_logits(trestle_convert, models, tmp_path, kind, layout):
    hf_dir = models[kind]
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "trestle", ckpt, *layout, "-q")
    manifest = check_trestle_checkpoint(hf_dir, ckpt)
    names = set(manifest["tensors"])
    if kind == "dense":
        # The KV-sharing layers hold queries alone and a double-wide MLP; the full-attention layer 1 [queries; key].
        assert "decoder.layers.4.self_attention.linear_q_proj.weight" in names
        assert "decoder.layers.4.self_attention.linear_qkv.weight" not in names
        assert manifest["tensors"]["decoder.layers.4.mlp.linear_fc1.weight"]["global_shape"] == [160, 32]
        assert manifest["tensors"]["decoder.layers.1.self_attention.linear_qkv.weight"]["global_shape"] == [
            4 * 16 + 2 * 16, 32]
        assert "per_layer_embedding.weight" in names and "output_layer.weight" not in names
    else:
        assert "decoder.layers.3.mlp.router.scale" in names and "output_layer.weight" in names
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_bit_exact(load_hf_tensors(hf_dir), load_hf_tensors(back))
    assert json.load(open(back / "config.json")) == json.load(open(hf_dir / "config.json"))
    assert torch.equal(logits(back), logits(hf_dir))


def test_every_tensor_changes_the_logits(models, tmp_path):
    """The round trip's logits check sees the tensors only Gemma 4 has: scaling one of them changes the logits."""
    import safetensors.torch
    for kind, name in [("dense", "model.layers.1.layer_scalar"), ("dense", "model.embed_tokens_per_layer.weight"),
                       ("dense", "model.layers.1.self_attn.k_proj.weight"),
                       ("moe", "model.layers.2.router.scale"), ("moe", "model.layers.2.experts.down_proj")]:
        changed = tmp_path / f"{kind}_{name}"
        shutil.copytree(models[kind], changed)
        tensors = load_hf_tensors(changed)
        tensors[name] = tensors[name] * 1.5
        safetensors.torch.save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
        assert not torch.allclose(logits(changed), logits(models[kind])), name


def test_what_cannot_hold_it_is_refused(trestle_convert, models, tmp_path):
    """torch_dist (megatron-core has no Gemma 4 layers) is refused naming why; a tp that does not divide a layer's KV
    heads names the layer (training, and the layouts it refuses: test_train_families.py)."""
    result = trestle_convert.run_raw("convert", "--from", "hf", models["dense"], "--to", "megatron-dist",
                                     tmp_path / "dist")
    assert result.returncode != 0 and "cannot hold Gemma 4" in result.stderr, result.stderr
    assert not (tmp_path / "dist").exists()
    one_kv_head = save_tiny_gemma4(tmp_path / "kv1", dict(DENSE, num_global_key_value_heads=1), 5)
    result = trestle_convert.run_raw("convert", "--from", "hf", one_kv_head, "--to", "trestle", tmp_path / "out",
                                     "--tp", 2)
    assert result.returncode != 0 and "layer 1" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_inspect_verify_reshard_and_diff(trestle_convert, models, tmp_path):
    out = trestle_convert.run("inspect", models["dense"])
    assert "Gemma 4" in out, out
    assert ("1 head dim 16, 2 kv heads, keys as values; 2 head dim 8, 2 kv heads, keys and values, window; "
            "3 head dim 8, 2 kv heads, shared keys and values, window; 4 head dim 16, 2 kv heads, shared keys and "
            "values; per-layer inputs 6 wide") in out, out
    out = trestle_convert.run("inspect", models["moe"])
    assert "experts       5, top-2" in out, out
    ckpt, other = tmp_path / "ckpt", tmp_path / "pp2"
    trestle_convert.run("convert", "--from", "hf", models["dense"], "--to", "trestle", ckpt, "--tp", 2, "-q")
    out = trestle_convert.run("verify", ckpt, "--against", models["dense"])
    assert "ok:" in out and "decoder.layers.4.self_attention.linear_q_proj.weight" in out, out
    trestle_convert.run("reshard", ckpt, other, "--tp", 1, "--pp", 2, "--first-stage-layers", 2, "--quiet")
    check_trestle_checkpoint(models["dense"], other)
    out = trestle_convert.run("diff", ckpt, other)
    assert ", 0 not" in out, out


VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=4, position_embedding_size=64, pooling_kernel_size=2)
AUDIO = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
             output_proj_dims=16)


def save_tiny_gemma4_multimodal(directory, seed, qk_norm_scale=1.0, **text):
    """Gemma4ForConditionalGeneration of the dense text model (`text` changing it) with tiny vision and audio towers;
    its q / k norm weights times qk_norm_scale (save_tiny_gemma4's)."""
    torch.manual_seed(seed)
    text = {**DENSE, "vocab_size_per_layer_input": 301, **text}
    config = transformers.Gemma4Config(text_config=text, vision_config=VISION, audio_config=AUDIO)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            if "language_model." in name and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(qk_norm_scale)
    model.save_pretrained(directory)
    return directory


def test_the_multimodal_model_carries_its_towers(trestle_convert, tmp_path):
    """Gemma4ForConditionalGeneration: the language model (model.language_model.*) maps as Gemma 4's text model; its
    vision and audio towers and their embedders (model.{vision,audio}_tower.*, model.embed_{vision,audio}.*) travel
    as the checkpoint holds them (0-dim clipping bounds included), under the names without "model.", whole on the
    first stage; back bit-exactly from tp 2 x pp 2, with transformers' logits unchanged; training from its config.json
    alone is refused (it does not size the towers; its text trains from a checkpoint, in full and with LoRA:
    test_train_families.py, test_lora_train.py); verify compares it."""
    hf_dir = save_tiny_gemma4_multimodal(tmp_path / "hf", 6)
    hf = load_hf_tensors(hf_dir)
    towers = {n for n in hf if n.startswith(("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                                             "model.embed_audio."))}
    assert towers and any("audio_tower" in n for n in towers) and any("vision_tower" in n for n in towers)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "trestle", ckpt, "--tp", 2, "--pp", 2,
                        "--first-stage-layers", 3, "-q")
    iteration, manifest = read_manifest(ckpt)
    carried = {n for n in manifest["tensors"] if not n.startswith(("embedding.", "decoder.", "per_layer_"))}
    assert carried == {n[len("model."):] for n in towers}
    for name in carried:
        whole, placed = assembled(iteration, manifest["tensors"][name])
        assert all(rank // 2 == 0 and chunk["shape"] == manifest["tensors"][name]["global_shape"]
                   for rank, chunk in placed), name
        assert torch.equal(whole, hf["model." + name]), name
    assert torch.equal(assembled(iteration, manifest["tensors"]["decoder.layers.4.self_attention.linear_q_proj.weight"])[0],
                       hf["model.language_model.layers.4.self_attn.q_proj.weight"])
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_bit_exact(hf, load_hf_tensors(back))
    assert json.load(open(back / "config.json")) == json.load(open(hf_dir / "config.json"))
    ids = torch.tensor([[2, 5, 17, 42, 7, 99, 3, 250, 11, 64, 1, 8]])

    def text_logits(directory):
        m = transformers.Gemma4ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            return m(input_ids=ids, use_cache=False).logits

    assert torch.equal(text_logits(back), text_logits(hf_dir))
    out = trestle_convert.run("verify", ckpt, "--against", hf_dir)
    assert "ok:" in out and "audio_tower." in out, out
    result = trestle_convert.run_raw("train", "--model-config", hf_dir / "config.json", "--data-path", "unused",
                                     "--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "1",
                                     "--seq-length", "8", "--lr", "1e-3")
    assert result.returncode != 0 and "config.json does not size them" in result.stderr, result.stderr[-2000:]


def test_sliding_window_pattern_is_not_read_as_transformers_does_not(trestle_convert, tmp_path):
    """Without layer_types, transformers' Gemma4TextConfig puts the window on 5 layers of 6 (the last one full) and
    ignores sliding_window_pattern; Trestle read the key (as Gemma 3's) and trained other layers windowed (iteration 1's
    loss 6.24161 against transformers' 6.23655)."""
    torch.manual_seed(3)
    config = transformers.Gemma4TextConfig(vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=8, global_head_dim=8, intermediate_size=40,
                                           sliding_window=8, hidden_size_per_layer_input=0,
                                           layer_types=["sliding_attention"] * 3 + ["full_attention"])
    hf = tmp_path / "hf"
    transformers.Gemma4ForCausalLM(config).save_pretrained(hf)
    written = json.load(open(hf / "config.json"))
    written.pop("layer_types")
    written.pop("per_layer_config", None)
    written["global_head_dim"] = 8
    written["sliding_window_pattern"] = 2
    json.dump(written, open(hf / "config.json", "w"))
    expected = [int(t == "sliding_attention") for t in transformers.AutoConfig.from_pretrained(hf).layer_types]
    assert expected == [1, 1, 1, 0]
    trestle_convert.run("convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "ckpt", "-q")
    _, manifest = read_manifest(tmp_path / "ckpt")
    assert manifest["model"]["megatron"]["window_attn_skip_freq"] == expected, manifest["model"]["megatron"]

"""Hugging Face <-> Megatron bridge against `transformers`: tiny random models of every supported architecture are
saved with save_pretrained, converted to Trestle checkpoints in several TP/PP/VPP/EP layouts and back, and checked

- bit-exactly (every tensor, dtype and shape) and by `transformers` logits on the converted-back directory;
- on the Megatron side: each rank file's raw chunks are read with a small reader of the manifest and compared with
  what Megatron-Core's rank holds, computed here in torch from the Hugging Face weights (per-group QKV order, [gate_r;
  up_r], padded vocab split, row/column splits, pipeline stage of each layer, expert-parallel placement);
- for the errors a user meets: unsupported architectures and options, and tensors the mapping does not consume.
"""
import json
import os
import re
import zlib

import pytest
import safetensors.torch as safetensors_torch
import torch
import transformers

from models import hf_logits, load_hf_tensors, save_tiny_model

TOKENS = torch.tensor([[1, 5, 17, 42, 7, 99, 3, 11]])

# name -> (config class, config kwargs, dtype, save_original_format)
MODELS = {
    # 3 KV groups of 2 heads, vocab not a multiple of 128, 6 layers for pp 3 and vpp 2.
    "llama": ("LlamaConfig", dict(vocab_size=1000, hidden_size=48, intermediate_size=80, num_hidden_layers=6,
                                  num_attention_heads=6, num_key_value_heads=2, head_dim=8), torch.bfloat16, True),
    # Llama 3.1 rope scaling, 3 KV groups.
    "llama31": ("LlamaConfig", dict(vocab_size=517, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
                                    num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                    max_position_embeddings=512), torch.float32, True),
    # Llama 3.2: tied embeddings, a single KV head.
    "llama32_tied": ("LlamaConfig", dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
                     torch.bfloat16, True),
    "mistral": ("MistralConfig", dict(vocab_size=777, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, sliding_window=None),
                torch.bfloat16, True),
    # A sliding window shorter than TOKENS, so losing it on the way changes the logits.
    "mistral_window": ("MistralConfig", dict(vocab_size=401, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=4),
                       torch.float32, True),
    "qwen2": ("Qwen2Config", dict(vocab_size=515, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2), torch.float32, True),
    # head_dim × heads (64) differs from hidden (48); q/k norms.
    "qwen3": ("Qwen3Config", dict(vocab_size=333, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16), torch.bfloat16, True),
    "mixtral": ("MixtralConfig", dict(vocab_size=300, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2), torch.bfloat16, True),
    # transformers 5's fused expert layout (gate_up_proj / down_proj).
    "mixtral_fused": ("MixtralConfig", dict(vocab_size=300, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2), torch.bfloat16, False),
    # Phi-3: fused qkv_proj [q; k; v] and gate_up_proj [gate; up]; 3 KV groups, odd vocab.
    "phi3": ("Phi3Config", dict(vocab_size=311, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
                                num_attention_heads=6, num_key_value_heads=3, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2, sliding_window=None), torch.bfloat16, True),
    # Gemma 2: GeGLU, (1 + w) norms before and after attention and MLP, soft-capping, alternating sliding window,
    # head_dim (16) x heads differing from hidden, tied embeddings.
    "gemma2": ("Gemma2Config", dict(vocab_size=301, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                    query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                    pad_token_id=0), torch.bfloat16, True),
    # Gemma 3 (text): q/k norms, five local layers to one global, one KV head.
    "gemma3": ("Gemma3TextConfig", dict(vocab_size=299, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=4,
                                        pad_token_id=0), torch.float32, True),
    # OLMo 2: norms after attention and the MLP only, q/k norms over the whole projection (GQA: k's is narrower).
    "olmo2": ("Olmo2Config", dict(vocab_size=305, hidden_size=48, intermediate_size=72, num_hidden_layers=4,
                                  num_attention_heads=6, num_key_value_heads=2), torch.bfloat16, True),
    # Qwen2-MoE: QKV bias, experts plus a shared expert with its sigmoid gate.
    "qwen2_moe": ("Qwen2MoeConfig", dict(vocab_size=263, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                         decoder_sparse_step=1, mlp_only_layers=[]), torch.float32, True),
    "qwen3_moe": ("Qwen3MoeConfig", dict(vocab_size=259, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         num_experts=4, num_experts_per_tok=2), torch.float32, True),
}

# (model, tp, pp, vpp, ep, extra convert args); the first layout of each model also checks logits.
LAYOUTS = [
    ("llama", 1, 1, 1, 1, []),
    ("llama", 2, 3, 1, 1, []),
    ("llama", 2, 3, 2, 1, []),
    ("llama", 1, 2, 1, 1, ["--first-stage-layers", "2", "--last-stage-layers", "4"]),
    ("llama", 2, 2, 1, 1, ["--norms", "local", "--codec", "raw"]),
    ("llama31", 3, 2, 1, 1, []),
    ("llama32_tied", 1, 2, 1, 1, []),
    ("mistral", 4, 1, 1, 1, []),
    ("mistral", 2, 2, 1, 1, []),
    ("mistral_window", 2, 1, 1, 1, []),
    ("qwen2", 2, 1, 1, 1, []),
    ("qwen3", 2, 2, 1, 1, []),
    ("mixtral", 2, 1, 1, 2, []),
    ("mixtral", 1, 2, 1, 4, []),
    ("mixtral_fused", 2, 1, 1, 2, []),
    ("phi3", 1, 1, 1, 1, []),
    ("phi3", 3, 2, 1, 1, []),
    ("gemma2", 1, 1, 1, 1, []),
    ("gemma2", 2, 2, 1, 1, ["--norms", "local"]),
    ("gemma3", 1, 3, 1, 1, []),
    ("olmo2", 1, 1, 1, 1, []),
    ("olmo2", 2, 2, 1, 1, ["--norms", "local"]),
    ("olmo2", 2, 1, 1, 1, []),
    ("qwen2_moe", 2, 2, 1, 2, []),
    ("qwen2_moe", 1, 1, 1, 4, []),
    ("qwen3_moe", 1, 2, 1, 4, []),
    ("qwen3_moe", 2, 1, 1, 2, []),
]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    for name, (config_class, config, dtype, original) in MODELS.items():
        save_tiny_model(str(root / name), config_class, config, seed=zlib.crc32(name.encode()), dtype=dtype,
                        tokenizer_config={"model_max_length": 128}, save_original_format=original)
    return {name: str(root / name) for name in MODELS}


# --- a small reader of Trestle checkpoints: manifest + raw chunks ---------------------------------------------

TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64}


def read_manifest(root):
    latest = open(os.path.join(root, "latest_checkpointed_iteration.txt")).read().strip()
    iteration_dir = os.path.join(root, f"iter_{int(latest):07d}")
    with open(os.path.join(iteration_dir, "manifest.json")) as f:
        return iteration_dir, json.load(f)


def read_chunk(iteration_dir, dtype, chunk):
    assert chunk["codec"] == "raw"
    with open(os.path.join(iteration_dir, chunk["file"]), "rb") as f:
        f.seek(chunk["byte_offset"])
        data = bytearray(f.read(chunk["stored_bytes"]))
    return torch.frombuffer(data, dtype=TORCH_DTYPES[dtype]).reshape(chunk["shape"])


def assembled(iteration_dir, entry):
    """A Trestle manifest entry's global tensor put together from its chunks, checking that each element is written
    exactly once; returns it and [(rank, chunk)], the rank of the rank_<r>.bin file each chunk is in."""
    whole = torch.zeros(entry["global_shape"], dtype=TORCH_DTYPES[entry["dtype"]])
    count = torch.zeros(entry["global_shape"], dtype=torch.int32)
    placed = []
    for chunk in entry["chunks"]:
        placed.append((int(re.fullmatch(r"rank_(\d+)\.bin", chunk["file"]).group(1)), chunk))
        box = tuple(slice(o, o + s) for o, s in zip(chunk["offset"], chunk["shape"], strict=True))
        whole[box] = read_chunk(iteration_dir, entry["dtype"], chunk)
        count[box] += 1
    assert torch.all(count == 1), f"{entry}: elements not written exactly once"
    return whole, placed


# --- what Megatron-Core's ranks hold, computed independently from the HF weights ---------------------------------

def megatron_qkv(q, k, v, groups):
    """Megatron's fused QKV: per group, its query heads, then its key head, then its value head."""
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, *rest), k.reshape(groups, -1, *rest), v.reshape(groups, -1, *rest)],
                     dim=1).reshape(-1, *rest)


def stage_of(layer, layers, pp, vpp, first, last):
    if first or last:
        counts = [0] * pp
        rest, middle = layers, pp
        if first:
            counts[0], rest, middle = first, rest - first, middle - 1
        if last:
            counts[-1], rest, middle = last, rest - last, middle - 1
        counts = [c or rest // middle for c in counts]
        bounds = [sum(counts[:s + 1]) for s in range(pp)]
        return next(s for s in range(pp) if layer < bounds[s])
    per_chunk = layers // (pp * vpp)
    return (layer // per_chunk) % pp


class MegatronReference:
    """The tensor a Megatron-Core rank holds for a canonical name: its TP split kind, and the local tensor."""

    def __init__(self, hf, config, tp, norms):
        self.hf, self.config, self.tp = hf, config, tp
        self.groups = config["num_key_value_heads"]
        self.vocab = config["vocab_size"]
        self.padded = -(-self.vocab // (128 * tp)) * 128 * tp
        self.norms = norms

    def hf_name_and_kind(self, name):
        """(kind, function of tp_rank giving the local tensor)."""
        hf, tp = self.hf, self.tp
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            w = hf["model.embed_tokens.weight" if name.startswith("embedding") else "lm_head.weight"]
            padded = torch.nn.functional.pad(w, (0, 0, 0, self.padded - self.vocab))
            return "vocab", lambda r: padded.chunk(tp)[r]
        if name == "decoder.final_layernorm.weight":
            return "replicated", lambda r: hf["model.norm.weight"]
        i, rest = m.group(1), m.group(2)
        p = f"model.layers.{i}."
        te = self.norms == "te"
        moe = any(k.startswith(p + "mlp.experts") or k.startswith(p + "block_sparse_moe") for k in hf)
        gemma = p + "pre_feedforward_layernorm.weight" in hf  # norms before and after attention and MLP
        norm_names = {
            ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"): "input_layernorm.weight",
            ("mlp.linear_fc1.layer_norm_weight" if te and not moe else "pre_mlp_layernorm.weight"):
                "pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight",
            "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
            "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
            "self_attention.linear_proj.post_layernorm.weight": "post_attention_layernorm.weight",
            "mlp.linear_fc2.post_layernorm.weight": "post_feedforward_layernorm.weight",
        }
        if rest in norm_names:
            return "replicated", lambda r: hf[p + norm_names[rest]]
        a = p + "self_attn."
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            if a + "qkv_proj.weight" in hf:  # Phi-3: [q; k; v] in one tensor
                kv = self.groups * self.config["hidden_size"] // self.config["num_attention_heads"]
                q, k, v = hf[a + "qkv_proj." + kind].split([self.config["hidden_size"], kv, kv])
            else:
                q, k, v = hf[a + "q_proj." + kind], hf[a + "k_proj." + kind], hf[a + "v_proj." + kind]
            fused = megatron_qkv(q, k, v, self.groups)
            return "column", lambda r: fused.chunk(tp)[r]
        if rest == "self_attention.linear_proj.weight":
            return "row", lambda r: hf[a + "o_proj.weight"].chunk(tp, dim=1)[r]
        if rest == "mlp.linear_fc1.weight":
            if p + "mlp.gate_up_proj.weight" in hf:  # Phi-3: [gate; up] in one tensor
                gate, up = hf[p + "mlp.gate_up_proj.weight"].chunk(2)
            else:
                gate, up = hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]
            return "gated", lambda r: torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        if rest == "mlp.linear_fc2.weight":
            return "row", lambda r: hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[r]
        shared = {"mlp.shared_experts.linear_fc1.weight": None, "mlp.shared_experts.linear_fc2.weight": "down_proj",
                  "mlp.shared_experts.gate_weight": None}
        if rest in shared:  # Qwen2-MoE's shared expert and its gate
            x = p + "mlp.shared_expert."
            if rest.endswith("gate_weight"):
                return "replicated", lambda r: hf[p + "mlp.shared_expert_gate.weight"]
            if rest.endswith("linear_fc1.weight"):
                gate, up = hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]
                return "gated", lambda r: torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
            return "row", lambda r: hf[x + "down_proj.weight"].chunk(tp, dim=1)[r]
        if rest == "mlp.router.weight":
            key = p + "block_sparse_moe.gate.weight"
            return "replicated", lambda r: hf[key if key in hf else p + "mlp.gate.weight"]
        e_match = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight", rest)
        assert e_match, f"unexpected Megatron tensor {name}"
        e, fc = int(e_match.group(1)), e_match.group(2)
        if p + "mlp.experts.gate_up_proj" in hf:  # fused HF layout: gate rows first
            gate_up = hf[p + "mlp.experts.gate_up_proj"][e]
            gate, up = gate_up.chunk(2)
            down = hf[p + "mlp.experts.down_proj"][e]
        elif p + "block_sparse_moe.experts.0.w1.weight" in hf:
            x = p + f"block_sparse_moe.experts.{e}."
            gate, up, down = hf[x + "w1.weight"], hf[x + "w3.weight"], hf[x + "w2.weight"]
        else:
            x = p + f"mlp.experts.{e}."
            gate, up, down = hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"], hf[x + "down_proj.weight"]
        if fc == "1":
            return "gated", lambda r: torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
        return "row", lambda r: down.chunk(tp, dim=1)[r]


def check_megatron_layout(hf_dir, ckpt, tp, pp, vpp, ep, first=0, last=0, norms="te"):
    """Every chunk sits in the file of a rank that holds it in Megatron-Core, and holds exactly that rank's data."""
    hf = load_hf_tensors(hf_dir)
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    iteration_dir, manifest = read_manifest(ckpt)
    assert manifest["layout"] == {"tp": tp, "pp": pp, "vpp": vpp, "dp": ep, "ep": ep, "cp": 1}
    assert manifest["world_size"] == tp * pp * ep
    layers = config["num_hidden_layers"]
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    reference = MegatronReference(hf, config, tp, norms)
    for name, entry in manifest["tensors"].items():
        kind, local = reference.hf_name_and_kind(name)
        layer = re.match(r"decoder\.layers\.(\d+)\.", name)
        expert = re.search(r"local_experts\.(\d+)\.", name)
        if layer:
            stage = stage_of(int(layer.group(1)), layers, pp, vpp, first, last)
        else:
            stage = 0 if name.startswith("embedding") else pp - 1
        by_tp_rank = {}
        for chunk in entry["chunks"]:
            rank = int(re.fullmatch(r"rank_(\d+)\.bin", chunk["file"]).group(1))
            tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % ep, rank // (tp * ep)
            assert pp_rank == stage, f"{name} stored by pipeline rank {pp_rank}, Megatron puts it on stage {stage}"
            if expert:
                ep_rank = int(expert.group(1)) // (experts // ep)
                assert dp_rank % ep == ep_rank, f"{name} stored by EP rank {dp_rank % ep}, expected {ep_rank}"
            data = read_chunk(iteration_dir, entry["dtype"], chunk)
            by_tp_rank.setdefault(tp_rank, []).append((chunk["offset"], data))
        if kind == "replicated":
            assert sum(len(v) for v in by_tp_rank.values()) == 1, f"{name}: a replicated tensor is written once"
            (offset, data), = next(iter(by_tp_rank.values()))
            assert torch.equal(data, local(0)), name
            continue
        assert sorted(by_tp_rank) == [r for r in range(tp) if kind != "vocab" or r * reference.padded // tp < reference.vocab]
        for r, pieces in by_tp_rank.items():
            pieces.sort(key=lambda p: p[0])
            expected = local(r)
            if kind == "row":
                assert [p[0] for p in pieces] == [[0, r * expected.shape[1]]], name
                assert torch.equal(pieces[0][1], expected), f"{name} TP rank {r}"
            elif kind == "gated":  # two boxes: gate rows of rank r, up rows of rank r
                half = entry["global_shape"][0] // 2
                assert [p[0][0] for p in pieces] == [r * half // tp, half + r * half // tp], name
                assert torch.equal(torch.cat([p[1] for p in pieces]), expected), f"{name} TP rank {r}: not [gate_r; up_r]"
            else:  # column and vocab: one box of dim-0 rows; vocab padding rows are not stored
                assert len(pieces) == 1 and pieces[0][0][0] == r * expected.shape[0], name
                data = pieces[0][1]
                assert torch.equal(data, expected[: data.shape[0]]), f"{name} TP rank {r}"
                if kind == "vocab":
                    assert torch.count_nonzero(expected[data.shape[0]:]) == 0


def assert_same_tensors(a_dir, b_dir):
    a, b = load_hf_tensors(a_dir), load_hf_tensors(b_dir)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8) if a[name].dtype == torch.bfloat16 else a[name],
                           b[name].view(torch.uint8) if b[name].dtype == torch.bfloat16 else b[name]), name


@pytest.mark.parametrize("model,tp,pp,vpp,ep,extra", LAYOUTS,
                         ids=[f"{m}-tp{t}-pp{p}-vpp{v}-ep{e}{'-' + '-'.join(x).replace('--', '') if x else ''}"
                              for m, t, p, v, e, x in LAYOUTS])
def test_round_trip_and_megatron_layout(trestle_convert, hf_models, tmp_path, model, tp, pp, vpp, ep, extra):
    src = hf_models[model]
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    args = ["convert", "--from", "hf", src, "--to", "trestle", ckpt, "--tp", tp, "--pp", pp, "--vpp", vpp, "--ep", ep,
            "--quiet", *extra]
    out = trestle_convert.run(*args)
    assert "peak RSS" in out
    first = int(extra[extra.index("--first-stage-layers") + 1]) if "--first-stage-layers" in extra else 0
    last = int(extra[extra.index("--last-stage-layers") + 1]) if "--last-stage-layers" in extra else 0
    norms = extra[extra.index("--norms") + 1] if "--norms" in extra else "te"
    check_megatron_layout(src, ckpt, tp, pp, vpp, ep, first, last, norms)

    verified = trestle_convert.run("verify", "--against", src, ckpt)
    assert "max abs diff 0, 0 above tolerance" in verified

    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "--quiet")
    assert_same_tensors(src, back)
    assert json.load(open(os.path.join(back, "config.json"))) == json.load(open(os.path.join(src, "config.json")))
    for side in ("generation_config.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(src, side)):
            assert open(os.path.join(back, side)).read() == open(os.path.join(src, side)).read()
    if LAYOUTS.index((model, tp, pp, vpp, ep, extra)) == next(i for i, l in enumerate(LAYOUTS) if l[0] == model):
        assert torch.equal(hf_logits(back, TOKENS), hf_logits(src, TOKENS)), \
            f"{model}: logits differ after the round trip"


def test_expert_layout_is_converted_on_request(trestle_convert, hf_models, tmp_path):
    """A fused-layout source exports fused by default and per-expert on request (equal to the original save)."""
    ckpt = str(tmp_path / "ckpt")
    trestle_convert.run("convert", "--from", "hf", hf_models["mixtral_fused"], "--to", "trestle", ckpt, "--ep", "2", "-q")
    fused, original = str(tmp_path / "fused"), str(tmp_path / "original")
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", original, "--hf-expert-layout", "original", "-q")
    names = load_hf_tensors(original)
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    assert torch.equal(hf_logits(original, TOKENS), hf_logits(hf_models["mixtral_fused"], TOKENS))
    # And a per-expert source verifies against the fused export of the same weights.
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", fused, "-q")
    assert "gate_up_proj" in " ".join(load_hf_tensors(fused))
    ckpt2 = str(tmp_path / "ckpt2")
    trestle_convert.run("convert", "--from", "hf", original, "--to", "trestle", ckpt2, "--tp", "2", "-q")
    assert "0 above tolerance" in trestle_convert.run("verify", "--against", fused, ckpt2)


def test_dtype_cast_and_dry_run(trestle_convert, hf_models, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    plan = trestle_convert.run("convert", "--from", "hf", hf_models["qwen2"], "--to", "trestle", ckpt, "--tp", "2",
                               "--dry-run")
    assert "memory" in plan and "rank 1" in plan and not os.path.exists(ckpt)
    trestle_convert.run("convert", "--from", "hf", hf_models["qwen2"], "--to", "trestle", ckpt, "--tp", "2", "--dtype",
                        "bf16", "-q")
    _, manifest = read_manifest(ckpt)
    assert {t["dtype"] for t in manifest["tensors"].values()} == {"bf16"}
    back = str(tmp_path / "back")
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    src = load_hf_tensors(hf_models["qwen2"])
    for name, t in load_hf_tensors(back).items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, src[name].to(torch.bfloat16)), name
    assert json.load(open(os.path.join(back, "config.json")))["dtype"] == "bfloat16"
    # Against the float32 source the cast shows as a small, non-zero difference.
    result = trestle_convert.run_raw("verify", "--against", hf_models["qwen2"], ckpt)
    assert result.returncode == 1 and "above tolerance" in result.stdout
    assert trestle_convert.run_raw("verify", "--against", hf_models["qwen2"], ckpt, "--tolerance", "0.01").returncode == 0


def rewrite_config(src, dst, **changes):
    os.makedirs(dst)
    for f in os.listdir(src):
        os.link(os.path.join(src, f), os.path.join(dst, f)) if f != "config.json" else None
    config = json.load(open(os.path.join(src, "config.json")))
    config.update(changes)
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    return dst


def rewrite_tensors(src, dst, tensors):
    """A copy of `src` (its config and side files linked) whose weights are `tensors`, in one model.safetensors."""
    rewrite_config(src, dst)
    for f in os.listdir(dst):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(dst, f))  # (hard links to the source's)
    safetensors_torch.save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_unsupported_models_fail_clearly(trestle_convert, hf_models, tmp_path):
    def convert_error(src, *extra):
        result = trestle_convert.run_raw("convert", "--from", "hf", src, "--to", "trestle", str(tmp_path / "out"), *extra)
        assert result.returncode != 0
        return result.stderr

    unknown = rewrite_config(hf_models["llama"], str(tmp_path / "unknown"), architectures=["GPT2LMHeadModel"])
    message = convert_error(unknown)
    assert "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message and "Qwen3MoeForCausalLM" in message
    # (the window in the second layer only; in every layer or none it converts: test_model_transformers)
    window = rewrite_config(hf_models["qwen2"], str(tmp_path / "window"), use_sliding_window=True, sliding_window=4,
                            layer_types=["full_attention", "sliding_attention"])
    assert "the sliding window in 1 of 2 layers" in convert_error(window)
    assert "query groups" in convert_error(hf_models["llama32_tied"], "--tp", "2")
    assert "experts" in convert_error(hf_models["mixtral"], "--ep", "3")
    longrope = rewrite_config(hf_models["phi3"], str(tmp_path / "longrope"),
                              rope_scaling={"type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    assert "rope type 'longrope'" in convert_error(longrope)
    # Partial rotary, wherever transformers reads it from: rope_parameters (transformers 5's files), else the top level
    # (older files, Phi-4-mini's); a top-level factor beside rope_parameters' own is not what transformers uses.
    rope = json.load(open(os.path.join(hf_models["phi3"], "config.json")))["rope_parameters"]
    rope = {k: v for k, v in rope.items() if k != "partial_rotary_factor"}
    for name, changes in [("partial", dict(rope_parameters=dict(rope, partial_rotary_factor=0.75))),
                          ("partial_top", dict(rope_parameters=rope, partial_rotary_factor=0.75))]:
        partial = rewrite_config(hf_models["phi3"], str(tmp_path / name), **changes)
        assert transformers.AutoConfig.from_pretrained(partial).rope_parameters["partial_rotary_factor"] == 0.75
        assert "partial_rotary_factor 0.75" in convert_error(partial)
    assert not os.path.exists(tmp_path / "out")


def test_leftover_tensors_fail_the_conversion(trestle_convert, hf_models, tmp_path):
    src = str(tmp_path / "extra")
    os.makedirs(src)
    tensors = load_hf_tensors(hf_models["qwen3"])
    tensors["model.layers.1.mlp.mystery.weight"] = torch.zeros(3)
    del tensors["model.layers.0.self_attn.k_norm.weight"]
    safetensors_torch.save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    os.link(os.path.join(hf_models["qwen3"], "config.json"), os.path.join(src, "config.json"))
    result = trestle_convert.run_raw("convert", "--from", "hf", src, "--to", "trestle", str(tmp_path / "out"))
    assert result.returncode != 0
    assert "not consumed by the mapping: model.layers.1.mlp.mystery.weight" in result.stderr
    assert "missing: model.layers.0.self_attn.k_norm.weight" in result.stderr


def test_zstd_chunks_round_trip(trestle_convert, hf_models, tmp_path):
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    trestle_convert.run("convert", "--from", "hf", hf_models["qwen3_moe"], "--to", "trestle", ckpt, "--tp", "2", "--pp",
                        "2", "--ep", "2", "--codec", "zstd", "-q")
    _, manifest = read_manifest(ckpt)
    assert {c["codec"] for t in manifest["tensors"].values() for c in t["chunks"]} == {"zstd"}
    assert "0 above tolerance" in trestle_convert.run("verify", "--against", hf_models["qwen3_moe"], ckpt)
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_same_tensors(hf_models["qwen3_moe"], back)


def test_leftover_checkpoint_tensors_fail_the_export(trestle_convert, hf_models, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    trestle_convert.run("convert", "--from", "hf", hf_models["llama32_tied"], "--to", "trestle", ckpt, "-q")
    iteration_dir, manifest = read_manifest(ckpt)
    # A tensor the mapping does not know (same chunks under another name) and one it needs, gone.
    manifest["tensors"]["decoder.layers.0.mystery.weight"] = manifest["tensors"]["decoder.final_layernorm.weight"]
    del manifest["tensors"]["decoder.layers.3.mlp.linear_fc2.weight"]
    del manifest["manifest_xxh3_64"]  # edited: its checksum no longer holds
    with open(os.path.join(iteration_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    result = trestle_convert.run_raw("convert", "--from", "trestle", ckpt, "--to", "hf", str(tmp_path / "back"))
    assert result.returncode != 0
    assert "not consumed by the mapping: decoder.layers.0.mystery.weight" in result.stderr
    assert "missing: decoder.layers.3.mlp.linear_fc2.weight" in result.stderr
    assert not os.path.exists(tmp_path / "back")


FAMILIES = {"llama": "Llama", "llama31": "Llama", "llama32_tied": "Llama", "mistral": "Mistral",
            "mistral_window": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "mixtral": "Mixtral (MoE)",
            "mixtral_fused": "Mixtral (MoE)", "phi3": "Phi-3", "gemma2": "Gemma 2", "gemma3": "Gemma 3",
            "qwen2_moe": "Qwen2-MoE", "qwen3_moe": "Qwen3-MoE", "olmo2": "OLMo 2"}


def test_inspect_names_the_family_and_what_the_bridge_does(trestle_convert, hf_models, tmp_path):
    assert sorted(FAMILIES) == sorted(MODELS)
    for name, family in FAMILIES.items():
        info = json.loads(trestle_convert.run("inspect", hf_models[name], "--json"))
        bridge = info["config"]["bridge"]
        assert bridge["convertible"] and bridge["family"] == family, (name, bridge)
        ckpt = str(tmp_path / name)
        trestle_convert.run("convert", "--from", "hf", hf_models[name], "--to", "trestle", ckpt, "-q")
        assert bridge["megatron_tensors"] == len(read_manifest(ckpt)[1]["tensors"]), name
    window = rewrite_config(hf_models["qwen2"], str(tmp_path / "window"), use_sliding_window=True, sliding_window=4,
                            layer_types=["full_attention", "sliding_attention"])
    info = json.loads(trestle_convert.run("inspect", window, "--json"))
    assert not info["config"]["bridge"]["convertible"]
    assert "use_sliding_window" in info["config"]["bridge"]["reason"]
    assert "bridge        not convertible" in trestle_convert.run("inspect", window)

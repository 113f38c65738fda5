"""Trestle's model (train/model) against `transformers`: tiny random Hugging Face models of each dense architecture
(Gemma 2 / 3 and OLMo 2 with their own norms, soft-caps, windows and RoPE bases among them) and of the
mixture-of-experts ones (Mixtral, Qwen3-MoE, Qwen2-MoE with its gated shared expert, GPT-OSS, DeepSeek-V3 / V2-Lite,
GLM-4.5 with its partial rotary) are saved with save_pretrained, converted with `trestle convert --from hf --to trestle
--tp N`, and run by one model_worker process per rank (Gloo on localhost). Checked:

- logits (fp32; the fused norm, gated-unit and soft-cap kernels, as the trainer runs) equal transformers' within 1e-4
  at tp 1, 2 (with and without sequence parallelism) and 4 (with it), and for the
  MoE models also at ep 2 (tp 1, and tp 2 with sequence parallelism) and ep 4 with recompute, each expert-parallel rank
  taking its share of the batch and sending its tokens to their experts' ranks by all-to-all;
- the vocabulary-parallel cross-entropy equals torch.nn.functional.cross_entropy on transformers' logits;
- the gradients of one backward at tp 2 (with and without sequence parallelism, and with full recompute) and tp 4
  equal those at tp 1 within 1e-5 relative, once the pieces are placed back into the canonical tensors (under
  expert parallelism the dense gradients summed over the data-parallel ranks, the experts' as they are);
- (a model loading a checkpoint saved at another layout: the trainer's resume tests.)
"""
import json
import os
import subprocess
import zlib

import numpy as np
import pytest
import torch
import transformers
from ci_scope import FULL

BATCH, SEQ = 4, 16

# name -> (config class, config kwargs, tensor-parallel sizes its query groups allow)
MODELS = {
    # Llama 3.1 rope scaling (an original context shorter than the positions used), untied, padded vocab.
    "llama31": ("LlamaConfig", dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                                    rope_theta=500000.0, max_position_embeddings=256, tie_word_embeddings=False),
                (1, 2, 4)),
    # Llama 3.2 style: tied embeddings and a single KV head (MQA), so tp 1 only; linear rope scaling; a sliding_window
    # key, which transformers' Llama never applies (neither does Trestle).
    "llama_mqa_tied": ("LlamaConfig", dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                                           rope_scaling={"rope_type": "linear", "factor": 2.0}, sliding_window=5),
                       (1,)),
    # A sliding window shorter than the sequence; attention_bias and mlp_bias, which transformers' Mistral never builds.
    "mistral_window": ("MistralConfig", dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=8, num_key_value_heads=4, sliding_window=5,
                                             tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
                       (1, 2, 4)),
    # Qwen2's use_sliding_window with the window in every layer (max_window_layers 0): Megatron's window_size.
    "qwen2_window": ("Qwen2Config", dict(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                         sliding_window=5, max_window_layers=0), (1, 2)),
    # QKV bias, tied embeddings.
    "qwen2": ("Qwen2Config", dict(vocab_size=515, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
              (1, 2, 4)),
    # Phi-3: fused qkv_proj and gate_up_proj in Hugging Face; the same model as Llama on the Megatron side.
    "phi3": ("Phi3Config", dict(vocab_size=311, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=8, num_key_value_heads=4, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2, sliding_window=None, tie_word_embeddings=False), (1, 2, 4)),
    # q/k norms, head_dim × heads (128) differs from hidden (48), untied.
    "qwen3": ("Qwen3Config", dict(vocab_size=333, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                  tie_word_embeddings=False), (1, 2, 4)),
    # Mixtral: top-2 of 4 experts, weights renormalised over the chosen ones (Megatron's softmax after the top-k).
    "mixtral": ("MixtralConfig", dict(vocab_size=500, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
                                      num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False),
                (1, 2)),
    # Qwen3-MoE without renormalisation (Megatron's pre-softmax top-k), q/k norms.
    "qwen3_moe": ("Qwen3MoeConfig", dict(vocab_size=400, hidden_size=48, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
                  (1, 2)),
    # Qwen2-MoE: a shared expert scaled by a sigmoid gate beside top-2 of 4 experts.
    "qwen2_moe": ("Qwen2MoeConfig", dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=40, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                                         mlp_only_layers=[], tie_word_embeddings=False), (1, 2)),
    # Gemma 2: GeGLU, (1 + w) norms before and after attention and the MLP, soft-capped attention scores and logits
    # (caps small enough to bite), query_pre_attn_scalar's scale, a window on every other layer, the embedding scaled
    # by sqrt(hidden), tied embeddings, padded vocab.
    "gemma2": ("Gemma2Config", dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                    query_pre_attn_scalar=24, sliding_window=5, attn_logit_softcapping=3.0,
                                    final_logit_softcapping=5.0), (1, 2)),
    # Gemma 3: per-head (1 + w) q/k norms, windowed layers by layer_types with their own RoPE base, the global layers'
    # base with linear scaling.
    "gemma3": ("Gemma3TextConfig", dict(vocab_size=513, hidden_size=48, intermediate_size=72, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        query_pre_attn_scalar=20, sliding_window=5,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                            "rope_theta": 1000000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}}), (1, 2)),
    # OLMo 2: norms after attention and the MLP only, q/k norms over the whole projection (its statistics summed over
    # the tensor-parallel ranks).
    "olmo2": ("Olmo2Config", dict(vocab_size=700, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
                                  sliding_window=5), (1, 2, 4)),  # (a window OLMo 2 never applies)
    # GPT-OSS: biases on every linear layer (the experts' fc2 bias joins on one tensor-parallel rank), attention sinks,
    # a window on every other layer, YaRN RoPE, the router's top-k on biased logits, clamped quick-GELU experts (a
    # clamp small enough to bite; weights wide enough that the random router bias leaves every expert some tokens).
    "gpt_oss": ("GptOssConfig", dict(vocab_size=301, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.3, pad_token_id=0, initializer_range=0.1,
                                     tie_word_embeddings=False), (1, 2)),
    # DeepSeek-V3: multi-latent attention (low-rank queries with their norm, the joint key-value latent with its norm
    # and the decoupled rotary key, interleaved RoPE with YaRN and its softmax-scale correction), a dense first layer,
    # sigmoid routing limited to 1 of 2 groups with the (random) correction bias and the routed scaling factor, shared
    # experts. Its local-spec twin splits the down projections over tp (their latents gathered).
    "deepseek_v3": ("DeepseekV3Config", dict(vocab_size=333, hidden_size=64, intermediate_size=96,
                                             moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                                             n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                                             q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                             v_head_dim=12, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             routed_scaling_factor=2.5, pad_token_id=0, tie_word_embeddings=False,
                                             initializer_range=0.1,
                                             rope_scaling={"type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 8, "beta_fast": 32,
                                                           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                           "rope_theta": 10000.0}), (1, 2)),
    "deepseek_v2_lite": ("DeepseekV3Config", dict(vocab_size=301, hidden_size=48, intermediate_size=64,
                                                  moe_intermediate_size=16, num_hidden_layers=2,
                                                  num_attention_heads=4, n_routed_experts=4, n_shared_experts=2,
                                                  first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                                                  qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                                                  num_experts_per_tok=2, n_group=1, topk_group=1, pad_token_id=0,
                                                  initializer_range=0.1,
                                                  tie_word_embeddings=False), (1, 2)),
    # GLM-4.5: RoPE over half of each head (6 of 12 dims), q/k/v biases and q/k norms, a dense first layer, sigmoid
    # routing limited to 1 of 2 groups with the (random) correction bias and the scaling factor, two shared experts.
    "glm4_moe": ("Glm4MoeConfig", dict(vocab_size=301, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                       n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
                                       first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, n_group=2,
                                       topk_group=1, routed_scaling_factor=2.5, num_nextn_predict_layers=0,
                                       pad_token_id=0, initializer_range=0.1, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5}), (1, 2)),
}
# Megatron-Core's local spec names: multi-latent attention's down projections column-parallel, their latents gathered.
MODELS["deepseek_v3_local"] = MODELS["deepseek_v3"]
CONVERT_ARGS = {"deepseek_v3_local": ["--norms", "local"]}
MOE = {"mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "deepseek_v3", "deepseek_v2_lite", "deepseek_v3_local",
       "glm4_moe"}

# (tp, sequence parallel, recompute, tp of the converted checkpoint it loads: the load planner reshards, ep)
# CI runs the four-rank layouts (tp 4, ep 4) for these families only, each of the others every two-rank layout; every
# family at tp 4 and ep 4 under TRESTLE_FULL_TESTS=1.
FOUR_RANKS_CI = {"llama31", "gemma3", "qwen3_moe", "gpt_oss", "deepseek_v3"}
RUNS = [(1, False, False, 1, 1), (2, False, False, 2, 1), (2, True, False, 2, 1), (2, True, True, 2, 1),
        (4, True, False, 4, 1),
        # expert parallelism (MoE only): the batch split over the ep ranks, tokens sent to their experts' ranks
        (1, False, False, 1, 2), (2, True, False, 2, 2), (1, False, True, 1, 4)]


@pytest.fixture(scope="module")
def worker():
    path = os.environ.get("TRESTLE_MODEL_WORKER")
    if not path or not os.access(path, os.X_OK):
        pytest.fail("set TRESTLE_MODEL_WORKER to the built model_worker (ctest does this)")
    return path


def build_model(name, directory):
    config_class, kwargs, _ = MODELS[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    config = getattr(transformers, config_class)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0 (GPT-OSS's *_bias experts' too): randomise them
        for pname, p in model.named_parameters():
            if p.dim() == 1 or pname.endswith("_bias"):
                p.add_(torch.randn_like(p) * 0.1)
        for bname, b in model.named_buffers():  # DeepSeek's router correction bias (zeros at init): a trained one's
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)  # small enough that every expert gets tokens
    model.save_pretrained(directory)
    return model


def batch(vocab):
    generator = torch.Generator().manual_seed(vocab)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def run_ranks(worker, ckpt, tp, input_path, out, sp, recompute, scratch, ep=1):
    store = str(scratch / f"store_{os.path.basename(out)}")
    extra = (["sp"] if sp else []) + (["recompute"] if recompute else []) + [f"ep={ep}"]
    world = tp * ep
    procs = [subprocess.Popen([worker, ckpt, store, str(tp), str(r), input_path, out, *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {r} of tp {tp} ep {ep} (sp {sp}) exited with {p.returncode}:\n{text}"
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def read_f32(out, file, shape):
    return torch.from_numpy(np.fromfile(os.path.join(out, file), dtype=np.float32).reshape(shape))


def full_logits(out, ranks, vocab, tp):
    """[batch, seq, vocab]: the tensor-parallel ranks' vocabulary rows side by side, the data-parallel ranks' shares
    of the batch one after the other."""
    shares = []
    for first in range(0, len(ranks), tp):
        group = ranks[first:first + tp]
        assert len({rank["batch_start"] for rank in group}) == 1
        pieces = [read_f32(out, f"logits_{first + r}.bin", rank["logits_shape"]) for r, rank in enumerate(group)]
        shares.append((group[0]["batch_start"], torch.cat(pieces, dim=-1)[..., :vocab].transpose(0, 1)))
    return torch.cat([logits for _, logits in sorted(shares, key=lambda share: share[0])])


def canonical_grads(out, ranks):
    """Every parameter's gradient placed back into its canonical global tensor (replicated ones from rank 0, after
    checking that every rank holds the same)."""
    grads = {}
    for r, rank in enumerate(ranks):
        for p in rank["parameters"]:
            piece = read_f32(out, p["grad"], p["shape"])
            whole = grads.setdefault(p["name"], torch.full(p["global_shape"], float("nan")))
            row = 0
            for box in p["boxes"]:
                rows = box["shape"][0] if piece.dim() else 0
                part = piece[row:row + rows] if piece.dim() else piece
                index = tuple(slice(o, o + s) for o, s in zip(box["offset"], box["shape"], strict=True))
                if not torch.isnan(whole[index]).all():
                    assert torch.allclose(whole[index], part, rtol=1e-5, atol=1e-7), f"{p['name']} differs between ranks"
                whole[index] = part
                row += rows
            # Padding rows of the vocabulary get no gradient.
            if piece.dim() and row < piece.shape[0]:
                assert torch.all(piece[row:] == 0), f"{p['name']}: padding rows have a gradient"
    for name, g in grads.items():
        assert not torch.isnan(g).any(), f"{name}: some of it is held by no rank"
    return grads


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_loss_and_gradients_match(trestle_bin, worker, tmp_path, name):
    model = build_model(name, str(tmp_path / "hf"))
    vocab = MODELS[name][1]["vocab_size"]
    tokens, labels = batch(vocab)
    with torch.no_grad():
        reference = model(tokens).logits.float()
    reference_loss = torch.nn.functional.cross_entropy(reference.reshape(-1, vocab), labels.reshape(-1),
                                                       reduction="none").reshape(BATCH, SEQ)
    input_path = str(tmp_path / "batch.json")
    json.dump({"tokens": tokens.tolist(), "labels": labels.tolist()}, open(input_path, "w"))

    converted, tp1_grads = {}, None
    for tp, sp, recompute, source_tp, ep in RUNS:
        if tp not in MODELS[name][2] or (ep > 1 and name not in MOE):
            continue
        if max(tp, ep) == 4 and not FULL and name not in FOUR_RANKS_CI:
            continue
        if source_tp not in converted:
            ckpt = str(tmp_path / f"tp{source_tp}")
            result = subprocess.run([trestle_bin, "convert", "--from", "hf", str(tmp_path / "hf"), "--to", "trestle",
                                     ckpt, "--tp", str(source_tp), "-q", *CONVERT_ARGS.get(name, [])],
                                    capture_output=True, text=True, timeout=300)
            assert result.returncode == 0, f"convert --tp {source_tp} failed:\n{result.stdout}\n{result.stderr}"
            converted[source_tp] = ckpt
        out = str(tmp_path / f"out_tp{tp}_sp{int(sp)}_rc{int(recompute)}_from{source_tp}_ep{ep}")
        ranks = run_ranks(worker, converted[source_tp], tp, input_path, out, sp, recompute, tmp_path, ep)
        where = f"{name} tp {tp} ep {ep} sp {sp} recompute {recompute} (checkpoint converted at tp {source_tp})"

        logits = full_logits(out, ranks, vocab, tp)
        diff = (logits - reference).abs().max().item()
        assert diff <= 1e-4, f"{where}: logits differ from transformers by {diff}"
        for rank in ranks:
            rows = BATCH // ep
            loss = torch.tensor(rank["loss"]).reshape(rows, SEQ)
            loss_diff = (loss - reference_loss[rank["batch_start"]:rank["batch_start"] + rows]).abs().max().item()
            assert loss_diff <= 1e-4, f"{where}: loss differs from F.cross_entropy by {loss_diff}"

        grads = canonical_grads(out, ranks)
        if tp == 1:
            tp1_grads = grads
            assert all(g.abs().max() > 0 for g in grads.values()), f"{where}: a parameter got no gradient"
            continue
        assert grads.keys() == tp1_grads.keys()
        for pname, g in grads.items():
            scale = tp1_grads[pname].abs().max().item()
            rel = (g - tp1_grads[pname]).abs().max().item() / scale
            assert rel <= 1e-5, f"{where}: gradient of {pname} differs from tp 1 by {rel} relative"

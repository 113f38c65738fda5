"""Every family trains in `trestle train` as `transformers` trains it: tiny random Hugging Face models of Gemma 2,
Gemma 3, Gemma 4 dense (KV sharing, per-layer inputs, double-wide MLPs) and MoE (experts beside the MLP), OLMo 2, Phi-3, Qwen2-MoE, GPT-OSS, DeepSeek-V3, GLM-4.5, Qwen3-Next and Qwen3.5 dense and MoE (Gated DeltaNet hybrids),
Nemotron-H dense and with Nemotron 3's latent MoE layers (Mamba-2 hybrids), converted by `trestle convert`, trained 20
iterations on the bundled KJV corpus; every logged lm loss equals (1e-5 relative) transformers' own model trained with
torch's AdamW on the same global batches (Megatron's recipe, tests/interop/hf_training.py) at tp 1, tp 2 with sequence
parallelism, pp 2, dp 2 with the distributed optimizer and, for the MoE families, ep 2 and the experts' own tensor
parallelism (whole beside tp 2, split over two data-parallel ranks); the families whose layers
differ by index or whose attention has options of its own also at pp 2 interleaved and cp 2 (ring attention with the
windows, soft-caps, sinks, MLA's head dims and partial rotary). DeepSeek-V3 and GLM-4.5 with a multi-token-prediction
layer: megatron-core's own models fix the first step at six layouts, and 10 steps (DeepSeek-V3) agree over the
layouts; Qwen3-Next's MTP layer behind its hybrid trains alike in every layout too, and context parallelism over Gated
DeltaNet layers (which megatron-core lacks) is refused; megatron-core's own Qwen3-Next GPTModel (GatedDeltaNet, gated
attention, MTP) fixes its first step at five layouts, and its MambaModel (Mamba-2, attention, MLP and MoE layers)
Nemotron-H's at five; Mamba layers run under context parallelism as megatron-core's MambaContextParallel runs them
(each cp rank the whole sequence for its share of the heads); Gemma 2's losses with the fused kernels equal the ATen
composites' (1e-6). With --reset-attention-mask (documents masked from each other) the families whose attention has
options of its own train as transformers given megatron-core's document masks, and megatron-core's own MambaModel and
DeepSeek-V3 (with its MTP layer) fix the first step.

The models are built so that a wrong piece changes the loss: norm weights and biases are random (not their initial
constants), Gemma 2's soft-caps are small enough to bite (3 on attention scores, 5 on logits), query_pre_attn_scalar
differs from the head size, windows (8 positions) are shorter than the sequence (32) and cover some layers only,
Gemma 3's global layers have their own RoPE base and linear scaling, GPT-OSS's experts' clamp (0.2) bites and its
biases and sinks are random. Per family, a run saved at iteration 10 resumes
bit-exactly on its layout and within 1e-5 of transformers on another, and the final checkpoint exported with
`trestle convert --to hf` gives transformers the trainer's validation loss; Gemma 4's layouts the trainer cannot run
(per-layer inputs over pipeline stages, KV sharing across model chunks, either under recompute) are refused. From scratch (--model-config), each family
starts near log(vocab), and those with tensors split over tp their own way are the same model at tp 1 and tp 2.
"""
import json
import math
import pathlib
import sys
import textwrap

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ci_scope import FULL, ci_cases  # noqa: E402
from hf_training import train_transformers  # noqa: E402
from models import save_tiny_model  # noqa: E402
from ports import free_port  # noqa: E402
import test_train_loop as loop  # noqa: E402

SEQ, MBS, GBS, ITERS = loop.SEQ, loop.MBS, loop.GBS, loop.ITERS
LR, MIN_LR, WARMUP, WD, CLIP, BETA2 = 3e-3, 3e-4, 3, 0.1, 1.0, 0.95
COMMON = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256)
GATED_DELTA_NET = dict(intermediate_size=96, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                       pad_token_id=0,
                       layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
MAMBA = dict(intermediate_size=96, head_dim=16, mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2,
             conv_kernel=4, chunk_size=16, time_step_min=0.3, time_step_max=1.0, initializer_range=0.1,
             pad_token_id=0, tie_word_embeddings=False)
GEMMA4 = dict(intermediate_size=96, head_dim=16, global_head_dim=32, attention_k_eq_v=True,
              num_global_key_value_heads=2, sliding_window=8, final_logit_softcapping=5.0, rms_norm_eps=1e-6,
              layer_types=["sliding_attention", "full_attention"] * 2,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                  "rope_theta": 1000000.0}})
FAMILIES = {
    "gemma2": ("Gemma2Config", dict(COMMON, intermediate_size=96, head_dim=16, query_pre_attn_scalar=24,
                                    sliding_window=8, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                    rms_norm_eps=1e-6)),
    # attn_logit_softcapping: Gemma 3's config keeps it, transformers never applies it (nor does Trestle).
    "gemma3": ("Gemma3TextConfig", dict(COMMON, intermediate_size=96, head_dim=16, query_pre_attn_scalar=24,
                                        sliding_window=8, rms_norm_eps=1e-6, attn_logit_softcapping=3.0,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                     "sliding_attention"],
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1000000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}})),
    "olmo2": ("Olmo2Config", dict(COMMON, intermediate_size=96, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "phi3": ("Phi3Config", dict(COMMON, intermediate_size=96, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2, sliding_window=None, tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                         rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "gpt_oss": ("GptOssConfig", dict(COMMON, intermediate_size=32, head_dim=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.2, rms_norm_eps=1e-5,
                                     pad_token_id=0, tie_word_embeddings=False)),
    "deepseek_v3": ("DeepseekV3Config", dict(COMMON, num_key_value_heads=4, intermediate_size=96,
                                             moe_intermediate_size=32, num_hidden_layers=4, n_routed_experts=8,
                                             n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24,
                                             kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                                             num_experts_per_tok=2, n_group=2, topk_group=1,
                                             routed_scaling_factor=2.5, rms_norm_eps=1e-6, pad_token_id=0,
                                             tie_word_embeddings=False,
                                             rope_scaling={"type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 8, "beta_fast": 32,
                                                           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                           "rope_theta": 10000.0})),
    # GLM-4.5: RoPE over half of each head, q/k/v biases and q/k norms, a dense first layer, sigmoid routing limited to
    # 1 of 2 groups with the expert bias and scaled weights, one shared expert.
    "glm4_moe": ("Glm4MoeConfig", dict(COMMON, intermediate_size=96, moe_intermediate_size=32, head_dim=16,
                                       n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                       first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, n_group=2,
                                       topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                       num_nextn_predict_layers=0, rms_norm_eps=1e-6, pad_token_id=0,
                                       tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5})),
    # Qwen3-Next (MoE) and Qwen3.5 (dense): Gated DeltaNet layers (two key heads of 8 dims, each serving two value
    # heads of 12) between gated full-attention ones with (1 + w) q/k norms and RoPE over a quarter of each head.
    "qwen3_next": ("Qwen3NextConfig", dict(COMMON, **GATED_DELTA_NET, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                           tie_word_embeddings=False)),
    "qwen3_5": ("Qwen3_5TextConfig", dict(COMMON, **GATED_DELTA_NET)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(COMMON, **GATED_DELTA_NET, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                 tie_word_embeddings=False)),
    # Nemotron-H: Mamba-2 layers (4 heads of 8 dims in 2 groups, state 8) between attention alone (no RoPE) and a
    # squared-ReLU MLP alone; Nemotron 3's MoE layers (sigmoid routing with the score bias, squared-ReLU experts in a
    # latent space of 48, a shared expert).
    "nemotron_h": ("NemotronHConfig", dict(COMMON, **MAMBA, hybrid_override_pattern="M*M-")),
    "nemotron_h_moe": ("NemotronHConfig", dict(COMMON, **MAMBA, hybrid_override_pattern="ME*E", n_routed_experts=4,
                                               num_experts_per_tok=2, moe_intermediate_size=32,
                                               moe_shared_expert_intermediate_size=48, routed_scaling_factor=1.5,
                                               moe_latent_size=48)),
    # Gemma 4: windowed layers of 16-dim heads (plain RoPE, base 10000) between full-attention ones of 32-dim heads
    # whose keys are their values (proportional RoPE over a quarter of each head, base 1000000), q/k norms and weightless
    # value norms, a soft-capped output. The dense model: the last two layers reuse layers 0's and 1's keys and values
    # with MLPs twice as wide, per-layer inputs of 8 (over two pipeline stages both travel beside the hidden states);
    # the MoE model: 4 experts beside each layer's MLP; gemma4_pli: the dense model's per-layer inputs without KV
    # sharing.
    "gemma4": ("Gemma4TextConfig", dict(COMMON, **GEMMA4, num_kv_shared_layers=2, use_double_wide_mlp=True,
                                        hidden_size_per_layer_input=8, vocab_size_per_layer_input=4096)),
    "gemma4_moe": ("Gemma4TextConfig", dict(COMMON, **GEMMA4, hidden_size_per_layer_input=0, enable_moe_block=True,
                                            num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                                            tie_word_embeddings=False)),
    "gemma4_pli": ("Gemma4TextConfig", dict(COMMON, **GEMMA4, hidden_size_per_layer_input=8,
                                            vocab_size_per_layer_input=4096)),
}
# transformers clamps each Mamba step at time_step_min, megatron-core (and so the trainer) does not: the models are made
# with steps drawn from [0.3, 1] (and weights of std 0.1: the scan weighs as much as the skip term D · x, so a wrong
# piece of it changes the loss) and then saved unclamped.
UNCLAMPED = {"time_step_min": 1e-30}
MOE = {"qwen2_moe", "gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe", "nemotron_h_moe", "gemma4_moe"}
GEMMA4_FAMILIES = {"gemma4", "gemma4_moe", "gemma4_pli"}
HYBRID = {"nemotron_h", "nemotron_h_moe"}
# megatron-core's GatedDeltaNet has no context parallelism: the trainer refuses cp for these (test_..._refused).
LINEAR_ATTENTION = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}
# Megatron's aux-loss-free balancing (the router's expert bias moved after each global batch), for the models with it.
BIAS_UPDATE_RATE = {"deepseek_v3": 1e-3, "glm4_moe": 1e-3, "nemotron_h_moe": 1e-3}
TP = "--tensor-model-parallel-size"
LAYOUTS = {
    "tp1": (1, []),
    "tp2-sp": (2, [TP, 2, "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", 2]),
    "pp2-interleaved": (2, ["--pipeline-model-parallel-size", 2, "--num-layers-per-virtual-pipeline-stage", 1]),
    "dp2-distopt": (2, ["--use-distributed-optimizer"]),
    "ep2": (2, ["--expert-model-parallel-size", 2]),
    "cp2": (2, ["--context-parallel-size", 2]),
    "pp2-uneven": (2, ["--pipeline-model-parallel-size", 2, "--decoder-first-pipeline-num-layers", 1]),
    # Gemma 4's shared keys and values between stages under sequence parallelism (each rank's heads, the sequence's tp
    # slices side by side).
    "tp2-sp-pp2": (4, [TP, 2, "--sequence-parallel", "--pipeline-model-parallel-size", 2]),
}
# Megatron's expert tensor parallelism (the routed experts' own tp), for every MoE family against transformers and
# against megatron-core's first steps: whole experts beside attention at tp 2 (the only size megatron-core allows for
# experts with biases), and experts split over two data-parallel ranks.
EXPERT_TP_LAYOUTS = {
    "tp2-sp-etp1": (2, [TP, 2, "--sequence-parallel", "--expert-tensor-parallel-size", 1]),
    "dp2-etp2": (2, ["--expert-tensor-parallel-size", 2]),
}
LAYOUTS.update(EXPERT_TP_LAYOUTS)
# Multi-token prediction against megatron-core's unparallelised model (its 3 layers split 1 + 2 over two stages).
# Under context parallelism the MTP loss is each cp rank's own mean (the last position, which has no token ahead, is
# one rank's), averaged over the ranks with the gradients, in megatron-core as in Trestle: a cp 2 step is not the
# unparallelised one, so cp 2 is not among these (test_multi_token_prediction_in_every_layout checks it).
LAYOUTS_MCORE_MTP = ("tp1", "tp2-sp", "pp2-uneven", "dp2-distopt", "ep2", "tp2-sp-etp1")
# Interleaving changes nothing a family does but for models whose layers differ by index (windows, RoPE bases, dense
# first layers), and ring attention nothing but for their attention's own options (soft-caps, windows, sinks, MLA's
# head dims, partial rotary): those families run them.
PER_LAYER_KINDS = {"gemma2", "gemma3", "gpt_oss", "deepseek_v3", "glm4_moe", *LINEAR_ATTENTION, *HYBRID,
                   *GEMMA4_FAMILIES}
CASES = [(family, layout) for family in FAMILIES for layout in LAYOUTS
         if (layout not in ("ep2", *EXPERT_TP_LAYOUTS) or family in MOE) and layout != "pp2-uneven" and
         (layout != "tp2-sp-pp2" or family == "gemma4") and
         (layout not in ("pp2-interleaved", "cp2") or family in PER_LAYER_KINDS) and
         (layout != "cp2" or family not in LINEAR_ATTENTION)]
# CI: every family at the layout that tests what it adds (any layout checks the family's model against transformers'),
# every layout by some family; tp 1 for the families whose tp 1 run other tests reuse (the resume tests' uninterrupted
# run, the fused kernels' comparison) or that have no other.
CI_TP1 = ("gemma2", "deepseek_v3", "qwen3_next", "qwen3_5_moe", "nemotron_h_moe", "gemma4")
CASES = ci_cases(CASES, [(family, "tp1") for family in CI_TP1] + [
    ("gemma2", "tp2-sp"), ("gemma2", "cp2"), ("gemma3", "pp2-interleaved"), ("olmo2", "tp2-sp"),
    ("phi3", "dp2-distopt"), ("qwen2_moe", "ep2"), ("gpt_oss", "tp2-sp"), ("deepseek_v3", "pp2"),
    ("deepseek_v3", "cp2"), ("glm4_moe", "tp2-sp"), ("qwen3_next", "tp2-sp"), ("qwen3_next", "ep2"),
    ("qwen3_5", "pp2-interleaved"), ("nemotron_h", "tp2-sp"), ("nemotron_h", "cp2"), ("nemotron_h_moe", "ep2"),
    ("gemma4", "cp2"), ("gemma4_moe", "ep2"),
    ("gemma4_pli", "pp2-interleaved"), ("gemma4", "tp2-sp-pp2"), ("nemotron_h_moe", "tp2-sp-etp1"),
    ("gemma4_moe", "dp2-etp2")])


def save_family_model(directory, family, config_class, config, seed):
    """The family's random transformers model in `directory`: norms, biases and (Gemma 4) experts and layer scalars
    moved off their initial constants; the hybrids' config unclamped."""
    if family in GEMMA4_FAMILIES:  # its experts start at 0 and its layer scalars (buffers) at 1: moved too
        import test_gemma4_convert
        test_gemma4_convert.save_tiny_gemma4(directory, config, seed, qk_norm_scale=0.5)
    else:
        save_tiny_model(directory, config_class, config, seed=seed)
    if family in HYBRID:
        hf_config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps(dict(hf_config, **UNCLAMPED)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    root = tmp_path_factory.mktemp("families")
    (root / "data").mkdir()
    trestle.run("preprocess", "--input", loop.CORPUS / "kjv.jsonl", "--output-prefix", root / "data" / "kjv",
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", loop.CORPUS / "tokenizer.json",
                "--append-eod", "--quiet")
    for seed, (family, (config_class, config)) in enumerate(FAMILIES.items(), start=11):
        save_family_model(root / family / "hf", family, config_class, config, seed)
        trestle.run("convert", "--from", "hf", root / family / "hf", "--to", "trestle", root / family / "ckpt",
                    "--quiet")
    return root


@pytest.fixture(scope="module")
def samples(setup, tmp_path_factory):
    """The first ITERS global batches of the training split, and the validation samples of a run's final evaluation
    (--eval-iters 2), as megatron-core's GPTDataset builds them."""
    tmp = tmp_path_factory.mktemp("samples")
    return loop.megatron_samples(setup, 0, ITERS * GBS, tmp), loop.megatron_samples(setup, 1, 2 * GBS, tmp)


_expected = {}


def transformers_losses(setup, samples, family):
    if family not in _expected:
        _expected[family] = train_transformers(
            setup / family / "hf", samples[0], iters=ITERS, global_batch=GBS, micro_batch=MBS, lr=LR, min_lr=MIN_LR,
            warmup_iters=WARMUP, weight_decay=WD, clip_grad=CLIP, beta2=BETA2,
            expert_bias_update_rate=BIAS_UPDATE_RATE.get(family, 0.0))
        losses = _expected[family]
        assert losses[ITERS] < losses[1] - 0.05, f"{family}: transformers' loss does not go down: {losses}"
    return _expected[family]


def train(trestle, setup, family, out, *extra, world=1, load=None, iters=ITERS, data=None):
    """`trestle train` of the family's converted model (on `data`, a dataset prefix, or the KJV corpus); returns
    {iteration: lm loss} and the validation losses."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.jsonl"
    trestle.run("train", "--nproc-per-node", world, "--data-path", data or setup / "data" / "kjv_text_document",
                "--split", "98,2,0", "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", SEQ,
                "--train-iters", iters, "--lr", LR, "--min-lr", MIN_LR, "--lr-warmup-iters", WARMUP,
                "--lr-decay-style", "cosine", "--weight-decay", WD, "--clip-grad", CLIP, "--adam-beta2", BETA2,
                "--log-interval", 1, "--eval-interval", 1000, "--eval-iters", 0, "--log-json", log,
                "--load", load if load is not None else setup / family / "ckpt", *extra, timeout=300)
    return loop.read_losses(log)


def assert_close(losses, expected, what):
    assert sorted(losses) == sorted(expected), (what, sorted(losses), sorted(expected))
    bad = {i: (losses[i], expected[i]) for i in expected if not loop.close(losses[i], expected[i])}
    assert not bad, f"{what}: losses differ from transformers' at {bad}"


_runs = {}
# CI stops a run of several ranks at iteration 10 of its 20 (--exit-interval: the same learning-rate schedule), against
# transformers' first 10 losses: on CI's two cores each collective of two Gloo ranks costs ~1-2 ms, most of such a
# run's time. A tp 1 run (cheap, and the uninterrupted run the resume test compares with) and Gemma 2's at tp 2 (the
# fused kernels' 20 losses against the composites') run all 20, as every run does under TRESTLE_FULL_TESTS=1.
LAYOUT_ITERS = ITERS if FULL else ITERS // 2
WHOLE_RUNS = {("gemma2", "tp2-sp")}


def layout_iters(family, layout):
    return ITERS if layout == "tp1" or (family, layout) in WHOLE_RUNS else LAYOUT_ITERS


def layout_run(trestle, setup, family, layout, tmp_path_factory):
    """The family's layout_iters() iterations at `layout` (fused kernels, the default), run once per module:
    {iteration: loss}. At tp 1 it also saves at iterations 10 and 20 (the uninterrupted run the resume test compares
    with): returns (losses, checkpoint root)."""
    if (family, layout) not in _runs:
        out = tmp_path_factory.mktemp(f"{family}_{layout}")
        world, extra = LAYOUTS[layout]
        if layout == "tp1":
            extra = [*extra, "--save", out / "ckpt", "--save-interval", 10]
        elif layout_iters(family, layout) < ITERS:
            extra = [*extra, "--exit-interval", layout_iters(family, layout)]
        losses, _ = train(trestle, setup, family, out, *extra, world=world)
        _runs[(family, layout)] = (losses, out / "ckpt")
    return _runs[(family, layout)]


@pytest.mark.parametrize("family,layout", CASES)
def test_losses_equal_transformers(setup, samples, trestle, tmp_path_factory, family, layout):
    expected = transformers_losses(setup, samples, family)
    losses, _ = layout_run(trestle, setup, family, layout, tmp_path_factory)
    assert_close(losses, {i: expected[i] for i in range(1, layout_iters(family, layout) + 1)}, f"{family} at {layout}")


@pytest.mark.parametrize("layout", ["tp1", "tp2-sp"])
def test_fused_kernels_train_as_the_composites(setup, trestle, tmp_path, tmp_path_factory, layout):
    """Gemma 2 (the fused (1 + w) RMSNorm before and after attention and the MLP, GeGLU, soft-capped scores and
    logits): the 20 losses with the fused kernels equal the ATen composites' (--no-fused-kernels) within 1e-6."""
    fused, _ = layout_run(trestle, setup, "gemma2", layout, tmp_path_factory)
    assert sorted(fused) == list(range(1, ITERS + 1))
    world, extra = LAYOUTS[layout]
    composite, _ = train(trestle, setup, "gemma2", tmp_path, *extra, "--no-fused-kernels", world=world)
    assert sorted(composite) == sorted(fused)
    bad = {i: (fused[i], composite[i]) for i in fused if not loop.close(fused[i], composite[i], rel=1e-6)}
    assert not bad, f"fused kernels' losses differ from the composites' at {bad}"


# --reset-attention-mask in the families whose softmax attention has options of its own: windows (a document mask and a
# window together), soft-caps, sinks, MLA's head dims, partial rotary, Gemma 4's KV sharing; at cp 2 the ring's blocks
# masked by document as well. (Gated DeltaNet and Mamba mixers ignore the mask, as megatron-core's do.)
DOCUMENT_CASES = ci_cases([(family, layout) for family in ("gemma2", "gemma3", "gpt_oss", "deepseek_v3", "glm4_moe",
                                                           "gemma4") for layout in ("tp1", "cp2")],
                          [("gemma2", "cp2"), ("deepseek_v3", "tp1")])
DOCUMENT_ITERS = 6


@pytest.fixture(scope="module")
def document_samples(setup, trestle, tmp_path_factory):
    """A dataset of short documents (several in each sequence) and its first training batches as megatron-core's
    GPTDataset builds them with reset_attention_mask (each with its attention mask)."""
    tmp = tmp_path_factory.mktemp("documents")
    data = loop.clause_documents(trestle, tmp)
    return data, loop.megatron_samples(setup, 0, DOCUMENT_ITERS * GBS, tmp, data=data, reset_attention_mask=True)


@pytest.mark.parametrize("family,layout", DOCUMENT_CASES)
def test_documents_masked_from_each_other_train_as_transformers(setup, trestle, tmp_path, document_samples, family,
                                                                 layout):
    """--reset-attention-mask: every logged loss equals transformers' trained with megatron-core's document masks as
    its 4-D attention masks (the windowed layers' masks also windowed), 1e-5 relative."""
    assert_documents_train_as_transformers(setup, trestle, tmp_path, document_samples, family, layout,
                                           "--reset-attention-mask", "--eod-token-id", 0)


def assert_documents_train_as_transformers(setup, trestle, tmp_path, data_and_samples, family, layout, *flags):
    """The family's DOCUMENT_ITERS logged losses at `layout` with `flags` equal transformers' trained on the samples
    (their masks and positions), 1e-5 relative."""
    data, samples = data_and_samples
    expected = train_transformers(setup / family / "hf", samples, iters=DOCUMENT_ITERS, global_batch=GBS,
                                  micro_batch=MBS, lr=LR, min_lr=MIN_LR, warmup_iters=WARMUP, weight_decay=WD,
                                  clip_grad=CLIP, beta2=BETA2,
                                  expert_bias_update_rate=BIAS_UPDATE_RATE.get(family, 0.0))
    world, extra = LAYOUTS[layout]
    losses, _ = train(trestle, setup, family, tmp_path, *extra, *flags, world=world, iters=DOCUMENT_ITERS, data=data)
    assert_close(losses, expected, f"{family} at {layout} with {' '.join(map(str, flags))}")


INTER_DOCUMENT_CASES = ci_cases([(family, layout) for family in ("gemma2", "gemma3", "gpt_oss", "glm4_moe", "gemma4")
                                 for layout in ("tp1", "cp2")], [("gemma3", "cp2")])


@pytest.fixture(scope="module")
def inter_document_samples(trestle, tmp_path_factory):
    """Short documents without end-of-document tokens and their first training batches as megatron-core 0.19's
    GPTDataset gives them with inter_document_masking (masks from their cu_seqlens, positions restarting)."""
    tmp = tmp_path_factory.mktemp("inter_documents")
    data = loop.clause_documents(trestle, tmp, append_eod=False)
    return data, loop.megatron_inter_document_samples(DOCUMENT_ITERS * GBS, tmp, data)


@pytest.mark.parametrize("family,layout", INTER_DOCUMENT_CASES)
def test_dataset_documents_train_as_transformers(setup, trestle, tmp_path, inter_document_samples, family, layout):
    """--dataloader-inter-document-masking: every logged loss equals transformers' trained with megatron-core 0.19's
    document masks and position ids (the windowed layers' masks also windowed), 1e-5 relative."""
    assert_documents_train_as_transformers(setup, trestle, tmp_path, inter_document_samples, family, layout,
                                           "--dataloader-inter-document-masking")


@pytest.mark.parametrize("family,named", [("nemotron_h", "the model's Mamba layers"),
                                          ("qwen3_next", "the model's Gated DeltaNet layers"),
                                          ("deepseek_v3", "multi-token prediction")])
def test_inter_document_masking_refuses_what_megatron_core_packs_its_own_way(setup, trestle, tmp_path, family, named):
    """megatron-core restarts Mamba's and Gated DeltaNet's state and shifts the multi-token-prediction inputs within
    each packed document; Trestle does not, so --dataloader-inter-document-masking is refused for them, naming why."""
    model = (("--model-config", setup / family / "hf" / "config.json", "--mtp-num-layers", 1) if family == "deepseek_v3"
             else ("--load", setup / family / "ckpt"))
    run = trestle.run_raw("train", "--nproc-per-node", 1, "--data-path", setup / "data" / "kjv_text_document",
                          "--split", "98,2,0", "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length",
                          SEQ, "--train-iters", 4, "--lr", LR, "--lr-warmup-iters", 1, "--eval-iters", 0, *model,
                          "--dataloader-inter-document-masking", timeout=300)
    assert run.returncode == 1, (family, run.returncode, run.stderr[-2000:])
    assert f"--dataloader-inter-document-masking is not supported with {named}" in run.stderr, run.stderr[-2000:]


RESUME_ELSEWHERE = {"gemma2": "pp2", "gemma3": "tp2-sp", "olmo2": "tp2-sp", "phi3": "dp2-distopt",
                    "qwen2_moe": "ep2", "gpt_oss": "tp2-sp", "deepseek_v3": "dp2-distopt", "glm4_moe": "ep2",
                    "qwen3_next": "tp2-sp", "qwen3_5": "pp2", "qwen3_5_moe": "ep2", "nemotron_h": "tp2-sp",
                    "nemotron_h_moe": "ep2", "gemma4": "tp2-sp", "gemma4_moe": "ep2",
                    "gemma4_pli": "pp2"}


# CI: the families whose state goes beyond weights and Adam's (the routers' expert biases, the Mamba layers' and Gemma
# 4's per-layer tensors); the others in the full run.
@pytest.mark.parametrize("family", ci_cases(FAMILIES, ["deepseek_v3", "nemotron_h_moe", "gemma4"]))
def test_resume_and_export(setup, samples, trestle, tmp_path, tmp_path_factory, family):
    """Saved at iteration 10 at tp 1: resumed at tp 1 the losses and the final checkpoint are bit-identical to an
    uninterrupted run's; resumed at another layout they stay within 1e-5 of transformers'; the final checkpoint,
    converted to Hugging Face, gives transformers the trainer's validation loss."""
    expected = transformers_losses(setup, samples, family)
    full, full_ckpt = layout_run(trestle, setup, family, "tp1", tmp_path_factory)
    first, _ = train(trestle, setup, family, tmp_path / "first", "--save", tmp_path / "part", "--exit-interval", 10)
    assert first == {i: full[i] for i in range(1, 11)}
    resumed, valid = train(trestle, setup, family, tmp_path / "resumed", "--save", tmp_path / "part",
                           "--eval-iters", 2, load=tmp_path / "part")
    assert sorted(resumed) == list(range(11, ITERS + 1))
    for i in resumed:
        assert resumed[i] == full[i], f"{family} iteration {i} after resume: {resumed[i]!r} != {full[i]!r}"
    trestle.run("diff", full_ckpt, tmp_path / "part", "--quiet")
    world, extra = LAYOUTS[RESUME_ELSEWHERE[family]]
    other, _ = train(trestle, setup, family, tmp_path / "other", *extra, "--ckpt-step", 10, world=world,
                     load=tmp_path / "part")
    assert_close(other, {i: expected[i] for i in range(11, ITERS + 1)},
                 f"{family} saved at tp1, resumed at {RESUME_ELSEWHERE[family]}")
    trestle.run("convert", "--from", "trestle", tmp_path / "part", "--to", "hf", tmp_path / "hf", "--quiet")
    if family in BIAS_UPDATE_RATE:  # the balancing moved the routers' biases (zero at first) in steps of the rate
        from models import load_hf_tensors
        biases = [t for n, t in load_hf_tensors(tmp_path / "hf").items() if n.endswith("e_score_correction_bias")]
        steps = torch.cat(biases) / BIAS_UPDATE_RATE[family]
        assert biases and steps.abs().max() > 0 and steps.abs().max() <= ITERS, steps
        assert torch.allclose(steps, steps.round(), atol=1e-3), steps
    assert len(valid) == 1
    exported = loop.hf_loss(tmp_path / "hf", samples[1])
    assert loop.close(exported, valid[0]), f"{family}: transformers {exported}, trainer {valid[0]}"


@pytest.mark.parametrize("family", ci_cases(FAMILIES, ["gemma3", "deepseek_v3", "qwen3_5", "nemotron_h"]))
def test_from_scratch(setup, trestle, tmp_path, family):
    """--model-config: Megatron's initialisation (norm weights 1, or 0 where the model applies 1 + w) gives a first
    loss near log(vocab), and (the families whose tensors split over tp in their own ways) the same model at tp 2: the
    same first loss and, after one step, the same second. Not the third: from a fresh initialisation many gradients are
    near 0, where AdamW's normalised step seems to magnify tp's other summation order. On Gemma 4's MoE the relative
    gap grew about sixfold a step (0, 1.9e-6, 1.2e-5), with the ATen composites (--no-fused-kernels) too (0, 5.7e-8,
    5.9e-6, 5.3e-5); with --adam-eps 1e-4 the third losses were 2.9e-8 apart."""
    first = {}
    for tp in (1, 2) if family in {"gemma3", "olmo2", "gpt_oss", "deepseek_v3", "glm4_moe", *LINEAR_ATTENTION,
                                   *HYBRID, *GEMMA4_FAMILIES} else (1,):
        out = tmp_path / f"tp{tp}"
        out.mkdir()
        log = out / "log.jsonl"
        trestle.run("train", "--nproc-per-node", tp, TP, tp, "--model-config", setup / family / "hf" / "config.json",
                    "--data-path", setup / "data" / "kjv_text_document", "--split", "98,2,0",
                    "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", SEQ, "--train-iters", 3,
                    "--lr", "1e-3", "--log-interval", 1, "--eval-iters", 0, "--log-json", log, timeout=300)
        first[tp] = [json.loads(line)["lm_loss"] for line in log.read_text().splitlines()]
    assert len(first[1]) == 3
    assert abs(first[1][0] - math.log(COMMON["vocab_size"])) < 0.5, first[1]
    assert 2 not in first or all(loop.close(a, b) for a, b in zip(first[2][:2], first[1][:2], strict=True)), first


def test_expert_bias_balances_in_fp32_under_bf16(setup, trestle, tmp_path):
    """bf16 training with DeepSeek-V3's aux-loss-free balancing: Megatron keeps the router's expert bias as an fp32
    buffer, so its steps of the update rate (1e-3) add up exactly whatever the training dtype. After 10 iterations
    every bias's fp32 value (the optimizer's master of it, which a resume reads) is a whole number of steps, and the
    checkpoint holds the bias itself in fp32 (as Megatron saves its buffer), that same value, which an export to
    Hugging Face carries; saved at iteration 5 and resumed, the run continues bit-identically, and
    with --moe-router-dtype fp32 (the router's logits, top-k and probabilities in fp32) it trains otherwise."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "docs" / "examples"))
    import read_trestle
    full, _ = train(trestle, setup, "deepseek_v3", tmp_path / "full", "--bf16", "--save", tmp_path / "ckpt",
                    "--save-interval", 5)
    _, tensors = read_trestle.read_checkpoint(str(tmp_path / "ckpt"))
    biases = sorted(n for n in tensors if n.endswith(".mlp.router.expert_bias") and not n.startswith("optimizer."))
    assert biases, sorted(tensors)
    for name in biases:
        master = torch.from_numpy(tensors[f"optimizer.fp32_param.{name}"].copy())
        steps = master.double() / BIAS_UPDATE_RATE["deepseek_v3"]
        assert steps.abs().max() > 2, (name, steps)
        assert torch.allclose(steps, steps.round(), atol=1e-4), (name, steps)
        assert tensors[name].dtype.name == "float32" and torch.equal(torch.from_numpy(tensors[name].copy()), master), name
    trestle.run("convert", "--from", "trestle", tmp_path / "ckpt", "--to", "hf", tmp_path / "hf", "--quiet")
    from models import load_hf_tensors
    exported = {n: t for n, t in load_hf_tensors(tmp_path / "hf").items() if n.endswith("e_score_correction_bias")}
    assert len(exported) == len(biases) and all(t.dtype == torch.float32 for t in exported.values()), exported
    for name, t in exported.items():
        steps = t.double() / BIAS_UPDATE_RATE["deepseek_v3"]
        assert torch.allclose(steps, steps.round(), atol=1e-4), (name, steps)
    part, _ = train(trestle, setup, "deepseek_v3", tmp_path / "part", "--bf16", "--save", tmp_path / "part_ckpt",
                    "--exit-interval", 5)
    resumed, _ = train(trestle, setup, "deepseek_v3", tmp_path / "resumed", "--bf16", load=tmp_path / "part_ckpt")
    assert part == {i: full[i] for i in range(1, 6)}
    assert resumed == {i: full[i] for i in range(6, ITERS + 1)}, (resumed, full)
    router32, _ = train(trestle, setup, "deepseek_v3", tmp_path / "router32", "--bf16", "--moe-router-dtype", "fp32")
    assert router32[1] != full[1] and all(loop.close(router32[i], full[i], rel=1e-2) for i in full), (router32, full)


# megatron-core on the CPU without Transformer Engine, in a world of one: its local attention builds the sliding-window
# mask on "cuda" (the same mask on the CPU here); its router's GEMM names Transformer Engine's te_general_gemm, left
# undefined when that import fails (None takes its torch path); and an expert's fc2 bias is added in place to the
# output of the tensor-parallel reduction, which returns its input itself when there is no other rank (autograd refuses
# that in-place change; a copy of the same values is returned here).
MCORE_CPU_PATCHES = '''
import megatron.core.fusions.fused_softmax as _fused_softmax
import megatron.core.tensor_parallel.mappings as _mappings
import megatron.core.transformer.moe.moe_utils as _moe_utils

if not hasattr(_moe_utils, "te_general_gemm"):
    _moe_utils.te_general_gemm = None
_mappings._ReduceFromModelParallelRegion.forward = staticmethod(
    lambda ctx, input_, group: _mappings._reduce(input_, group).clone())


def _sliding_window_causal_mask(sq, skv, window_size):
    m = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


_fused_softmax.get_sliding_window_causal_mask = _sliding_window_causal_mask
torch.cuda.current_device = lambda: torch.device("cpu")  # where the MTP loss tracker puts its values
'''


# One iteration of megatron-core's own schedule (forward_backward_no_pipelining) in a world of TP x dp ranks, the model
# wrapped in megatron-core's DistributedDataParallel and its gradients finalized by finalize_model_grads, as
# Megatron-LM's training step does: the global batch's samples dealt out as Megatron's pretraining sampler deals them
# (micro-batch m of dp rank r holds samples (m·dp + r)·mbs ...), each micro-batch's loss its tokens' mean over the
# micro-batches (or with calculate_per_token_loss its sum, the gradients divided by the counted tokens), the MoE and
# MTP losses scaled by the schedule. Writes the token-weighted lm loss and the gradient norm (fp64, each parameter
# counted once over the tensor-parallel ranks).
MCORE_SCHEDULE_STEP = textwrap.dedent("""
    import contextlib, functools, json, os, sys, torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    import megatron.core.transformer.torch_norm as _torch_norm
    _wrapped_norm = _torch_norm.WrappedTorchNorm.__new__

    def _norm(cls, config, *args, **kwargs):
        # The local spec's torch norm refuses sequence parallelism; Transformer Engine's norm, which Megatron-LM runs,
        # takes it and marks its weight so that finalize_model_grads sums its gradient over tp.
        sequence_parallel, config.sequence_parallel = config.sequence_parallel, False
        try:
            norm = _wrapped_norm(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for p in norm.parameters():
            p.sequence_parallel = sequence_parallel
        return norm
    _torch_norm.WrappedTorchNorm.__new__ = _norm

    if not torch.cuda.is_available():  # the schedule and DDP make tensors on "cuda"
        def _on_cpu(make):
            return lambda *a, **k: make(*a, **(dict(k, device="cpu") if str(k.get("device")) == "cuda" else k))
        torch.zeros, torch.tensor, torch.empty = _on_cpu(torch.zeros), _on_cpu(torch.tensor), _on_cpu(torch.empty)

    def main():
        ckpt, out, port, batch = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
        c, mbs = json.loads(sys.argv[5]), int(sys.argv[6])
        config, model = build(c, port, hidden_dropout=0.0, attention_dropout=0.0)
        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        torch.manual_seed(5)  # the same draws on every rank: replicated weights agree over tp (and dp)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02) + (1.0 if "norm" in name else 0.0))
        dist_checkpointing.save(model.sharded_state_dict(), ckpt,
                                sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
        b = torch.load(batch)
        dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        micro_batches = b["tokens"].shape[0] // (mbs * dp)
        seq = b["tokens"].shape[1]
        mask = torch.triu(torch.ones(seq, seq), diagonal=1).bool()[None, None]  # True: masked out
        positions = torch.arange(seq).unsqueeze(0).expand(mbs, seq)

        def micro_batch(m):
            first = (m * dp + rank) * mbs
            return {k: v[first:first + mbs] for k, v in b.items()}

        def loss_func(loss_mask, losses):
            total, count = (losses.float() * loss_mask).sum(), loss_mask.sum()
            return total, count.int(), {"lm loss": torch.stack([total.detach(), count])}

        def forward_step(iterator, model):
            d = next(iterator)
            return model(d["tokens"], positions, mask, labels=d["labels"]), functools.partial(loss_func, d["loss_mask"])

        reported = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([micro_batch(m) for m in range(micro_batches)]),
            model=[ddp], num_microbatches=micro_batches, seq_length=seq, micro_batch_size=mbs, forward_only=False)
        sums = torch.stack([r["lm loss"] for r in reported]).sum(0)
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        squares = sum((p.main_grad.double() ** 2).sum() for p in ddp.parameters()
                      if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p))
        dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
        if dist.get_rank() == 0:
            json.dump({"loss": float(sums[0] / sums[1]), "grad_norm": float(squares.sqrt())},
                      open(os.path.join(out, "step.json"), "w"))
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
""")


def first_step_against_megatron_core(setup, samples, trestle, tmp_path, *, harness, edits, hf, config_class,
                                     architecture, family, layouts, port, extra=(), rel=(1e-5, 1e-5), data=None):
    """megatron-core's GPTModel built by `harness` (a reference script's builder, `edits` applied: no dropout, the
    keyword arguments MCORE_STEP passes) from the Hugging Face config `hf`, saved as torch_dist, then one step on the
    first global batch; `trestle train --load` of that checkpoint at each of `layouts` must log the same loss and
    gradient norm (`rel`: their relative tolerances, 1e-5 each). `extra`: more flags for trestle train; `data`: the
    dataset prefix the samples come from (the KJV corpus by default). Samples with attention masks pass them on."""
    import test_megatron_dist_convert as mdc
    import transformers
    builder = harness.split("\ndef main():")[0]
    for old, new in edits:
        assert old in builder, f"the megatron-core harness changed: no {old!r}"
        builder = builder.replace(old, new)
    script = tmp_path / "mcore_step.py"
    script.write_text(builder + MCORE_CPU_PATCHES + loop.MCORE_STEP)
    keys = ("tokens", "labels", "loss_mask", *(("attention_mask",) if "attention_mask" in samples[0][0] else ()))
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples[0][:GBS]]) for k in keys}
    kinds = {"loss_mask": torch.float32, "attention_mask": torch.bool}
    torch.save({k: v.to(kinds.get(k, torch.long)) for k, v in batch.items()}, tmp_path / "batch.pt")
    for d in ("mc", "ref", "cfg"):
        (tmp_path / d).mkdir()
    result = mdc.reference_scripts().run([script, tmp_path / "mc", tmp_path / "ref", port, tmp_path / "batch.pt",
                                          json.dumps(hf), CLIP, json.dumps({})], timeout=mdc.MCORE_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = json.loads((tmp_path / "ref" / "step.json").read_text())
    config = getattr(transformers, config_class)(**hf)
    config.architectures = [architecture]
    config.save_pretrained(tmp_path / "cfg")
    for layout in layouts:
        world, layout_flags = LAYOUTS[layout]
        out = tmp_path / layout
        losses, _ = train(trestle, setup, family, out, *layout_flags, *extra, "--hf-config", tmp_path / "cfg",
                          "--lr-warmup-iters", 0, world=world, iters=1, load=tmp_path / "mc", data=data)
        record = json.loads((out / "log.jsonl").read_text().splitlines()[0])
        print(f"\n{family} {layout}: loss trestle {losses[1]!r} megatron-core {expected['loss']!r}, grad norm "
              f"{record['grad_norm']!r} {expected['grad_norm']!r}")
        assert loop.close(losses[1], expected["loss"], rel[0]), (layout, losses[1], expected["loss"])
        assert loop.close(record["grad_norm"], expected["grad_norm"], rel[1]), (layout, record["grad_norm"], expected)
        mtp = [record.get(f"mtp_{d + 1}_loss") for d in range(len(expected.get("mtp_losses", [])))]
        print(f"{family} {layout}: mtp losses trestle {mtp} megatron-core {expected.get('mtp_losses')}")
        assert all(m is not None and loop.close(m, e)
                   for m, e in zip(mtp, expected.get("mtp_losses", []), strict=True)), \
            (layout, mtp, expected)


def test_gpt_oss_first_step_equals_megatron_core(setup, samples, trestle, tmp_path):
    """megatron-core's own GPT-OSS GPTModel (local spec on the CPU: biases everywhere, learnable softmax offset,
    windows on every other layer, clamped quick-GELU experts with the + 1 offset, softmax after the router's top-k):
    the first step's loss and gradient norm, unparallelised, at ep 2 and with the experts' own tensor parallelism
    (whole at tp 2, where each expert's fc2 bias joins on one rank of its group; split over two data-parallel
    ranks)."""
    import test_gpt_oss_convert as goc
    hf = dict(vocab_size=4096, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              pad_token_id=0, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    first_step_against_megatron_core(
        setup, samples, trestle, tmp_path, harness=goc.MCORE_GPT_OSS,
        edits=[("def build(c, port):", "def build(c, port, **unused):"),
               ("layernorm_epsilon=1e-5)", "layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0)")],
        hf=hf, config_class="GptOssConfig", architecture="GptOssForCausalLM", family="gpt_oss",
        layouts=ci_cases(["tp1", "ep2", *EXPERT_TP_LAYOUTS], ["tp1", "tp2-sp-etp1"]), port=free_port())


# Nemotron-H with every kind of layer (Mamba, attention, MLP, MoE) as megatron-core's MambaModel builds it on the CPU
# (test_nemotron_h_convert.MCORE_MAMBA: its local layers, mamba_ssm's kernels stood in for by torch code).
MCORE_NEMOTRON_H = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=4, hybrid_override_pattern="M*-E",
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                        mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4,
                        layer_norm_epsilon=1e-5, time_step_min=1e-30, max_position_embeddings=256, pad_token_id=0,
                        tie_word_embeddings=False, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        moe_shared_expert_intermediate_size=48, routed_scaling_factor=1.5)


def test_nemotron_h_first_step_equals_megatron_core(setup, samples, trestle, tmp_path):
    """megatron-core's own MambaModel (a Mamba-2 mixer, attention alone, a squared-ReLU MLP alone, an MoE layer with
    the sigmoid router, its score bias and a shared expert): the first step's loss and gradient norm, unparallelised,
    at tp 2 with sequence parallelism (the mixer's heads and groups split), pp 2, dp 2 with the distributed optimizer,
    cp 2 (each cp rank the whole sequence for half the heads) and ep 2 (CI: tp 2 and ep 2)."""
    import test_nemotron_h_convert as nhc
    first_step_against_megatron_core(
        setup, samples, trestle, tmp_path, harness=nhc.MCORE_MAMBA,
        edits=[("def build(c, port):", "def build(c, port, **unused):"),
               ('c["pattern"]', 'c["hybrid_override_pattern"]'), ("return model.eval()",
                "torch.cuda.synchronize = lambda *a: None  # (the checkpoint writer's)\n    return None, model.train()")],
        hf=MCORE_NEMOTRON_H, config_class="NemotronHConfig", architecture="NemotronHForCausalLM",
        family="nemotron_h_moe", layouts=ci_cases(("tp1", "tp2-sp", "pp2", "dp2-distopt", "cp2", "ep2"),
                                                  ("tp2-sp", "ep2")), port=free_port())


# The multi-token-prediction families' megatron-core harnesses: (reference module, its harness, config class,
# architecture, the layouts CI runs).
MCORE_MTP_MODELS = {
    "deepseek_v3": ("test_deepseek_convert", "MCORE_MLA", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                    ("tp1", "tp2-sp", "pp2-uneven", "ep2")),
    "glm4_moe": ("test_glm4_moe_convert", "MCORE_GLM", "Glm4MoeConfig", "Glm4MoeForCausalLM", ("tp1", "ep2")),
    "qwen3_next": ("test_qwen3_next_convert", "MCORE_QWEN3_NEXT", "Qwen3NextConfig", "Qwen3NextForCausalLM",
                   ("pp2-uneven",)),
}


@pytest.mark.parametrize("family", ci_cases(MCORE_MTP_MODELS, ["deepseek_v3", "qwen3_next"]))
def test_multi_token_prediction_first_step_equals_megatron_core(setup, samples, trestle, tmp_path, family):
    """megatron-core's own GPTModels with one multi-token-prediction layer (local spec on the CPU): DeepSeek-V3's
    (multi-latent attention with low-rank queries and values narrower than the keys, a dense first layer, sigmoid
    routing limited to 2 of 2 groups with the expert bias and the routed scaling factor, shared experts) and GLM-4.5's
    (RoPE over half of each head, q/k/v biases and q/k norms, two dense first layers, sigmoid routing limited to 1 of 2
    groups, two experts' worth of shared expert) and Qwen3-Next's (the Gated DeltaNet hybrid with gated attention,
    Qwen2-MoE's experts with the gated shared expert, its MTP layer of gated attention). The first step's lm loss, MTP
    loss and gradient norm (which the MTP
    loss's gradient feeds), unparallelised, at tp 2 with sequence parallelism (MLA's latents' down projections and
    eh_proj column-parallel, as the local spec splits them), pp 2 (the MTP layer on the last stage with its copy of the
    embedding), dp 2 with the distributed optimizer, cp 2 (not over Gated DeltaNet) and ep 2 (in CI: DeepSeek-V3 at tp 1, tp 2,
    pp 2 uneven and ep 2, Qwen3-Next at pp 2 with its uneven split; GLM-4.5 at tp 1 and ep 2 in the full run)."""
    import importlib
    module, harness, config_class, architecture, ci_layouts = MCORE_MTP_MODELS[family]
    reference = importlib.import_module(module)
    hf = dict(reference.MCORE_MODEL, vocab_size=4096)
    assert hf["num_nextn_predict_layers"] == 1
    first_step_against_megatron_core(
        setup, samples, trestle, tmp_path, harness=getattr(reference, harness),
        edits=[("def build(c, port):", "def build(c, port, **unused):"),
               ("mtp_num_layers=1,", "mtp_num_layers=1, hidden_dropout=0.0, attention_dropout=0.0,")],
        hf=hf, config_class=config_class, architecture=architecture, family=family,
        layouts=ci_cases([layout for layout in LAYOUTS_MCORE_MTP if layout != "cp2" or family not in LINEAR_ATTENTION],
                         ci_layouts), port=free_port())


DOCUMENT_MCORE_CASES = ci_cases([("nemotron_h", layout) for layout in ("tp1", "tp2-sp", "cp2")] +
                                [("deepseek_v3", layout) for layout in ("tp1", "tp2-sp", "pp2-uneven")],
                                [("nemotron_h", "cp2"), ("deepseek_v3", "pp2-uneven")])


@pytest.mark.parametrize("family,layout", DOCUMENT_MCORE_CASES)
def test_documents_masked_first_step_equals_megatron_core(setup, trestle, tmp_path, document_samples, family, layout):
    """--reset-attention-mask against megatron-core's own models given GPTDataset's document masks: its MambaModel
    (the mask reaches the attention layer; the Mamba-2 mixer, as megatron-core's, ignores it; under cp 2 each rank runs
    the mixer over the whole sequence and the ring masks attention by document) and DeepSeek-V3's GPTModel with its
    multi-token-prediction layer (multi-latent attention; the MTP layer masked by the same documents, as megatron-core
    passes it the unshifted mask). The first step's loss, MTP loss and gradient norm."""
    import importlib
    data, samples = document_samples
    if family == "nemotron_h":
        import test_nemotron_h_convert as nhc
        harness, hf, config_class, architecture = nhc.MCORE_MAMBA, MCORE_NEMOTRON_H, "NemotronHConfig", \
            "NemotronHForCausalLM"
        edits = [("def build(c, port):", "def build(c, port, **unused):"),
                 ('c["pattern"]', 'c["hybrid_override_pattern"]'), ("return model.eval()",
                  "torch.cuda.synchronize = lambda *a: None  # (the checkpoint writer's)\n    return None, model.train()")]
        family = "nemotron_h_moe"
    else:
        module, harness_name, config_class, architecture, _ = MCORE_MTP_MODELS[family]
        reference = importlib.import_module(module)
        harness, hf = getattr(reference, harness_name), dict(reference.MCORE_MODEL, vocab_size=4096)
        edits = [("def build(c, port):", "def build(c, port, **unused):"),
                 ("mtp_num_layers=1,", "mtp_num_layers=1, hidden_dropout=0.0, attention_dropout=0.0,")]
    first_step_against_megatron_core(
        setup, (samples,), trestle, tmp_path, harness=harness, edits=edits, hf=hf, config_class=config_class,
        architecture=architecture, family=family, layouts=[layout], port=free_port(), data=data,
        extra=("--reset-attention-mask", "--eod-token-id", 0))


@pytest.mark.parametrize("family,balancing", ci_cases([("deepseek_v3", "aux_loss"), ("glm4_moe", "aux_loss"),
                                                        ("deepseek_v3", "seq_aux_loss")],
                                                       [("glm4_moe", "aux_loss"), ("deepseek_v3", "seq_aux_loss")]))
def test_sigmoid_routers_load_balancing_loss_equals_megatron_core(setup, samples, trestle, tmp_path, family,
                                                                  balancing):
    """--moe-aux-loss-coeff with a sigmoid router (DeepSeek-V3's, GLM-4.5's): Megatron's load-balancing loss takes the
    router's own scores (sigmoid, normalised over the experts), not a softmax's; with --moe-router-load-balancing-type
    seq_aux_loss (DeepSeek-V3's sequence-wise loss) it is each sequence's, averaged over the sequences.
    megatron-core's first step with moe_aux_loss_coeff 0.1 (its harness runs the global batch of 8 sequences as one
    micro-batch, so trestle does too) gives trestle's loss and gradient norm, which the load-balancing loss's gradient
    feeds, at tp 1 and at tp 2 with sequence parallelism (the expert counts over the whole sequence)."""
    import importlib
    module, harness, config_class, architecture, _ = MCORE_MTP_MODELS[family]
    reference = importlib.import_module(module)
    first_step_against_megatron_core(
        setup, samples, trestle, tmp_path, harness=getattr(reference, harness),
        edits=[("def build(c, port):", "def build(c, port, **unused):"),
               ("mtp_num_layers=1,", "mtp_num_layers=1, hidden_dropout=0.0, attention_dropout=0.0, "
                                     f"moe_aux_loss_coeff=0.1, moe_router_load_balancing_type={balancing!r},")],
        hf=dict(reference.MCORE_MODEL, vocab_size=4096), config_class=config_class, architecture=architecture,
        family=family, layouts=ci_cases(["tp1", "tp2-sp", "tp2-sp-etp1"],
                                        ["tp1"] if family == "glm4_moe" else
                                        ["tp2-sp-etp1"] if balancing == "aux_loss" else ["tp2-sp"]),
        port=free_port(), extra=("--moe-aux-loss-coeff", "0.1", "--moe-router-load-balancing-type", balancing,
                                 "--micro-batch-size", GBS))


# global_aux_loss's layouts: (its data-parallel size, which the megatron-core world it is compared with has, and its
# world and flags). Under full recompute the counts are taken in the recomputed forwards (the first runs without
# gradients), in the order of the backward passes.
GLOBAL_AUX_LAYOUTS = {
    **{layout: (dp, *LAYOUTS[layout]) for layout, dp in (("tp1", 1), ("tp2-sp", 1), ("pp2-uneven", 1),
                                                         ("dp2-distopt", 2), ("ep2", 2), ("tp2-sp-etp1", 1),
                                                         ("dp2-etp2", 2), ("pp2-interleaved", 1))},
    "tp1-recompute": (1, 1, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                             "--recompute-num-layers", 1]),
}
GLOBAL_AUX_COEFF = "1.0"  # a large weight, so that the loss's part of the gradient norm is far above the tolerance
_schedule_steps = {}


def megatron_core_schedule_step(samples, tmp_path_factory, family, *, tp=1, dp=1, balancing="global_aux_loss",
                                per_token=False, coefficients=None, config=None):
    """megatron-core's own schedule (MCORE_SCHEDULE_STEP) on tp x dp ranks (sequence parallel at tp > 1, as Megatron
    requires of MoE) with `balancing` weighted by GLOBAL_AUX_COEFF (or a list of types with their `coefficients`), one
    iteration of GBS samples in micro-batches of MBS, from the family's megatron-core harness (`config`: more
    TransformerConfig arguments): (the directory holding its torch_dist checkpoint "mc" and the Hugging Face config
    "cfg", its step's loss and gradient norm); made once per argument set."""
    coeff = GLOBAL_AUX_COEFF if coefficients is None else list(coefficients)
    if coefficients is not None:
        balancing = list(balancing)
    config = dict(config or {})
    key = (family, tp, dp, repr(balancing), per_token, repr(coeff), repr(sorted(config.items())))
    if key in _schedule_steps:
        return _schedule_steps[key]
    import importlib
    import os
    import subprocess
    import mcore_legacy
    import test_megatron_dist_convert as mdc
    import transformers
    module, harness, config_class, architecture, _ = MCORE_MTP_MODELS[family]
    reference = importlib.import_module(module)
    hf = dict(reference.MCORE_MODEL, vocab_size=4096)
    builder = getattr(reference, harness).split("\ndef main():")[0]
    for old, new in [("def build(c, port):", "def build(c, port, **unused):"),
                     ("mtp_num_layers=1,", "mtp_num_layers=1, hidden_dropout=0.0, attention_dropout=0.0, "
                      f"moe_aux_loss_coeff={coeff}, moe_router_load_balancing_type={balancing!r}, "
                      f"calculate_per_token_loss={per_token}, " + "".join(f"{k}={v!r}, " for k, v in config.items())),
                     *mcore_legacy.WORLD_EDITS,
                     ("pipeline_dtype=torch.float32,", "pipeline_dtype=torch.float32, sequence_parallel=TP > 1,")]:
        assert old in builder, f"the megatron-core harness changed: no {old!r}"
        builder = builder.replace(old, new)
    kinds = "_".join(balancing) if isinstance(balancing, list) else balancing
    root = tmp_path_factory.mktemp(f"schedule_{family}_tp{tp}_dp{dp}_{kinds}{'_per_token' if per_token else ''}"
                                   f"{'_config' if config else ''}")
    script = root / "mcore_schedule_step.py"
    script.write_text(mcore_legacy.PRELUDE + builder + MCORE_CPU_PATCHES + MCORE_SCHEDULE_STEP)
    batch = {k: torch.stack([torch.as_tensor(s[k]) for s in samples[0][:GBS]]) for k in ("tokens", "labels", "loss_mask")}
    torch.save({k: v.float() if k == "loss_mask" else v.long() for k, v in batch.items()}, root / "batch.pt")
    for d in ("mc", "ref", "cfg"):
        (root / d).mkdir()
    port, server = str(free_port()), mdc.reference_scripts()
    children = [server.start([script, root / "mc", root / "ref", port, root / "batch.pt", json.dumps(hf), str(MBS)],
                             dict(os.environ, RANK=str(r), WORLD=str(tp * dp), TP=str(tp), PP="1", EP="1"))
                for r in range(tp * dp)]
    try:
        results = server.wait_all(children, timeout=mdc.MCORE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"megatron-core's step did not finish within {mdc.MCORE_TIMEOUT_S} s\nstderr:\n{e.stderr}")
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stderr[-3000:]}"
    config = getattr(transformers, config_class)(**hf)
    config.architectures = [architecture]
    config.save_pretrained(root / "cfg")
    _schedule_steps[key] = root, json.loads((root / "ref" / "step.json").read_text())
    return _schedule_steps[key]


@pytest.mark.parametrize("family,layout", ci_cases(
    [(family, layout) for family in ("qwen3_next", "deepseek_v3") for layout in GLOBAL_AUX_LAYOUTS
     if (family, layout) != ("deepseek_v3", "pp2-interleaved")],  # (its 3 layers do not interleave over 2 stages)
    [("qwen3_next", "dp2-distopt")]))
def test_global_load_balancing_loss_equals_megatron_core(setup, samples, trestle, tmp_path, tmp_path_factory, family,
                                                         layout):
    """--moe-router-load-balancing-type global_aux_loss (what Megatron-Bridge sets for Qwen3-Next and Qwen3.5): the
    experts' loads are counted over the data-parallel ranks too and averaged over the iteration's micro-batches so
    far, so a micro-batch's loss depends on the ones before it and on the other ranks'. megatron-core's own schedule
    runs one iteration of 4 micro-batches of 2 on one rank, or 2 on each of 2 data-parallel ranks; trestle's first
    loss and gradient norm from the same checkpoint and samples, at a layout of as many data-parallel ranks, must equal
    its within 1e-5 (the MTP layer's router included). The same step with aux_loss must not (its gradient norm is
    checked to differ by more than 1e-4: seen 1.7e-3 to 3.5e-2)."""
    dp, world, layout_flags = GLOBAL_AUX_LAYOUTS[layout]
    root, expected = megatron_core_schedule_step(samples, tmp_path_factory, family, dp=dp)
    got = {}
    for balancing in ("global_aux_loss", "aux_loss"):
        out = tmp_path / balancing
        losses, _ = train(trestle, setup, family, out, *layout_flags, "--hf-config", root / "cfg",
                          "--lr-warmup-iters", 0, "--moe-aux-loss-coeff", GLOBAL_AUX_COEFF,
                          "--moe-router-load-balancing-type", balancing, world=world, iters=1, load=root / "mc")
        got[balancing] = losses[1], json.loads((out / "log.jsonl").read_text().splitlines()[0])["grad_norm"]
        print(f"\n{family} {layout} {balancing}: loss {got[balancing][0]!r} grad norm {got[balancing][1]!r}; "
              f"megatron-core global_aux_loss: {expected}")
    loss, norm = got["global_aux_loss"]
    assert loop.close(loss, expected["loss"]), (loss, expected)
    assert loop.close(norm, expected["grad_norm"]), (norm, expected)
    assert not loop.close(got["aux_loss"][1], expected["grad_norm"], 1e-4), (got["aux_loss"], expected)


CAPACITY_CASES = {  # name: (megatron-core's TransformerConfig arguments, trestle train's flags)
    "probs": (dict(moe_expert_capacity_factor=1.0), ("--moe-expert-capacity-factor", "1.0")),
    "padded": (dict(moe_expert_capacity_factor=1.25, moe_pad_expert_input_to_capacity=True),
               ("--moe-expert-capacity-factor", "1.25", "--moe-pad-expert-input-to-capacity")),
}


@pytest.mark.parametrize("family,layout,case", ci_cases(
    [(family, layout, case) for family in ("deepseek_v3", "qwen3_next")
     for layout in ("tp1", "tp2-sp", "dp2-distopt", "ep2", "tp2-sp-etp1")
     for case in CAPACITY_CASES], [("deepseek_v3", "tp2-sp", "probs")]))
def test_expert_capacity_drops_tokens_as_megatron_core(setup, samples, trestle, tmp_path, tmp_path_factory, family,
                                                       layout, case):
    """--moe-expert-capacity-factor (Megatron's token dropping): each expert keeps at most ceil(tokens x topk / experts
    x factor) of the tokens each rank's router sees (the micro-batch's, this rank's sequence-parallel slice of it at
    tp 2), the rest dropped by the lowest probability, and with padding each expert computes its capacity of rows.
    megatron-core's own schedule (4 micro-batches of 2 on one rank, the same at tp 2 with sequence parallelism, 2 on
    each of 2 data-parallel ranks; trestle also at ep 2 and with whole experts beside tp 2, whose routers see the same
    tokens; aux_loss 1.0, which reads the undropped scores) gives trestle's first loss and
    gradient norm within 1e-5; the same run without a capacity differs (so tokens were dropped). (Dropping by position
    is not compared here: megatron-core picks among the tied candidates in torch.topk's order, which is not defined;
    test_moe_router_megatron checks what Trestle keeps, the earliest.)"""
    config, flags = CAPACITY_CASES[case]
    dp, world, layout_flags = GLOBAL_AUX_LAYOUTS[layout]
    tp = 2 if layout.startswith("tp2") else 1
    root, expected = megatron_core_schedule_step(samples, tmp_path_factory, family, tp=tp, dp=dp,
                                                 balancing="aux_loss", config=config)
    got = {}
    for name, extra in (("capacity", flags), ("dropless", ())):
        out = tmp_path / name
        losses, _ = train(trestle, setup, family, out, *layout_flags, "--hf-config", root / "cfg",
                          "--lr-warmup-iters", 0, "--moe-aux-loss-coeff", GLOBAL_AUX_COEFF,
                          "--moe-router-load-balancing-type", "aux_loss", *extra, world=world, iters=1,
                          load=root / "mc")
        got[name] = losses[1], json.loads((out / "log.jsonl").read_text().splitlines()[0])["grad_norm"]
        print(f"\n{family} {layout} {case} {name}: loss {got[name][0]!r} grad norm {got[name][1]!r}; "
              f"megatron-core: {expected}")
    loss, norm = got["capacity"]
    assert loop.close(loss, expected["loss"]), (loss, expected)
    assert loop.close(norm, expected["grad_norm"]), (norm, expected)
    dropless_loss, dropless_norm = got["dropless"]
    assert not (loop.close(dropless_loss, expected["loss"]) and loop.close(dropless_norm, expected["grad_norm"])), \
        ("no token was dropped", got["dropless"], expected)


def test_padded_capacity_counts_each_experts_load_as_its_capacity(setup, trestle, tmp_path):
    """With --moe-pad-expert-input-to-capacity every expert computes exactly its capacity of rows, and megatron-core
    counts those rows as the expert's load (its router's routing_map after dropping is the capacity mask), so
    DeepSeek-V3's aux-loss-free balancing sees every expert equally loaded and leaves the expert biases where they
    were; with the same capacity unpadded, the loads are the tokens kept and the biases move. Padding without a
    capacity, a capacity of 0 and an unknown drop policy are refused before the run starts."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "docs" / "examples"))
    import read_trestle

    def biases(root):
        _, tensors = read_trestle.read_checkpoint(str(root))
        return {n: torch.from_numpy(t.copy()) for n, t in tensors.items()
                if n.endswith(".mlp.router.expert_bias") and not n.startswith("optimizer.")}
    start = biases(setup / "deepseek_v3" / "ckpt")
    assert start
    for name, extra, moves in (("padded", ("--moe-pad-expert-input-to-capacity",), False), ("unpadded", (), True)):
        train(trestle, setup, "deepseek_v3", tmp_path / name, "--moe-expert-capacity-factor", "1.25", *extra,
              "--save", tmp_path / name / "ckpt", "--lr-warmup-iters", 0, iters=2)
        end = biases(tmp_path / name / "ckpt")
        assert sorted(end) == sorted(start)
        moved = [n for n in start if not torch.equal(end[n].float(), start[n].float())]
        assert bool(moved) == moves, (name, moved)
    base = ["train", "--data-path", setup / "data" / "kjv_text_document", "--micro-batch-size", MBS,
            "--global-batch-size", GBS, "--seq-length", SEQ, "--train-iters", 1, "--lr", LR,
            "--load", setup / "deepseek_v3" / "ckpt"]
    for flags, message in ((["--moe-pad-expert-input-to-capacity"], "needs --moe-expert-capacity-factor"),
                           (["--moe-expert-capacity-factor", "0"], "0 would drop them all"),
                           (["--moe-expert-capacity-factor", "1", "--moe-token-drop-policy", "last"],
                            "--moe-token-drop-policy last: probs or position")):
        run = trestle.run_raw(*base, *flags, timeout=120)
        assert run.returncode == 2 and message in run.stderr, (flags, run.returncode, run.stderr[-2000:])


@pytest.mark.parametrize("family,balancing", ci_cases(
    [(family, balancing) for family in ("deepseek_v3", "qwen3_next")
     for balancing in ("aux_loss", "seq_aux_loss", "global_aux_loss")], [("qwen3_next", "aux_loss")]))
def test_per_token_load_balancing_at_tp2_with_sequence_parallelism_equals_megatron_core(
        setup, samples, trestle, tmp_path, tmp_path_factory, family, balancing):
    """--calculate-per-token-loss with a load-balancing loss at tp 2 with sequence parallelism: each rank's router sees
    half of each sequence, and megatron-core scales its loss's gradient by the tokens it routed (num_local_tokens)
    before dividing every gradient by the global batch's counted tokens. megatron-core's own schedule at tp 2 (2
    ranks, 4 micro-batches) and trestle at tp 2 with sequence parallelism, from its checkpoint, must give the same
    first loss and gradient norm within 1e-5 (seen: Qwen3-Next within 2e-8; DeepSeek-V3 within 3e-6, as far as it is
    without any load-balancing loss in this harness, whose torch norms stand in for Transformer Engine's under
    sequence parallelism)."""
    root, expected = megatron_core_schedule_step(samples, tmp_path_factory, family, tp=2, balancing=balancing,
                                                 per_token=True)
    losses, _ = train(trestle, setup, family, tmp_path, TP, 2, "--sequence-parallel", "--hf-config", root / "cfg",
                      "--lr-warmup-iters", 0, "--moe-aux-loss-coeff", GLOBAL_AUX_COEFF,
                      "--moe-router-load-balancing-type", balancing, "--calculate-per-token-loss", world=2, iters=1,
                      load=root / "mc")
    norm = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])["grad_norm"]
    print(f"\n{family} tp2-sp per-token {balancing}: loss {losses[1]!r} grad norm {norm!r}; megatron-core {expected}")
    assert loop.close(losses[1], expected["loss"]), (losses[1], expected)
    assert loop.close(norm, expected["grad_norm"]), (norm, expected)


def test_weight_decay_on_the_query_and_key_norms_trains_as_megatron(setup, samples, trestle, tmp_path):
    """--apply-wd-to-qk-layernorm (Megatron's rule for Qwen3-Next; its functional tests' Gated DeltaNet model uses it):
    the query and key norms' weights join the decayed group, the other norms and biases do not. OLMo 2's (plain RMSNorm
    weights near 1, so their decay shows; a weight decay of 10 for all) trained by transformers with q_norm and k_norm
    decayed gives trestle's 20 losses within 1e-6 (seen 3e-8 at the last); without them decayed the last differs by
    more than 1e-5 (seen 2.8e-5)."""
    wd = 10.0  # strong, so that the norms' decay moves the losses well past the tolerance

    def reference(norms):
        return train_transformers(setup / "olmo2" / "hf", samples[0], iters=ITERS, global_batch=GBS, micro_batch=MBS,
                                  lr=LR, min_lr=MIN_LR, warmup_iters=WARMUP, weight_decay=wd, clip_grad=CLIP,
                                  beta2=BETA2, decayed_norms=norms)
    expected, plain = reference((".q_norm.", ".k_norm.")), reference(())
    assert not loop.close(expected[ITERS], plain[ITERS], 1e-5), "the norms' decay trains alike: nothing tested"
    losses, _ = train(trestle, setup, "olmo2", tmp_path, "--apply-wd-to-qk-layernorm", "--weight-decay", wd)
    print(f"\nolmo2 --apply-wd-to-qk-layernorm: trestle {losses[ITERS]!r} transformers {expected[ITERS]!r} "
          f"(without: {plain[ITERS]!r})")
    bad = {i: (losses[i], expected[i]) for i in expected if not loop.close(losses[i], expected[i], 1e-6)}
    assert sorted(losses) == sorted(expected) and not bad, bad


@pytest.mark.parametrize("family", ci_cases(["qwen3_next", "deepseek_v3"], ["qwen3_next"]))
def test_several_load_balancing_losses_equal_megatron_core(setup, samples, trestle, tmp_path, tmp_path_factory,
                                                           family):
    """--moe-router-load-balancing-type aux_loss seq_aux_loss global_aux_loss with --moe-aux-loss-coeff 0.3 0.5 1.0:
    each type adds its own loss with its coefficient, as megatron-core's router applies them in turn. Its own
    schedule on 2 data-parallel ranks and trestle at dp 2 with the distributed optimizer give the same first loss and
    gradient norm within 1e-5; without the seq_aux_loss term trestle's gradient norm differs."""
    types, coefficients = ("aux_loss", "seq_aux_loss", "global_aux_loss"), ("0.3", "0.5", "1.0")
    root, expected = megatron_core_schedule_step(samples, tmp_path_factory, family, dp=2, balancing=types,
                                                 coefficients=[float(c) for c in coefficients])
    got = {}
    for name, kinds, values in (("all", types, coefficients), ("two", types[::2], coefficients[::2])):
        out = tmp_path / name
        losses, _ = train(trestle, setup, family, out, *LAYOUTS["dp2-distopt"][1], "--hf-config", root / "cfg",
                          "--lr-warmup-iters", 0, "--moe-router-load-balancing-type", *kinds, "--moe-aux-loss-coeff",
                          *values, world=2, iters=1, load=root / "mc")
        got[name] = losses[1], json.loads((out / "log.jsonl").read_text().splitlines()[0])["grad_norm"]
    print(f"\n{family} dp2 {types} {coefficients}: trestle {got}; megatron-core {expected}")
    assert loop.close(got["all"][0], expected["loss"]), (got, expected)
    assert loop.close(got["all"][1], expected["grad_norm"]), (got, expected)
    assert not loop.close(got["two"][1], expected["grad_norm"], 1e-4), (got, expected)


def test_global_load_balancing_counts_start_afresh_each_iteration(setup, samples, trestle, tmp_path,
                                                                  tmp_path_factory):
    """global_aux_loss's running counts cover one iteration's micro-batches, as megatron-core's finalize_model_grads
    resets them: a run resumed from its iteration-2 checkpoint (a new process, no counts) logs iteration 3's loss and
    gradient norm bit for bit as the uninterrupted run does, which it would not if the counts carried over."""
    root, _ = megatron_core_schedule_step(samples, tmp_path_factory, "qwen3_next")
    flags = ("--hf-config", root / "cfg", "--lr-warmup-iters", 0, "--moe-aux-loss-coeff", GLOBAL_AUX_COEFF,
             "--moe-router-load-balancing-type", "global_aux_loss")

    def records(out):
        return {r["iteration"]: (r["lm_loss"], r["grad_norm"])
                for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "validation" not in r}

    train(trestle, setup, "qwen3_next", tmp_path / "whole", *flags, "--save", tmp_path / "saved", "--save-interval", 2,
          iters=3, load=root / "mc")
    train(trestle, setup, "qwen3_next", tmp_path / "resumed", *flags, "--ckpt-step", 2, iters=3,
          load=tmp_path / "saved")
    whole, resumed = records(tmp_path / "whole"), records(tmp_path / "resumed")
    print(f"\nuninterrupted {whole}\nresumed {resumed}")
    assert sorted(resumed) == [3]
    assert resumed[3] == whole[3]


@pytest.mark.parametrize("layout", ci_cases(["tp1", "tp2-sp"], ["tp1"]))
def test_bf16_first_step_with_an_fp32_router_near_megatron_core(setup, samples, trestle, tmp_path, layout):
    """--bf16 with --moe-router-dtype fp32 (DeepSeek-V3's example script): megatron-core's own DeepSeek-V3 in bf16 with
    moe_router_dtype fp32, its first step from the same bf16 checkpoint. bf16's rounding (which megatron-core and
    Trestle meet in other orders: it applies the routing probabilities before fc2, Trestle after) leaves the losses
    within 1e-5 relative and the gradient norms within 1e-3 (seen: 6.8e-6 and 3.7e-4 at tp 1, 6.6e-6 and 6.6e-4 at
    tp 2 with sequence parallelism; 6.3e-6 and 2.8e-4 at tp 1 with both routers in bf16). The router's precision
    itself moved megatron-core's loss by 3.4e-6 relative here, less than that rounding, so the fp32 router is told
    apart in test_expert_bias_balances_in_fp32_under_bf16 (same weights, other losses)."""
    import importlib
    module, harness, config_class, architecture, _ = MCORE_MTP_MODELS["deepseek_v3"]
    reference = importlib.import_module(module)
    first_step_against_megatron_core(
        setup, samples, trestle, tmp_path, harness=getattr(reference, harness),
        edits=[("def build(c, port):", "def build(c, port, **unused):"),
               ("params_dtype=torch.float32)", "params_dtype=torch.bfloat16, bf16=True, moe_router_dtype='fp32', "
                                               "hidden_dropout=0.0, attention_dropout=0.0)")],
        hf=dict(reference.MCORE_MODEL, vocab_size=4096), config_class=config_class, architecture=architecture,
        family="deepseek_v3", layouts=[layout], port=free_port(),
        extra=("--bf16", "--moe-router-dtype", "fp32", "--micro-batch-size", GBS), rel=(1e-5, 1e-3))


# The families whose releases hold a multi-token-prediction layer that transformers drops, and how it is added to the
# family's tiny model: DeepSeek-V3's model.layers.4.*, Qwen3-Next's mtp.* (a gated full-attention MoE layer behind the
# Gated DeltaNet hybrid).
def _add_deepseek_mtp(src, dst):
    import test_deepseek_convert as dsc
    dsc.add_mtp_layer(src, dst)


def _add_qwen3_next_mtp(src, dst):
    import test_qwen3_next_convert as qnc
    qnc.add_mtp_layer(str(src), str(dst))


MTP_FAMILIES = {"deepseek_v3": _add_deepseek_mtp, "qwen3_next": _add_qwen3_next_mtp}
_mtp_models = {}


def mtp_family_model(setup, trestle, tmp_path_factory, family):
    """The family's model with its MTP layer, converted (root / "ckpt"), and its 10 iterations at tp 1:
    (root, {iteration: (lm loss, mtp_1 loss)}); made once per module."""
    if family not in _mtp_models:
        root = tmp_path_factory.mktemp(f"mtp_{family}")
        MTP_FAMILIES[family](setup / family / "hf", root / "hf")
        trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "ckpt", "--quiet")
        _mtp_models[family] = root, mtp_train(trestle, setup, root, root / "tp1", family=family)
    return _mtp_models[family]


@pytest.fixture(scope="module")
def mtp_model(setup, trestle, tmp_path_factory):
    """DeepSeek-V3's with its MTP layer (the tests below that follow one family)."""
    return mtp_family_model(setup, trestle, tmp_path_factory, "deepseek_v3")


MTP_ITERS = 10


def model_tensors(root):
    """A Trestle checkpoint's model tensors (no optimizer state), read by the format's reference reader."""
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "docs" / "examples"))
    import read_trestle
    _, tensors = read_trestle.read_checkpoint(str(root))
    return {n: t for n, t in tensors.items() if not n.startswith("optimizer.")}


def mtp_train(trestle, setup, root, out, *extra, world=1, load=None, iters=MTP_ITERS, family="deepseek_v3"):
    train(trestle, setup, family, out, *extra, world=world, load=load or root / "ckpt", iters=iters)
    return {r["iteration"]: (r["lm_loss"], r.get("mtp_1_loss"))
            for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "validation" not in r}


@pytest.mark.parametrize("family,layout", ci_cases(
    [("deepseek_v3", layout) for layout in ("tp2-sp", "pp2", "pp2-interleaved", "cp2", "ep2")] +
    [("qwen3_next", layout) for layout in ("tp2-sp", "pp2", "ep2")],
    [("deepseek_v3", "pp2-interleaved"), ("deepseek_v3", "ep2")]))
def test_multi_token_prediction_in_every_layout(setup, trestle, tmp_path, tmp_path_factory, family, layout):
    """DeepSeek-V3 and Qwen3-Next (its MTP layer behind the Gated DeltaNet hybrid) with their MTP layers train in every
    layout as at tp 1: every logged lm loss and mtp_1 loss within 1e-5 (megatron-core's own MTP fixes the first step
    above, dp 2 with the distributed optimizer included; this follows 10 steps of MTP gradients; pp 2: the MTP layer
    on the last stage with its copy of the embedding). cp 2 follows megatron-core's rule for the MTP loss under
    context parallelism, each rank's own mean: within 1e-3 of tp 1, the same model before the first real step."""
    root, expected = mtp_family_model(setup, trestle, tmp_path_factory, family)
    assert all(m is not None for _, m in expected.values()), expected
    world, extra = LAYOUTS[layout]
    got = mtp_train(trestle, setup, root, tmp_path / layout, *extra, world=world, family=family)
    assert sorted(got) == sorted(expected)
    if layout == "cp2":
        # megatron-core's rule: each cp rank's MTP loss is the mean over its own tokens, and the rank holding the
        # sequence's last chunk counts one token fewer (none ahead of the last). The first step (learning rate 0 in
        # the warmup) leaves the model as it is: the lm losses of iterations 1 and 2 are tp 1's, the MTP losses the
        # mean of the ranks' means, close to but not tp 1's mean over every token; the steps after follow closely.
        for i in (1, 2):
            assert loop.close(got[i][0], expected[i][0]), (i, got[i], expected[i])
            assert got[i][1] != expected[i][1] and loop.close(got[i][1], expected[i][1], rel=1e-3), \
                (i, got[i], expected[i])
        bad = {i: (got[i], expected[i]) for i in expected
               if not (loop.close(got[i][0], expected[i][0], rel=1e-3) and
                       loop.close(got[i][1], expected[i][1], rel=1e-3))}
    else:
        bad = {i: (got[i], expected[i]) for i in expected
               if not (loop.close(got[i][0], expected[i][0]) and loop.close(got[i][1], expected[i][1]))}
    assert not bad, f"{layout}: (lm, mtp) losses differ from tp 1's at {bad}"


def test_multi_token_prediction_trains_resumes_exports(setup, samples, trestle, tmp_path, mtp_model):
    """The MTP loss is logged as Megatron logs it (console "mtp_1 loss:", JSON mtp_1_loss) and falls; MTP's gradient
    changes the model's training; a run saved at iteration 5 resumes bit-exactly; the checkpoint exports to Hugging Face
    with the MTP layer as model.layers.4.* (and its embedding and head copies), which converts back to the same
    tensors; --mtp-num-layers 0 trains the same model without it, and a count the checkpoint lacks is refused."""
    root, losses = mtp_model
    assert all(m is not None for _, m in losses.values()), losses
    assert losses[MTP_ITERS][1] < losses[1][1] - 0.05, f"the MTP loss does not go down: {losses}"
    # Without MTP the first forward is the same model's, then the missing MTP gradient changes the steps.
    plain = mtp_train(trestle, setup, root, tmp_path / "plain", "--mtp-num-layers", 0, "--save", tmp_path / "plain_ckpt")
    assert all(m is None for _, m in plain.values())
    assert plain[1][0] == losses[1][0] and abs(plain[MTP_ITERS][0] - losses[MTP_ITERS][0]) > 1e-4, (plain, losses)
    assert not any(n.startswith("mtp.") for n in model_tensors(tmp_path / "plain_ckpt"))
    # Saved at 5, resumed: bit-exact.
    full = mtp_train(trestle, setup, root, tmp_path / "full", "--save", tmp_path / "full_ckpt")
    assert full == losses
    mtp_train(trestle, setup, root, tmp_path / "first", "--save", tmp_path / "part", "--exit-interval", 5)
    resumed = mtp_train(trestle, setup, root, tmp_path / "resumed", "--save", tmp_path / "part", load=tmp_path / "part")
    assert resumed == {i: losses[i] for i in range(6, MTP_ITERS + 1)}
    trestle.run("diff", tmp_path / "full_ckpt", tmp_path / "part", "--quiet")
    # Exported with its MTP layer, which reads back as the same tensors.
    trestle.run("convert", "--from", "trestle", tmp_path / "part", "--to", "hf", tmp_path / "hf", "--quiet")
    from models import load_hf_tensors
    exported = load_hf_tensors(tmp_path / "hf")
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
                 "shared_head.head.weight"):
        assert "model.layers.4." + name in exported, name
    assert torch.equal(exported["model.layers.4.embed_tokens.weight"], exported["model.embed_tokens.weight"])
    trestle.run("convert", "--from", "hf", tmp_path / "hf", "--to", "trestle", tmp_path / "back", "--quiet")
    trained, back = model_tensors(tmp_path / "part"), model_tensors(tmp_path / "back")
    assert sorted(trained) == sorted(back) and any(n.startswith("mtp.layers.0.") for n in trained)
    assert all((trained[n] == back[n]).all() for n in trained)
    # LoRA on it: the MTP layer stays frozen, said so, and its loss is still logged.
    lora = trestle.run("train", "--pretrained-checkpoint", root / "ckpt", "--lora-rank", 2, "--data-path",
                       setup / "data" / "kjv_text_document", "--split", "98,2,0", "--micro-batch-size", MBS,
                       "--global-batch-size", GBS, "--seq-length", SEQ, "--train-iters", 2, "--lr", LR,
                       "--log-interval", 1, "--eval-iters", 0, "--log-json", tmp_path / "lora.jsonl")
    assert "the 1 multi-token-prediction layer(s) stay frozen" in lora, lora
    assert all("mtp_1_loss" in json.loads(line) for line in (tmp_path / "lora.jsonl").read_text().splitlines())
    # A count the checkpoint does not hold.
    result = trestle.run_raw("train", "--mtp-num-layers", 2, "--load", root / "ckpt", "--data-path", "unused",
                             "--micro-batch-size", 1, "--global-batch-size", 1, "--seq-length", SEQ,
                             "--train-iters", 1, "--lr", LR)
    assert result.returncode != 0 and "--mtp-num-layers 2" in result.stderr and "has 1 multi-token-prediction" in \
        result.stderr, result.stderr


def test_multi_token_prediction_from_scratch(setup, trestle, tmp_path):
    """--model-config with --mtp-num-layers 1: Megatron's initialisation gives lm and MTP losses near log(vocab), the
    same at tp 1 and tp 2, and the console line carries the MTP loss as Megatron prints it."""
    runs = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        out.mkdir()
        stdout = trestle.run("train", "--nproc-per-node", tp, TP, tp, "--model-config",
                             setup / "deepseek_v3" / "hf" / "config.json", "--mtp-num-layers", 1,
                             "--data-path", setup / "data" / "kjv_text_document", "--split", "98,2,0",
                             "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", SEQ,
                             "--train-iters", 2, "--lr", "1e-3", "--log-interval", 1, "--eval-iters", 0,
                             "--log-json", out / "log.jsonl", timeout=300)
        runs[tp] = [(r["lm_loss"], r["mtp_1_loss"]) for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())]
        assert " mtp_1 loss: " in stdout, stdout[-2000:]
    assert len(runs[1]) == 2
    for lm, mtp in runs[1]:
        assert abs(lm - math.log(COMMON["vocab_size"])) < 0.5 and abs(mtp - math.log(COMMON["vocab_size"])) < 0.5
    assert all(loop.close(a[0], b[0]) and loop.close(a[1], b[1]) for a, b in zip(runs[2], runs[1], strict=True)), runs


def test_bench_train_arch_trains_each_family_beside_transformers(trestle, tmp_path):
    """`bench train --arch` builds the family's model for both trainers from one config.json: both start near
    log(vocab) and report their rates, and an unknown family is a usage error naming the ones it knows."""
    # The most involved configs (every family trains above); CI builds one.
    for arch in ci_cases(["gpt_oss", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5", "nemotron_h", "gemma4"],
                         ["deepseek_v3"]):
        report = tmp_path / f"{arch}.json"
        out = trestle.run("bench", "train", "--arch", arch, "--hidden", 64, "--layers", 2, "--ffn", 96, "--heads", 4,
                          "--kv-heads", 2, "--experts", 4, "--seq-length", 32, "--iters", 3, "--warmup", 1,
                          "--python", sys.executable, "--json", report, timeout=300)
        result = json.loads(report.read_text())
        assert result["arch"] == arch and f"bench train: {arch} " in out, out
        for side in ("trestle", "pytorch"):
            assert result[side]["tokens_per_s"] > 0, (arch, side, result[side])
            assert abs(result[side]["losses"][0] - math.log(COMMON["vocab_size"])) < 0.5, (arch, side, result[side])
    bad = trestle.run_raw("bench", "train", "--arch", "gemma9")
    assert bad.returncode == 2 and "gemma2, gemma3" in bad.stderr, bad.stderr


def test_bench_train_presets_report_mfu_and_peak_memory(trestle, tmp_path):
    """`bench train --preset` (the GPU figures' shapes: llama-1b, mixtral-small) runs with smaller sizes given on the
    command line overriding the preset's, both sides in bf16; with --peak-tflops each side's MFU (one FLOP count, so
    their ratio is the inverse of their time ratio) and peak memory are reported; an unknown preset is a usage error."""
    report = tmp_path / "mixtral.json"
    out = trestle.run("bench", "train", "--preset", "mixtral-small", "--hidden", 64, "--layers", 1, "--ffn", 96,
                      "--heads", 4, "--kv-heads", 2, "--experts", 4, "--vocab", 4608, "--seq-length", 32,
                      "--micro-batch-size", 1, "--global-batch-size", 2, "--iters", 3, "--warmup", 1,
                      "--peak-tflops", 1, "--python", sys.executable, "--json", report, timeout=300)
    result = json.loads(report.read_text())
    assert result["preset"] == "mixtral-small" and result["arch"] == "mixtral" and result["dtype"] == "bf16"
    assert result["sizes"]["experts"] == 4 and result["sizes"]["vocab"] == 4608 and result["seq_length"] == 32
    assert "(--preset mixtral-small)" in out and "MFU against 1.0" in out, out
    ours, theirs = result["trestle"], result["pytorch"]
    assert ours["mfu"] > 0 and ours["peak_memory_bytes"] > 0 and theirs["peak_memory_bytes"] > 0, result
    assert math.isclose(ours["mfu"] / theirs["mfu"], ours["tokens_per_s"] / theirs["tokens_per_s"], rel_tol=1e-9)
    report = tmp_path / "llama.json"
    out = trestle.run("bench", "train", "--preset", "llama-1b", "--hidden", 64, "--layers", 1, "--ffn", 96, "--heads",
                      4, "--kv-heads", 2, "--vocab", 4608, "--seq-length", 32, "--micro-batch-size", 1,
                      "--global-batch-size", 2, "--iters", 3, "--warmup", 1, "--with-composites", "--python",
                      sys.executable, "--json", report, timeout=300)
    result = json.loads(report.read_text())
    fused, composite = result["trestle"], result["trestle_no_fused_kernels"]
    assert "trestle train (--no-fused-kernels)" in out and "fused kernels' gain" in out, out
    assert len(composite["losses"]) == 3 and composite["tokens_per_s"] > 0 and composite["peak_memory_bytes"] > 0
    assert math.isclose(composite["fused_kernels_gain"], fused["tokens_per_s"] / composite["tokens_per_s"])
    # The same model from the same seed: in bf16 the two computations round apart, but start at the same loss.
    assert math.isclose(fused["losses"][0], composite["losses"][0], rel_tol=1e-2), (fused, composite)
    bad = trestle.run_raw("bench", "train", "--with-composites", "--no-fused-kernels")
    assert bad.returncode == 2 and "give one of them" in bad.stderr, bad.stderr
    bad = trestle.run_raw("bench", "train", "--preset", "llama-70b")
    assert bad.returncode == 2 and "llama-1b or mixtral-small" in bad.stderr, bad.stderr
    bad = trestle.run_raw("bench", "train", "--vocab", 512)
    assert bad.returncode == 2 and "below the corpus tokenizer's 4096 ids" in bad.stderr, bad.stderr


@pytest.mark.parametrize("family,world,extra,needle", [
    ("qwen3_5", 2, [], "GatedDeltaNet has none, and neither has trestle train; use --context-parallel-size 1"),
    ("nemotron_h", 4, [TP, 2, "--sequence-parallel"], "times context parallelism 2 does not divide the Mamba mixers'")])
def test_context_parallelism_refused_where_megatron_core_has_none(setup, trestle, tmp_path, family, world, extra,
                                                                   needle):
    """megatron-core's GatedDeltaNet has no context parallelism, nor has the trainer's; its MambaContextParallel splits
    each mixer's heads and groups over the cp ranks, which tp 2 x cp 2 cannot do with two groups: both are refused
    naming the layers and the way out, before any step."""
    result = trestle.run_raw("train", "--nproc-per-node", world, "--context-parallel-size", 2, *extra,
                             "--load", setup / family / "ckpt", "--data-path", setup / "data" / "kjv_text_document",
                             "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", SEQ,
                             "--train-iters", 1, "--lr", LR, "--log-json", tmp_path / "log.jsonl")
    assert result.returncode != 0, result.stdout[-2000:]
    assert needle in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "log.jsonl").exists() or not (tmp_path / "log.jsonl").read_text().strip()


# CI: the dense model (per-layer inputs and KV sharing); GptModelTest.RecomputeGivesTheSameLossAndGradients covers
# per-layer inputs alone.
@pytest.mark.parametrize("family", ci_cases(["gemma4", "gemma4_pli"], ["gemma4"]))
def test_gemma4_under_recompute(setup, samples, trestle, tmp_path, family):
    """Under --recompute-granularity full Gemma 4's per-layer inputs reach each recomputed layer as an input of its own,
    and the shared keys and values are an output of the recompute of the layer that makes them and an input of those
    of the layers that reuse them: the 20 losses are transformers'."""
    expected = transformers_losses(setup, samples, family)
    losses, _ = train(trestle, setup, family, tmp_path, "--recompute-granularity", "full")
    assert_close(losses, expected, f"{family} under activation recompute")


# A vision-language model trains its language model on text, its vision tower carried frozen. CI: tp 2 with sequence
# parallelism (the tower replicated over tp, saved once).
VISION_LANGUAGE = ci_cases([(model, layout) for model in ("qwen3_vl", "qwen3_vl_moe", "gemma3_vl", "gemma4_multimodal")
                            for layout in ("tp1", "tp2-sp", "pp2", "dp2-distopt", "ep2") if
                            (layout == "ep2") == (model == "qwen3_vl_moe") or layout == "tp1"],
                           [("qwen3_vl", "tp2-sp"), ("gemma3_vl", "pp2")])
_vision_language = {}


def vision_language_model(samples, trestle, tmp_path_factory, model):
    """A tiny Qwen3-VL (dense or MoE), Gemma 3 with vision or Gemma 4 with vision and audio (their convert tests'
    models, with the corpus's vocabulary; Gemma 4's text the gemma4 family's) converted, and transformers' 20 losses
    of its text with the towers frozen: (root, losses), made once per module."""
    if model not in _vision_language:
        import test_gemma3_vl_convert
        import test_gemma4_convert
        import test_qwen3_vl_convert
        import test_qwen3_vl_moe_convert
        root = tmp_path_factory.mktemp(model)
        vocab = COMMON["vocab_size"]
        if model == "gemma4_multimodal":
            test_gemma4_convert.save_tiny_gemma4_multimodal(root / "hf", 23, qk_norm_scale=0.5,
                                                            **FAMILIES["gemma4"][1])
        else:
            save = {"qwen3_vl": test_qwen3_vl_convert.save_tiny_qwen3_vl,
                    "qwen3_vl_moe": test_qwen3_vl_moe_convert.save_tiny_qwen3_vl_moe,
                    "gemma3_vl": test_gemma3_vl_convert.save_tiny_gemma3_vl}[model]
            save(root / "hf", 23, vocab_size=vocab)
        trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "ckpt", "--quiet")
        losses = train_transformers(
            root / "hf", samples[0], iters=ITERS, global_batch=GBS, micro_batch=MBS, lr=LR, min_lr=MIN_LR,
            warmup_iters=WARMUP, weight_decay=WD, clip_grad=CLIP, beta2=BETA2)
        assert losses[ITERS] < losses[1] - 0.05, f"{model}: transformers' loss does not go down: {losses}"
        _vision_language[model] = root, losses
    return _vision_language[model]


@pytest.mark.parametrize("model,layout", VISION_LANGUAGE)
def test_vision_language_model_trains_its_text(setup, samples, trestle, tmp_path, tmp_path_factory, model, layout):
    """Qwen3-VL (dense and MoE: tp 1 and ep 2), Gemma 3 with vision and Gemma 4 with vision and audio train on text
    as transformers' models do given no image (Qwen3-VL's M-RoPE is plain RoPE over text positions; Gemma 3's mask is
    causal where there is no image), the towers, embedders and projector frozen: every logged loss equals transformers' (1e-5); the checkpoint saved at
    the end holds the tower exactly as converted while the language model moved, and exported to Hugging Face gives
    transformers the trainer's validation loss."""
    from models import load_hf_tensors
    root, expected = vision_language_model(samples, trestle, tmp_path_factory, model)
    world, extra = LAYOUTS[layout]
    losses, valid = train(trestle, setup, model, tmp_path / "run", *extra, "--save", tmp_path / "ckpt",
                          "--save-interval", ITERS, "--eval-iters", 2, world=world, load=root / "ckpt")
    assert_close(losses, expected, f"{model}'s text at {layout}")
    trestle.run("convert", "--from", "trestle", tmp_path / "ckpt", "--to", "hf", tmp_path / "hf", "--quiet")
    source, trained = load_hf_tensors(root / "hf"), load_hf_tensors(tmp_path / "hf")
    assert sorted(trained) == sorted(source)
    tower = [n for n in source if "language_model." not in n and n != "lm_head.weight"]
    assert len(tower) > 10 and all(torch.equal(trained[n], source[n]) for n in tower)
    norm = next(n for n in source if n.endswith(("language_model.norm.weight", "language_model.model.norm.weight")))
    assert not torch.equal(trained[norm], source[norm])
    assert len(valid) == 1
    exported = loop.hf_loss(tmp_path / "hf", samples[1])
    assert loop.close(exported, valid[0]), f"{model}: transformers {exported}, trainer {valid[0]}"


def test_vision_language_model_resumes(setup, samples, trestle, tmp_path, tmp_path_factory):
    """Qwen3-VL saved at iteration 10 at tp 1 (its tower in the checkpoint beside the trained weights, without
    optimizer state): resumed at tp 1 its losses are an uninterrupted run's exactly, and the final checkpoints are
    identical; resumed at pp 2 (the tower read onto the first stage) they stay within 1e-5 of transformers'."""
    root, expected = vision_language_model(samples, trestle, tmp_path_factory, "qwen3_vl")
    full, _ = train(trestle, setup, "qwen3_vl", tmp_path / "full", "--save", tmp_path / "whole", "--save-interval", 10,
                    load=root / "ckpt")
    train(trestle, setup, "qwen3_vl", tmp_path / "first", "--save", tmp_path / "part", "--exit-interval", 10,
          load=root / "ckpt")
    resumed, _ = train(trestle, setup, "qwen3_vl", tmp_path / "resumed", "--save", tmp_path / "part",
                       "--save-interval", 10, load=tmp_path / "part")
    assert sorted(resumed) == list(range(11, ITERS + 1))
    assert all(resumed[i] == full[i] for i in resumed), (resumed, full)
    trestle.run("diff", tmp_path / "whole", tmp_path / "part", "--quiet")
    world, extra = LAYOUTS["pp2"]
    other, _ = train(trestle, setup, "qwen3_vl", tmp_path / "other", *extra, "--ckpt-step", 10, world=world,
                     load=tmp_path / "part")
    assert_close(other, {i: expected[i] for i in range(11, ITERS + 1)}, "Qwen3-VL saved at tp1, resumed at pp2")

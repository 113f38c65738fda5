"""`trestle train` takes the model-description flags of Megatron-LM's example scripts (examples/megatron_fsdp's
DeepSeek-V3, examples/mixtral, examples/gptoss, examples/llama, examples/mamba and ModelOpt's Nemotron 3 Nano,
DeepSeek-R1, Kimi-K2 and Qwen3-235B-A22B, and the Gated DeltaNet model of Megatron-LM's functional tests) and checks
them against the model it loads: tiny random `transformers` models of DeepSeek-V3 (multi-latent attention with YaRN,
sigmoid routing limited to 1 of 2 groups, a dense first layer), Mixtral, GPT-OSS (a sliding window in every other
layer, attention sinks, quick GeGLU with a clamp and an offset, YaRN), Llama 3.1 (its RoPE scaling) and Nemotron 3
(a Mamba hybrid whose pattern, mixer sizes, squared-ReLU and latent MoE the flags describe; trained in bf16 with an
fp32 router), converted by `trestle convert`. For each family one iteration
with the family's flags (and the script's no-effect flags, named in one note) trains; flags that describe another model
are refused naming the flag, the value given and the model's (exit 1); values Megatron's options cannot take, and
what Trestle does not compute (FP8, sinkhorn load balancing), are
usage errors found before the model is read (exit 2). The parsing of the pattern and tuple arguments and the rest of
the matrix are tests/tools/megatron_flags_test.cc's.
"""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from models import save_tiny_model  # noqa: E402
import test_train_families as families  # noqa: E402

CORPUS = pathlib.Path(__file__).resolve().parents[2] / "train" / "data" / "corpus"
COMMON = families.COMMON
FAMILIES = {
    "deepseek_v3": families.FAMILIES["deepseek_v3"],
    "gpt_oss": families.FAMILIES["gpt_oss"],
    "nemotron_h_moe": families.FAMILIES["nemotron_h_moe"],
    "qwen3_next": families.FAMILIES["qwen3_next"],
    "mixtral": ("MixtralConfig", dict(COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama3": ("LlamaConfig", dict(COMMON, intermediate_size=96, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   max_position_embeddings=16384, rope_theta=500000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
}
SIZES = ["--num-layers", 4, "--hidden-size", 64, "--num-attention-heads", 4, "--vocab-size", 4096,
         "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights", "--attention-dropout", 0,
         "--hidden-dropout", 0, "--use-mcore-models", "--no-masked-softmax-fusion", "--no-mmap-bin-files",
         "--tiktoken-pattern", "v2", "--no-create-attention-mask-in-dataloader", "--num-workers", 1]
# Each family's flags as its Megatron script gives them, with the values of these tiny models.
FLAGS = {
    "deepseek_v3": SIZES + [
        "--ffn-hidden-size", 96, "--moe-ffn-hidden-size", 32, "--moe-shared-expert-intermediate-size", 32,
        "--kv-channels", 128, "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear", "--qk-layernorm",
        "--position-embedding-type", "rope", "--rotary-base", 10000, "--multi-latent-attention", "--q-lora-rank", 24,
        "--kv-lora-rank", 16, "--qk-head-dim", 8, "--qk-pos-emb-head-dim", 4, "--v-head-dim", 12,
        "--rotary-scaling-factor", 4, "--mscale", "1.0", "--mscale-all-dim", "1.0", "--num-experts", 8,
        "--moe-layer-freq", "[0]*1+[1]*3", "--moe-router-topk", 2, "--moe-router-pre-softmax",
        "--moe-router-num-groups", 2, "--moe-router-group-topk", 1, "--moe-router-topk-scaling-factor", 2.5,
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-dtype", "fp32",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
        "--moe-token-dispatcher-type", "flex",
        "--moe-flex-dispatcher-backend", "hybridep", "--moe-permute-fusion", "--recompute-activations",
        "--recompute-modules", "mlp", "moe", "mla_up_proj", "layernorm", "--init-model-with-meta-device",
        "--auto-detect-ckpt-format", "--logging-level", 40,
        # ModelOpt's DeepSeek-R1 and Kimi-K2 scripts (examples/post_training/modelopt/conf)
        "--moe-shared-expert-overlap", "--moe-token-drop-policy", "probs", "--moe-layer-recompute",
        "--padded-vocab-size", 4096, "--make-vocab-size-divisible-by", 1],
    "mixtral": SIZES + [
        "--ffn-hidden-size", 32, "--group-query-attention", "--num-query-groups", 2, "--disable-bias-linear",
        "--swiglu", "--position-embedding-type", "rope", "--no-position-embedding", "--rotary-base", 1000000,
        "--num-experts", 4, "--moe-router-topk", 2, "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
        "--moe-layer-freq", 1,
        # ModelOpt's Qwen3-235B-A22B script
        "--rotary-seq-len-interpolation-factor", 1, "--export-model-type", "GPTModel", "--no-rope-freq", "[0]*4"],
    "gpt_oss": SIZES + [
        "--ffn-hidden-size", 32, "--moe-ffn-hidden-size", 32, "--group-query-attention", "--num-query-groups", 2,
        "--kv-channels", 16, "--add-qkv-bias", "--rotary-percent", "1.0", "--rope-type", "rope",
        "--position-embedding-type", "yarn", "--rotary-base", 150000, "--rotary-scaling-factor", 32, "--mscale", 1,
        "--mscale-all-dim", 0, "--yarn-original-max-position-embeddings", 4096,
        "--no-yarn-correction-range-round-to-int", "--quick-geglu", "--glu-linear-offset", "1.0",
        "--softmax-type", "learnable", "--window-attn-skip-freq", 2, "--activation-func-clamp-value", 0.2,
        "--window-size", "7,0", "--enable-gpt-oss", "--export-force-local-attention",
        "--no-rope-fusion", "--num-experts", 4, "--moe-router-topk", 2, "--moe-router-load-balancing-type",
        "aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-router-dtype", "fp32", "--moe-z-loss-coeff", "1e-3",
        "--moe-per-layer-logging", "--attention-softmax-in-fp32", "--disable-bf16-reduced-precision-matmul",
        "--recompute-activations", "--fp8-amax-history-len", 1024, "--fp8-amax-compute-algo", "max"],
    # examples/post_training/modelopt/conf/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.sh and examples/mamba/train.sh
    "nemotron_h_moe": SIZES + [
        "--hybrid-layer-pattern", "ME*E", "--mamba-num-heads", 4, "--mamba-head-dim", 8, "--mamba-state-dim", 8,
        "--mamba-num-groups", 2, "--squared-relu", "--position-embedding-type", "none", "--group-query-attention",
        "--num-query-groups", 2, "--kv-channels", 16, "--disable-bias-linear", "--ffn-hidden-size", 32,
        "--num-experts", 4, "--moe-router-topk", 2, "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor", 1.5,
        "--moe-shared-expert-intermediate-size", 48, "--moe-latent-size", 48, "--moe-router-dtype", "fp32", "--bf16",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4", "--moe-permute-fusion",
        "--use-fused-weighted-squared-relu", "--enable-experimental", "--disable-gloo-process-groups",
        "--trust-remote-code", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native",
        "--export-model-type", "HybridModel"],
    # tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp1_gdn (Megatron-LM's Gated DeltaNet model)
    "qwen3_next": SIZES + [
        "--group-query-attention", "--num-query-groups", 2, "--kv-channels", 16, "--swiglu",
        "--position-embedding-type", "rope", "--rotary-percent", 0.25, "--rotary-base", 10000, "--no-rope-fusion",
        "--norm-epsilon", "1e-6", "--apply-layernorm-1p", "--qk-layernorm", "--apply-wd-to-qk-layernorm",
        "--attention-output-gate", "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", 2,
        "--linear-conv-kernel-dim", 4, "--linear-key-head-dim", 8, "--linear-value-head-dim", 12,
        "--linear-num-key-heads", 2, "--linear-num-value-heads", 4, "--num-experts", 4, "--moe-ffn-hidden-size", 32,
        "--moe-shared-expert-intermediate-size", 48, "--moe-shared-expert-gate", "--moe-router-load-balancing-type",
        "seq_aux_loss", "global_aux_loss", "--moe-aux-loss-coeff", "1e-4", "1e-3", "--moe-router-topk", 2,
        "--disable-bias-linear",
        "--moe-router-dtype", "fp32", "--deterministic-mode", "--attention-softmax-in-fp32", "--attention-backend",
        "unfused", "--log-params-norm", "--log-num-zeros-in-grad"],
    "llama3": SIZES + [
        "--ffn-hidden-size", 96, "--group-query-attention", "--num-query-groups", 2, "--kv-channels", 16,
        "--position-embedding-type", "rope", "--rotary-base", 500000, "--rotary-percent", "1.0", "--use-rope-scaling",
        "--rope-scaling-factor", 8, "--swiglu", "--disable-bias-linear", "--attention-backend", "fused",
        "--cross-entropy-loss-fusion", "--manual-gc", "--empty-unused-memory-level", 1, "--dataloader-type", "single",
        # Megatron-LM 0.19's spellings and flags (megatron-core 0.19's training arguments)
        "--use-dist-ckpt", "--ddp-num-buckets", 2, "--cuda-graph-modules", "attn", "mlp", "--sgd-momentum", "0.9",
        "--no-one-logger", "--override-opt-param-scheduler", "--use-precision-aware-optimizer", "--exp-avg-dtype",
        "fp32", "--no-save-rng"],
}
# Flags that describe another model: (flags, the words the error holds), exit 1.
WRONG = {
    "deepseek_v3": [
        (["--q-lora-rank", 1536], "--q-lora-rank 1536 differs from the model's 24"),
        (["--qk-pos-emb-head-dim", 64], "--qk-pos-emb-head-dim 64 differs from the model's 4"),
        (["--moe-layer-freq", "[0]*3+[1]*1"], "--moe-layer-freq [0]*3+[1]*1 makes the layers [0,0,0,1] (1: MoE); the "
                                               "model's are [0,1,1,1]"),
        (["--moe-layer-freq", "([0]*1+[1]*2)"], "gives 3 layers; the model has 4"),
        (["--rotary-scaling-factor", 40], "--rotary-scaling-factor 40 differs from the model's 4"),
        (["--rope-type", "rope"], "--rope-type rope differs from the model's yarn"),
        (["--moe-router-group-topk", 2], "--moe-router-group-topk 2 differs from the model's 1"),
        (["--padded-vocab-size", 4000], "--padded-vocab-size 4000 is less than the model's vocabulary 4096")],
    "mixtral": [
        (["--moe-router-pre-softmax"], "the model's router takes the softmax after the top-k"),
        (["--moe-layer-freq", 2], "--moe-layer-freq 2 makes the layers [1,0,1,0] (1: MoE); the model's are [1]*4"),
        (["--multi-latent-attention"], "--multi-latent-attention: the model's attention is not multi-latent attention"),
        (["--squared-relu"], "--squared-relu: the model's MLPs are not fc2(relu(fc1 x)^2)"),
        (["--mamba-num-heads", 4], "--mamba-num-heads: the model has no Mamba mixers"),
        (["--hybrid-layer-pattern", "M*M-"], "--hybrid-layer-pattern: the model is not a Mamba hybrid"),
        (["--window-size", "(4095, 0)"], "--window-size (4095, 0) differs from the model's none (no sliding window)"),
        (["--rotary-interleaved"], "--rotary-interleaved: the model's RoPE rotates the two halves of each head"),
        (["--rotary-seq-len-interpolation-factor", 4],
         "--rotary-seq-len-interpolation-factor 4 differs from the model's RoPE, which has no linear scaling (1)"),
        (["--no-rope-freq", 4], "--no-rope-freq 4 makes the layers [0,0,0,1] (1: no RoPE); the model's all use RoPE"),
        (["--no-rope-freq", 3], "--no-rope-freq 3: the model's 4 layers do not divide by it"),
        (["--export-model-type", "HybridModel"], "--export-model-type HybridModel differs from the model's GPTModel"),
        (["--export-qk-l2-norm"], "--export-qk-l2-norm: the model's queries and keys are not L2-normed"),
        (["--attention-output-gate"], "--attention-output-gate: the model's attention output is not gated"),
        (["--linear-attention-freq", 2], "--linear-attention-freq: the model has no Gated DeltaNet layers"),
        (["--moe-apply-probs-on-input"], "--moe-apply-probs-on-input: the model's routing probabilities weigh its "
                                         "experts' outputs, not their inputs")],
    "gpt_oss": [
        (["--position-embedding-type", "rope"], "--position-embedding-type rope differs from the model's yarn"),
        (["--window-size", "(127, 0)"], "--window-size (127, 0) differs from the model's (7, 0): a window of 8"),
        (["--window-attn-skip-freq", 3], "--window-size with --window-attn-skip-freq 3 windows the layers [1,1,0,1] "
                                         "(1: windowed); the model's are [1,0,1,0]"),
        (["--softmax-type", "vanilla"], "--softmax-type vanilla differs from the model's learnable"),
        (["--activation-func-clamp-value", 7.0], "--activation-func-clamp-value 7 differs from the model's 0.2"),
        (["--glu-linear-offset", 0], "--glu-linear-offset 0 differs from the model's 1"),
        (["--disable-bias-linear"], "--disable-bias-linear: the model's linear layers have biases")],
    "nemotron_h_moe": [
        (["--hybrid-layer-pattern", "MEE*"], "--hybrid-layer-pattern MEE* differs from the model's ME*E"),
        (["--mamba-num-heads", 8], "--mamba-num-heads 8 differs from the model's 4"),
        (["--mamba-state-dim", 128], "--mamba-state-dim 128 differs from the model's 8"),
        (["--moe-latent-size", 64], "--moe-latent-size 64 differs from the model's 48"),
        (["--position-embedding-type", "rope"], "--position-embedding-type rope differs from the model's none")],
    "qwen3_next": [
        (["--linear-attention-freq", 4], "--linear-attention-freq 4 makes the layers [1,1,1,0] (1: Gated DeltaNet); "
                                         "the model's are [1,0,1,0]"),
        (["--linear-key-head-dim", 128], "--linear-key-head-dim 128 differs from the model's 8"),
        (["--linear-num-value-heads", 32], "--linear-num-value-heads 32 differs from the model's 4"),
        (["--linear-conv-kernel-dim", 3], "--linear-conv-kernel-dim 3 differs from the model's 4"),
        (["--experimental-attention-variant", "dsa"],
         "--experimental-attention-variant dsa differs from the model's gated_delta_net")],
    "llama3": [
        (["--rope-scaling-factor", 32], "--rope-scaling-factor 32 differs from the model's 8"),
        (["--apply-layernorm-1p"], "--apply-layernorm-1p: the model's norms do not apply (1 + w)"),
        (["--position-embedding-type", "yarn"], "--position-embedding-type yarn differs from the model's rope")],
}
# Values refused before the model is read: exit 2.
USAGE = {
    "deepseek_v3": [
        (["--moe-router-load-balancing-type", "quantile_balancing"],
         "--moe-router-load-balancing-type quantile_balancing is not supported"),
        (["--moe-router-force-load-balancing"], "--moe-router-force-load-balancing: Megatron then routes by random"),
        (["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"],
         "--moe-router-load-balancing-type aux_loss seq_aux_loss takes 2 --moe-aux-loss-coeff value(s)"),
        (["--moe-layer-freq", "[0]*1 + [1]*3"], "--moe-layer-freq: [0]*1 + [1]*3: only digits")],
    "mixtral": [(["--moe-router-load-balancing-type", "sinkhorn"],
                 "--moe-router-load-balancing-type sinkhorn is not supported"),
                (["--padded-vocab-size", 0], "--padded-vocab-size 0 must be a positive multiple of the tensor-parallel"),
                (["--moe-token-drop-policy", "random"], "--moe-token-drop-policy random: probs or position"),
                (["--no-rope-freq", "[0]*3+[2]"], "--no-rope-freq [0]*3+[2] holds 2 (0: RoPE, 1: none)"),
                (["--export-model-type", "T5Model"], "--export-model-type T5Model: not one of GPTModel")],
    "gpt_oss": [(["--window-size", 128], "--window-size: 128: not two integers (left, right)"),
                (["--fp8-format", "hybrid"], "--fp8-format hybrid: FP8 is not supported"),
                (["--swiglu"], "--quick-geglu and --swiglu exclude each other")],
    "nemotron_h_moe": [
        (["--moe-router-dtype", "bf16"], "--moe-router-dtype bf16: not one of fp32, fp64"),
        (["--hybrid-layer-pattern", "ME|*E"], "pipeline stage boundaries ('|') and MTP patterns ('/') are not taken"),
        (["--hybrid-layer-pattern", "MG*E"], "'G' is not one of M (Mamba), * (attention), - (MLP), E (MoE)"),
        (["--hybrid-override-pattern", "ME*E"], "--hybrid-override-pattern and --hybrid-layer-pattern: give one")],
    "qwen3_next": [(["--linear-attention-freq", "[1,0,2,0]"],
                    "--linear-attention-freq [1,0,2,0] holds 2 (0: attention, 1: Gated DeltaNet)"),
                   (["--experimental-attention-variant", "mamba"],
                    "--experimental-attention-variant mamba: not one of gated_delta_net, dsa")],
    "llama3": [(["--rope-type", "yarn"], "--rope-type yarn: Megatron takes it with --multi-latent-attention only"),
               (["--dataloader-type", "cyclic"], "--dataloader-type cyclic: Trestle reads the samples in the order of "
                                                 "Megatron's pretraining sampler (single)"),
               (["--batch-size", 4], "--batch-size argument is no longer valid, use --micro-batch-size instead"),
               (["--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 (--use-precision-aware-optimizer): Trestle keeps"),
               (["--use-checkpoint-opt-param-scheduler"], "exclude each other")],
}
# The no-effect flags each family's note names (some of them).
NOTED = {
    "deepseek_v3": ["--moe-flex-dispatcher-backend hybridep", "--recompute-modules mlp moe mla_up_proj layernorm",
                    "--moe-shared-expert-overlap",
                    "--moe-token-drop-policy probs (without --moe-expert-capacity-factor)", "--moe-layer-recompute",
                    "--logging-level 40", "--init-model-with-meta-device"],
    "mixtral": ["--moe-token-dispatcher-type alltoall", "--no-mmap-bin-files"],
    "gpt_oss": ["--enable-gpt-oss", "--attention-softmax-in-fp32", "--fp8-amax-history-len 1024",
                "--tiktoken-pattern v2"],
    "llama3": ["--attention-backend fused", "--empty-unused-memory-level 1", "--dataloader-type single",
               "--use-dist-ckpt", "--cuda-graph-modules attn mlp", "--sgd-momentum 0.9",
               "--exp-avg-dtype fp32"],
    "qwen3_next": ["--deterministic-mode", "--attention-backend unfused", "--attention-softmax-in-fp32"],
    "nemotron_h_moe": ["--use-fused-weighted-squared-relu", "--enable-experimental", "--trust-remote-code",
                       "--disable-gloo-process-groups"],
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    root = tmp_path_factory.mktemp("megatron_flags")
    trestle.run("preprocess", "--input", CORPUS / "kjv.jsonl", "--output-prefix", root / "kjv", "--tokenizer-type",
                "HuggingFaceTokenizer", "--tokenizer-model", CORPUS / "tokenizer.json", "--append-eod", "--quiet")
    for family, (config_class, config) in FAMILIES.items():
        save_tiny_model(root / family / "hf", config_class, config, seed=5)
        trestle.run("convert", "--from", "hf", root / family / "hf", "--to", "trestle", root / family / "ckpt",
                    "--quiet")
    return root


def replaced(flags, changes):
    """`flags` with `changes` in place of the flags (and their values) of the same names, as a script edited."""
    names = {word for word in changes if str(word).startswith("--")}
    kept, dropping = [], False
    for word in flags:
        if str(word).startswith("--"):
            dropping = word in names
        if not dropping:
            kept.append(word)
    return kept + list(changes)


def train(trestle, setup, family, out, *flags):
    return trestle.run_raw(
        "train", "--nproc-per-node", 1, "--load", setup / family / "ckpt", "--data-path", setup / "kjv_text_document",
        "--split", "98,2,0", "--micro-batch-size", 1, "--global-batch-size", 1, "--seq-length", 16,
        "--max-position-embeddings", 256, "--train-iters", 1, "--lr", "1e-3", "--log-interval", 1,
        "--eval-interval", 1000, "--eval-iters", 0, "--log-json", out / "log.jsonl", *flags, timeout=120)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_familys_megatron_flags_train_and_another_models_are_refused(setup, trestle, tmp_path, family):
    result = train(trestle, setup, family, tmp_path, *FLAGS[family])
    assert result.returncode == 0, result.stderr[-3000:]
    assert [json.loads(line)["iteration"] for line in (tmp_path / "log.jsonl").read_text().splitlines()] == [1]
    notes = [line for line in result.stdout.splitlines() if "Megatron-LM flags without effect here" in line]
    assert len(notes) == 1 and all(flag in notes[0] for flag in NOTED[family]), notes
    for flags, message in WRONG[family]:
        run = train(trestle, setup, family, tmp_path, *replaced(FLAGS[family], flags))
        assert run.returncode == 1 and message in run.stderr and f"{family}/ckpt" in run.stderr, \
            (flags, run.returncode, run.stderr[-2000:])
    for flags, message in USAGE[family]:
        run = train(trestle, setup, family, tmp_path, *replaced(FLAGS[family], flags))
        assert run.returncode == 2 and message in run.stderr, (flags, run.returncode, run.stderr[-2000:])

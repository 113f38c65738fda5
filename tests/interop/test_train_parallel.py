"""`trestle train` with pipeline parallelism, the distributed optimizer and context parallelism, on the bundled KJV
corpus and 8-layer random Llamas converted from `transformers` (untied and tied embeddings):

- the losses of the first 10 iterations (fp32, the same global batch and data) agree within 1e-5 relative with the
  unpipelined run at pp 2, interleaved pp (2 and 4 stages, 2 chunks each), uneven stages (Megatron's
  --decoder-first/last-pipeline-num-layers, also interleaved), the distributed optimizer (dp 2, tp2·pp2·dp2 with sequence parallelism and
  several buckets), context parallelism (ring attention: cp 4, tp2·cp2·dp2 with sequence parallelism and the
  distributed optimizer, cp2·pp2 interleaved with recompute; cp 2 for every family in test_train_families.py), and
  with tied embeddings (whose first- and last-stage copies' gradients are summed)
  also the validation losses, with activation recompute and with the distributed optimizer;
- saved at tp2·pp2·dp2 with the distributed optimizer (its state as flat ranges of the pieces) at iteration 5, resumed
  at tp1·pp4·dp2 with it, at cp2·dp2, at tp1·pp1·dp1 without it and, through a torch_dist export, at tp2·pp2 (interleaved):
  iterations 6-10 continue the uninterrupted run's losses within 1e-5 relative, and the pipelined checkpoint
  converts to Hugging Face with transformers' loss equal to the trainer's validation loss;
- a Mixtral (4 experts, top-2) with Megatron's load-balancing loss and router z-loss (--moe-aux-loss-coeff,
  --moe-z-loss-coeff, each of which changes the training) trains with the same losses (1e-5) as unparallelised at
  tp2·dp2 with sequence parallelism, with expert parallelism (tokens sent to their experts' ranks by all-to-all, expert
  gradients reduced over the expert-data-parallel ranks) at ep2, tp2·ep2 with sequence parallelism, ep4 with the
  distributed optimizer, interleaved pp2·ep2 with it, ep 2 over cp 2 x dp 2 (MoE under cp 2: GPT-OSS and DeepSeek-V3 in
  test_train_families.py) and ep 2 with --calculate-per-token-loss (every token counted: the same gradients); saved at ep2 (each rank its own experts), it verifies and resumes at ep1 continuing the
  losses; with the experts' own tensor parallelism (--expert-tensor-parallel-size: whole at tp 2, split over two
  data-parallel ranks) it trains alike, saves, reshards between expert splits and resumes;
- --ddp-num-buckets N cuts the gradients into buckets of the rank's parameter count / N (as --ddp-bucket-size of that
  size does; Megatron's bucket count logged), with the losses unchanged;
- a pipeline peer that dies ends a torchrun-style worker with an error naming its stage and the message it waited for.
"""
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ci_scope import ci_cases  # noqa: E402
from models import save_tiny_model  # noqa: E402
from ports import free_port  # noqa: E402
import test_train_loop as loop  # noqa: E402

CORPUS = loop.CORPUS
SEQ, MBS, GBS, ITERS = 32, 2, 16, 10
SAVED_AT, EVAL_INTERVAL = ITERS // 2, 5
LLAMA = dict(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5)


MIXTRAL = dict(vocab_size=4096, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
               max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    root = tmp_path_factory.mktemp("pipeline")
    save_tiny_model(root / "hf", "LlamaConfig", LLAMA, seed=3)
    save_tiny_model(root / "hf_tied", "LlamaConfig", dict(LLAMA, tie_word_embeddings=True), seed=4)
    save_tiny_model(root / "hf_moe", "MixtralConfig", MIXTRAL, seed=5)
    for name in ("hf", "hf_tied", "hf_moe"):
        trestle.run("convert", "--from", "hf", root / name, "--to", "trestle", root / f"ckpt_{name}", "--quiet")
    (root / "data").mkdir()
    trestle.run("preprocess", "--input", CORPUS / "kjv.jsonl", "--output-prefix", root / "data" / "kjv",
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", CORPUS / "tokenizer.json",
                "--append-eod", "--quiet")
    return root


def train(trestle, setup, out, *extra, world=1, load=None, model="hf", iters=ITERS, eval_iters=0):
    """Runs `trestle train` on `world` local workers; returns {iteration: lm loss} and the validation losses."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.jsonl"
    args = ["train", "--nproc-per-node", world, "--data-path", setup / "data" / "kjv_text_document",
            "--split", "98,2,0", "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", SEQ,
            "--train-iters", iters, "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", 3,
            "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta2", "0.95",
            "--log-interval", 1, "--eval-interval", EVAL_INTERVAL, "--eval-iters", eval_iters, "--log-json", log,
            "--load", load if load is not None else setup / f"ckpt_{model}", *extra]
    trestle.run(*args, timeout=300)
    return loop.read_losses(log)


def logged(out, field):
    """{iteration: value} of a field of a run's JSON log."""
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return {r["iteration"]: r[field] for r in records if field in r and "validation" not in r}


def assert_close(losses, expected, what):
    assert sorted(losses) == sorted(expected), (what, sorted(losses))
    bad = {i: (losses[i], expected[i]) for i in expected if not loop.close(losses[i], expected[i])}
    assert not bad, f"{what}: losses differ from the unpipelined run at {bad}"


@pytest.fixture(scope="module")
def reference(setup, trestle, tmp_path_factory):
    losses, _ = train(trestle, setup, tmp_path_factory.mktemp("pp1"))
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert losses[ITERS] < losses[1] - 0.05, "the loss does not go down"
    return losses


PP = "--pipeline-model-parallel-size"
TP = "--tensor-model-parallel-size"
DISTOPT = "--use-distributed-optimizer"
CP = "--context-parallel-size"
EP = "--expert-model-parallel-size"
LAYOUTS = {
    "pp2": (2, [PP, 2]),
    "pp2-interleaved": (2, [PP, 2, "--num-layers-per-virtual-pipeline-stage", 2]),
    "pp4-interleaved": (4, [PP, 4, "--num-virtual-stages-per-pipeline-rank", 2]),
    "pp3-uneven": (3, [PP, 3, "--decoder-first-pipeline-num-layers", 1, "--decoder-last-pipeline-num-layers", 3]),
    # 2 | 6 layers in 2 chunks each: chunk 0 holds layers 0 | 1-3, chunk 1 layers 4 | 5-7 (megatron-core's offsets)
    "pp2-interleaved-uneven": (2, [PP, 2, "--num-virtual-stages-per-pipeline-rank", 2,
                                   "--decoder-first-pipeline-num-layers", 2]),
    "dp2-distopt": (2, [DISTOPT]),
    "cp4": (4, [CP, 4]),
    "tp2cp2dp2-sp-distopt": (8, [CP, 2, TP, 2, "--sequence-parallel", DISTOPT]),
    "cp2pp2-interleaved-recompute": (8, [CP, 2, PP, 2, "--num-layers-per-virtual-pipeline-stage", 2,
                                         "--recompute-granularity", "full"]),
    "tp2pp2dp2-sp-distopt-buckets": (8, [PP, 2, TP, 2, "--sequence-parallel", DISTOPT, "--ddp-bucket-size", 30000]),
}


# CI leaves out plain pp 2 and dp 2 (inside other layouts here), pp 4 interleaved and the 8-rank cp 2 x pp 2 and
# tp 2 x cp 2 x dp 2 (their parts run in the other 8-rank layout, cp 4 and test_context_parallel_megatron).
@pytest.mark.parametrize("name", ci_cases(LAYOUTS, ["pp2-interleaved", "pp3-uneven", "pp2-interleaved-uneven", "cp4",
                                                    "tp2pp2dp2-sp-distopt-buckets"]))
def test_losses_agree_with_the_unpipelined_run(setup, trestle, reference, tmp_path, name):
    world, extra = LAYOUTS[name]
    losses, _ = train(trestle, setup, tmp_path, *extra, world=world)
    assert_close(losses, reference, name)


def bucket_lines(stdout):
    """The trainer's bucket lines (Megatron's), without the launcher's rank prefix."""
    return [line[line.index("Number"):] for line in stdout.splitlines() if "Number of buckets for gradient" in line]


def test_ddp_num_buckets_sizes_the_buckets_by_the_ranks_parameters(setup, trestle, tmp_path):
    """Megatron-LM's --ddp-num-buckets N: buckets of (the rank's parameter count // N) elements, which --ddp-bucket-size
    of that count gives alike; the gradients' mean, so the losses, stay the unpartitioned run's."""
    from safetensors import safe_open
    with safe_open(setup / "hf" / "model.safetensors", "pt") as f:
        parameters = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    common = ["--nproc-per-node", 2, "--data-path", setup / "data" / "kjv_text_document", "--split", "98,2,0",
              "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", SEQ, "--lr", "3e-3",
              "--load", setup / "ckpt_hf", DISTOPT, "--eval-iters", 0, "--log-interval", 1]
    runs = {}
    for name, flags in [("default", []), ("num", ["--ddp-num-buckets", 4]),
                        ("size", ["--ddp-bucket-size", parameters // 4])]:
        log = tmp_path / f"{name}.jsonl"
        stdout = trestle.run("train", *common, "--train-iters", 3, "--log-json", log, *flags, timeout=300)
        runs[name] = (bucket_lines(stdout), loop.read_losses(log)[0])
    assert runs["default"][0] == ["Number of buckets for gradient all-reduce / reduce-scatter: 1 (data-parallel, "
                                  "stage 0)"], runs["default"][0]
    # (buckets close in reverse parameter order once they reach the size: the output layer, a third of the model,
    # fills one alone)
    assert len(runs["num"][0]) == 1 and int(runs["num"][0][0].split(":")[1].split()[0]) > 1, runs["num"][0]
    assert runs["num"][0] == runs["size"][0]
    for name in ("num", "size"):
        assert_close(runs[name][1], runs["default"][1], f"--ddp-{name}-buckets")
    both = trestle.run_raw("train", *common, "--train-iters", 1, "--ddp-num-buckets", 2, "--ddp-bucket-size", 100)
    assert both.returncode != 0 and "--ddp-num-buckets and --ddp-bucket-size" in both.stderr, both.stderr
    zero = trestle.run_raw("train", *common, "--train-iters", 1, "--ddp-num-buckets", 0)
    assert zero.returncode != 0 and "--ddp-num-buckets must be at least 1" in zero.stderr, zero.stderr


def test_tied_embeddings_across_stages(setup, trestle, tmp_path):
    """The first stage's embedding and the last stage's output layer are one weight: their gradients are summed (and
    counted once in the gradient norm), so training and validation follow the unpipelined run."""
    expected, expected_valid = train(trestle, setup, tmp_path / "pp1", model="hf_tied", eval_iters=2)
    layouts = [("pp2", 2, [PP, 2]),
               ("tp2pp2dp2-interleaved-sp-recompute", 8,
                [PP, 2, TP, 2, "--sequence-parallel", "--num-layers-per-virtual-pipeline-stage", 2,
                 "--recompute-granularity", "full"]),
               ("pp2dp2-distopt", 4, [PP, 2, DISTOPT, "--ddp-bucket-size", 20000]),
               ("cp2dp2", 4, [CP, 2])]
    # CI: the tied weight split over stages beside tp, interleaving and recompute, and beside the distributed
    # optimizer's buckets (plain pp 2 and cp 2 x dp 2 in the full run).
    for name, world, extra in ci_cases(layouts, layouts[1:3]):
        losses, valid = train(trestle, setup, tmp_path / name, *extra, world=world, model="hf_tied", eval_iters=2)
        assert_close(losses, expected, name)
        assert len(valid) == len(expected_valid) == 3  # at iterations 5 and 10, and the run's final one
        assert all(loop.close(a, b) for a, b in zip(valid, expected_valid, strict=True)), (name, valid, expected_valid)


def test_mixture_of_experts_across_layouts(setup, trestle, tmp_path):
    aux = ["--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01"]
    expected, _ = train(trestle, setup, tmp_path / "tp1", *aux, model="hf_moe", iters=ITERS)
    expected_balance = logged(tmp_path / "tp1", "load_balancing_loss")
    assert sorted(expected_balance) == list(range(1, ITERS + 1))
    without_aux, _ = train(trestle, setup, tmp_path / "no_aux", model="hf_moe", iters=ITERS)
    without_z, _ = train(trestle, setup, tmp_path / "no_z", *aux[:2], model="hf_moe", iters=ITERS)
    assert expected[1] == without_aux[1] == without_z[1], "the aux losses are not part of the reported lm loss"
    later = range(3, ITERS + 1)
    assert any(not loop.close(without_z[i], without_aux[i]) for i in later), "the aux loss changed nothing"
    assert any(not loop.close(expected[i], without_z[i]) for i in later), "the z-loss changed nothing"
    saved = tmp_path / "saved_ep2"
    layouts = [("tp2dp2-sp", 4, [TP, 2, "--sequence-parallel", "--num-experts", 4, "--moe-router-topk", 2]),
               ("ep2-saving", 2, [EP, 2, "--save", saved, "--save-interval", 4]),
               ("tp2ep2-sp", 4, [TP, 2, EP, 2, "--sequence-parallel"]),
               ("ep4-distopt", 4, [EP, 4, DISTOPT]),
               ("ep2pp2-interleaved-distopt", 4, [PP, 2, "--num-layers-per-virtual-pipeline-stage", 1, EP, 2, DISTOPT]),
               # Megatron folds the context-parallel ranks into the expert groups: ep 2 over cp 2 x dp 2
               ("cp2ep2dp2-distopt", 4, [CP, 2, EP, 2, DISTOPT]),
               # Megatron's per-token rule: every token counted here, so the same gradients, the routers' losses
               # scaled by the tokens each routed on its rank and divided by the global batch's
               ("ep2-per-token-loss", 2, [EP, 2, "--calculate-per-token-loss"])]
    # CI: expert parallelism saving, beside tensor parallelism, and beside the interleaved pipeline and distributed
    # optimizer (experts without ep at tp 2, and ep 4, in the full run).
    for name, world, extra in ci_cases(layouts, [layouts[1], layouts[2], layouts[4], layouts[5], layouts[6]]):
        losses, _ = train(trestle, setup, tmp_path / name, *aux, *extra, world=world, model="hf_moe", iters=ITERS)
        assert_close(losses, expected, f"MoE {name}")
        # Megatron's logged load-balancing loss: summed over the ranks sharing a sequence, averaged over the others.
        assert_close(logged(tmp_path / name, "load_balancing_loss"), expected_balance, f"MoE {name}'s balance")
    # Each expert-parallel rank saved its own experts: the checkpoint is whole, and resumes without expert parallelism.
    manifest = json.loads((saved / "iter_0000004" / "manifest.json").read_text())
    assert manifest["layout"]["ep"] == 2
    expert = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    assert expert in manifest["tensors"] and f"optimizer.exp_avg.{expert}" in manifest["tensors"]
    trestle.run("verify", saved)
    losses, _ = train(trestle, setup, tmp_path / "resumed", *aux, "--ckpt-step", 4, world=1, model="hf_moe", iters=ITERS,
                      load=saved)
    assert_close(losses, {i: expected[i] for i in range(5, ITERS + 1)}, "MoE saved at ep2, resumed at ep1")


def test_grouped_gemm_experts_are_refused_on_the_cpu(setup, trestle, tmp_path):
    """--moe-grouped-gemm runs each expert projection as one grouped GEMM, which PyTorch has no CPU backward for: on
    the CPU it is refused before any work."""
    assert_moe_run_refused(trestle, setup, ["--device", "cpu", "--moe-grouped-gemm"],
                           "--moe-grouped-gemm needs --device cuda")


def assert_moe_run_refused(trestle, setup, flags, message):
    """A short run of the Mixtral with `flags` fails before its first iteration, saying `message`."""
    result = trestle.run_raw("train", *flags, "--data-path", setup / "data" / "kjv_text_document", "--split", "98,2,0",
                             "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", SEQ,
                             "--train-iters", 2, "--lr", "1e-3", "--load", setup / "ckpt_hf_moe")
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "iteration" not in result.stdout


ETP = "--expert-tensor-parallel-size"


def test_experts_with_their_own_tensor_parallelism(setup, trestle, tmp_path):
    """--expert-tensor-parallel-size (Megatron's expert generator cuts each stage's ranks as etp x ep x expert-data-
    parallel): the Mixtral's losses equal the unparallelised run's (1e-5) with the experts whole beside attention at
    tp 2 (their gradients averaged over the two tp ranks, which routed different tokens), over ep 2 beside tp 2 x dp 2
    with the distributed optimizer sharding them over their own data-parallel ranks, split over two data-parallel
    ranks at tp 1, and over ep 2 spanning the two tp ranks of each pipeline stage (dp 1, interleaved); saved at tp2 with whole experts, the checkpoint holds every expert and resumes at tp 1. etp other
    than tp without sequence parallelism is refused, as Megatron refuses MoE with tp > 1 without it. `trestle reshard
    --etp` moves the checkpoint to experts split over two data-parallel ranks, where it resumes too."""
    aux = ["--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01"]
    expected, _ = train(trestle, setup, tmp_path / "tp1", *aux, model="hf_moe")
    saved = tmp_path / "saved"
    layouts = [("tp2etp1-sp-saving", 2, [TP, 2, ETP, 1, "--sequence-parallel", "--save", saved, "--save-interval", 4]),
               ("tp2ep2etp1-sp-distopt", 4, [TP, 2, EP, 2, ETP, 1, "--sequence-parallel", DISTOPT]),
               ("dp2etp2", 2, [ETP, 2]),
               # ep over the tensor-parallel ranks (tp 2, dp 1: each tp rank holds two whole experts), interleaved
               ("tp2ep2etp1-sp-pp2-interleaved", 4, [TP, 2, EP, 2, ETP, 1, "--sequence-parallel", PP, 2,
                                                     "--num-layers-per-virtual-pipeline-stage", 1])]
    for name, world, extra in ci_cases(layouts, [layouts[0], layouts[1], layouts[3]]):
        losses, _ = train(trestle, setup, tmp_path / name, *aux, *extra, world=world, model="hf_moe")
        assert_close(losses, expected, f"MoE {name}")
    manifest = json.loads((saved / "iter_0000004" / "manifest.json").read_text())
    assert manifest["layout"]["tp"] == 2 and manifest["layout"]["etp"] == 1
    trestle.run("verify", saved)
    losses, _ = train(trestle, setup, tmp_path / "resumed", *aux, "--ckpt-step", 4, model="hf_moe", load=saved)
    assert_close(losses, {i: expected[i] for i in range(5, ITERS + 1)}, "MoE saved at tp2 etp1, resumed at tp1")
    # trestle reshard moves it to experts split over two data-parallel ranks (tp 1, dp 2, etp 2), where it resumes.
    trestle.run("reshard", saved, tmp_path / "resharded", "--iteration", 4, "--tp", 1, "--dp", 2, "--etp", 2, "--quiet")
    layout = json.loads((tmp_path / "resharded" / "iter_0000004" / "manifest.json").read_text())["layout"]
    assert (layout["tp"], layout["dp"], layout["etp"]) == (1, 2, 2), layout
    losses, _ = train(trestle, setup, tmp_path / "resumed_etp2", *aux, ETP, 2, world=2, model="hf_moe",
                      load=tmp_path / "resharded")
    assert_close(losses, {i: expected[i] for i in range(5, ITERS + 1)}, "MoE resharded to etp2, resumed there")
    # Megatron's dp_reshardable buffers are cut for experts split as the dense tensors: refused at another etp.
    result = trestle.run_raw("reshard", saved, tmp_path / "megatron", "--iteration", 4, "--to-format",
                             "megatron-dist", "--optimizer-format", "dp_reshardable", "--lr", "3e-3", "--quiet")
    assert result.returncode != 0 and "pass --etp 2" in result.stderr, result.stderr
    assert not (tmp_path / "megatron").exists() or not any((tmp_path / "megatron").iterdir())
    assert_moe_run_refused(trestle, setup, ["--nproc-per-node", 2, TP, 2, ETP, 1],
                           "an expert-tensor-parallel size other than tp needs --sequence-parallel")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (grouped GEMM experts run on CUDA only)")
def test_grouped_gemm_experts_train_as_the_per_expert_loop(setup, trestle, tmp_path):
    aux = ["--device", "cuda", "--moe-aux-loss-coeff", "0.1", "--moe-z-loss-coeff", "0.01"]
    expected, _ = train(trestle, setup, tmp_path / "loop", *aux, model="hf_moe", iters=ITERS)
    grouped, _ = train(trestle, setup, tmp_path / "grouped", *aux, "--moe-grouped-gemm", model="hf_moe", iters=ITERS)
    assert_close(grouped, expected, "MoE with grouped-GEMM experts")


def test_save_at_one_pipeline_layout_resume_at_others(setup, trestle, reference, tmp_path):
    saved = tmp_path / "saved"
    first, _ = train(trestle, setup, tmp_path / "first", PP, 2, TP, 2, DISTOPT, "--ddp-bucket-size", 30000,
                     "--save", saved, "--exit-interval", SAVED_AT, world=8)
    assert sorted(first) == list(range(1, SAVED_AT + 1))
    assert_close(first, {i: reference[i] for i in range(1, SAVED_AT + 1)}, "tp2pp2dp2 with the distributed optimizer")
    manifest = json.loads((saved / f"iter_{SAVED_AT:07d}" / "manifest.json").read_text())
    assert manifest["layout"]["pp"] == 2 and manifest["layout"]["tp"] == 2
    # The distributed optimizer's shards are flat ranges of the pieces.
    flat = [c for name, t in manifest["tensors"].items() if name.startswith("optimizer.") for c in t["chunks"]
            if "flat" in c]
    assert flat, "no optimizer state was saved as flat ranges"
    later = {i: reference[i] for i in range(SAVED_AT + 1, ITERS + 1)}
    resumed_at = [("tp1pp4dp2-distopt", 8, [PP, 4, DISTOPT]), ("cp2dp2", 4, [CP, 2]), ("tp1pp1dp1", 1, [])]
    # CI: another pipeline split with the distributed optimizer, and one rank without it (cp 2 x dp 2 in the full run).
    for name, world, extra in ci_cases(resumed_at, [resumed_at[0], resumed_at[2]]):
        losses, _ = train(trestle, setup, tmp_path / name, *extra, world=world, load=saved)
        assert_close(losses, later, f"resumed at {name}")
    trestle.run("convert", "--from", "trestle", saved, "--to", "megatron-dist", tmp_path / "torch_dist", "--quiet")
    losses, _ = train(trestle, setup, tmp_path / "from_torch_dist", PP, 2, TP, 2,
                      "--num-layers-per-virtual-pipeline-stage", 2, DISTOPT,
                      "--hf-config", setup / "hf" / "config.json",
                      world=4, load=tmp_path / "torch_dist")
    assert_close(losses, later, "resumed from torch_dist at tp2pp2 interleaved")


def test_pipelined_checkpoint_converts_to_hf_with_the_same_validation_loss(setup, trestle, tmp_path):
    _, valid = train(trestle, setup, tmp_path / "run", PP, 4, "--save", tmp_path / "save", world=4, iters=4,
                     eval_iters=2)
    trestle.run("convert", "--from", "trestle", tmp_path / "save", "--to", "hf", tmp_path / "hf", "--quiet")
    samples = megatron_validation_samples(setup, tmp_path, iters=4)  # before the first interval: one evaluation
    expected = loop.hf_loss(tmp_path / "hf", samples)
    assert loop.close(expected, valid[-1]), f"transformers: {expected}, trainer: {valid[-1]}"


def megatron_validation_samples(setup, tmp_path, iters):
    """The validation samples of the final evaluation (the first 2 x global batch of split 1), as megatron-core's
    GPTDataset builds them for this run's sample counts."""
    import torch.distributed as dist
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    config = GPTDatasetConfig(random_seed=1234, sequence_length=SEQ,
                              blend=([str(setup / "data" / "kjv_text_document")], None), split="98,2,0",
                              tokenizer=loop._Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"))
    evaluations = iters // EVAL_INTERVAL + 1
    splits = BlendedMegatronDatasetBuilder(GPTDataset, [iters * GBS, evaluations * 2 * GBS, 2 * GBS],
                                           lambda: True, config).build()
    return [splits[1][i] for i in range(2 * GBS)]


def test_dead_pipeline_peer_ends_a_torchrun_style_worker(setup, trestle):
    port = free_port()
    workers = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        workers.append(subprocess.Popen(
            [str(a) for a in [trestle.path, "train", "--data-path", setup / "data" / "kjv_text_document",
                              "--split", "98,2,0", "--micro-batch-size", MBS, "--global-batch-size", GBS,
                              "--seq-length", SEQ, "--train-iters", 10, "--lr", "1e-3", "--eval-iters", 0,
                              "--load", setup / "ckpt_hf", PP, 2, "--distributed-timeout-seconds", 30,
                              "--test-kill-rank", 1, "--test-kill-iteration", 3]],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    _, err0 = workers[0].communicate(timeout=120)
    workers[1].communicate(timeout=120)
    assert workers[1].returncode == -9
    assert workers[0].returncode == 1, err0
    assert "pipeline stage 0:" in err0 and "a peer died or hung" in err0, err0
    assert "virtual stage 1 (rank 1)" in err0, err0
    # (well within the 30 s timeout: the dead peer's sockets close at once, and rank 0, which serves the store and
    # failed, does not wait for its peers to leave the store)
    assert time.monotonic() - start < 40


def test_bench_train_pp_reports_idle_share_beside_the_bubble_model(trestle, tmp_path):
    report = tmp_path / "bench.json"
    out = trestle.run("bench", "train", "--pp", 2, "--layers", 4, "--hidden", 64, "--ffn", 128, "--heads", 4,
                      "--kv-heads", 2, "--seq-length", 64, "--iters", 4, "--warmup", 1, "--micro-batches", 4,
                      "--python", sys.executable, "--json", report, timeout=300)
    assert "bubble model (p-1)/(v*m) = 0.250" in out and "idle (measured)" in out, out
    layouts = json.loads(report.read_text())["layouts"]
    assert [(l["pp"], l["chunks"]) for l in layouts] == [(1, 1), (2, 1), (2, 2)]
    for layout in layouts:
        assert layout["tokens_per_s"] > 0
        assert len(layout["idle_share_per_stage"]) == (0 if layout["pp"] == 1 else 2)
        assert all(0 <= share < 1 for share in layout["idle_share_per_stage"])
    assert layouts[1]["bubble_model"] == 0.25 and layouts[2]["bubble_model"] == 0.125

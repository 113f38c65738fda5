"""LoRA fine-tuning with `trestle train`, against Hugging Face PEFT on transformers:

- a PEFT adapter made by `peft` (random non-zero A and B on q, k, v, o, gate, up, down), imported with `trestle convert
  --from hf-peft`, trains 20 iterations with the losses of `peft`'s model trained with torch AdamW over the adapters on
  the same global batches (Megatron's recipe) within 1e-5 relative, at tp 1, tp 2 with sequence parallelism, pp 2 and
  dp 2 with the distributed optimizer (in CI, runs of several ranks stop at iteration 10: their 10 losses);
- adapters from scratch (B zero): the first loss is the base model's; the same run at other layouts and with activation
  recompute gives the same losses; saves hold the adapters, their optimizer state and the training state only, record
  the base's path and manifest digest, never touch the base, and resume bit-exactly on the same layout and within 1e-5
  on another; adapters on an MoE model's routed and shared experts train alike at ep 2, tp 2 x ep 2 and under the
  distributed optimizer; the trained adapters export to a PEFT adapter that `peft` loads with the logits of the merged export;
- what is refused: an adapter checkpoint without its base or with another base, a --save into the base, LoRA on a
  target the model lacks.
"""
import hashlib
import json
import math
import pathlib
import sys

import pytest
import safetensors.torch
import torch
import transformers
import xxhash

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from ci_scope import FULL, ci_cases  # noqa: E402
from hf_training import auto_model, train_transformers  # noqa: E402
from models import save_tiny_model  # noqa: E402
import test_train_families as families  # noqa: E402
import test_train_loop as loop  # noqa: E402

SEQ, MBS, GBS, ITERS = loop.SEQ, loop.MBS, loop.GBS, loop.ITERS
LR, MIN_LR, WARMUP, WD, CLIP, BETA2 = 3e-3, 3e-4, 3, 0.1, 1.0, 0.95
LLAMA = dict(loop.LLAMA, num_hidden_layers=4)
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8
TP = "--tensor-model-parallel-size"
LAYOUTS = {
    "tp1": (1, []),
    "tp2-sp": (2, [TP, 2, "--sequence-parallel"]),
    "tp2": (2, [TP, 2]),
    "pp2": (2, ["--pipeline-model-parallel-size", 2]),
    "dp2-distopt": (2, ["--use-distributed-optimizer"]),
    "cp2": (2, ["--context-parallel-size", 2]),
    "ep2": (2, ["--expert-model-parallel-size", 2]),
    # the routed experts whole beside tp 2 (Megatron's --expert-tensor-parallel-size 1): their adapters too
    "tp2-sp-etp1": (2, [TP, 2, "--sequence-parallel", "--expert-tensor-parallel-size", 1]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    root = tmp_path_factory.mktemp("lora")
    (root / "data").mkdir()
    trestle.run("preprocess", "--input", loop.CORPUS / "kjv.jsonl", "--output-prefix", root / "data" / "kjv",
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", loop.CORPUS / "tokenizer.json",
                "--append-eod", "--quiet")
    save_tiny_model(root / "hf", "LlamaConfig", LLAMA, seed=21)
    trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "base", "--quiet")
    return root


@pytest.fixture(scope="module")
def samples(setup, tmp_path_factory):
    return loop.megatron_samples(setup, 0, ITERS * GBS, tmp_path_factory.mktemp("samples"))


def tree_digest(root):
    """Every file's bytes and mtime under `root`: what must not change."""
    out = {}
    for path in sorted(pathlib.Path(root).rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    return out


# CI stops a run of several ranks at iteration 10 of its 20 (--exit-interval: the same learning-rate schedule) and
# compares those 10 losses (assert_close); TRESTLE_FULL_TESTS=1 runs all 20. Resumed runs (--ckpt-step) run on.
LAYOUT_ITERS = ITERS if FULL else ITERS // 2


def train(trestle, setup, out, *extra, world=1, iters=ITERS, lora=("--lora-rank", RANK, "--lora-alpha", ALPHA),
          base=None):
    if world > 1 and iters == ITERS and "--exit-interval" not in extra and "--ckpt-step" not in extra:
        extra = (*extra, "--exit-interval", LAYOUT_ITERS)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.jsonl"
    trestle.run("train", "--nproc-per-node", world, "--data-path", setup / "data" / "kjv_text_document",
                "--split", "98,2,0", "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", SEQ,
                "--train-iters", iters, "--lr", LR, "--min-lr", MIN_LR, "--lr-warmup-iters", WARMUP,
                "--lr-decay-style", "cosine", "--weight-decay", WD, "--clip-grad", CLIP, "--adam-beta2", BETA2,
                "--log-interval", 1, "--eval-interval", 1000, "--eval-iters", 0, "--log-json", log,
                "--pretrained-checkpoint", base or setup / "base", *lora, *extra, timeout=300)
    return loop.read_losses(log)[0]


def assert_close(losses, expected, what, rel=1e-5):
    if LAYOUT_ITERS < ITERS and losses and max(losses) == LAYOUT_ITERS:  # a run CI stopped at iteration 10
        expected = {i: v for i, v in expected.items() if i <= LAYOUT_ITERS}
    assert sorted(losses) == sorted(expected), (what, sorted(losses), sorted(expected))
    bad = {i: (losses[i], expected[i]) for i in expected if not loop.close(losses[i], expected[i], rel)}
    assert not bad, f"{what}: losses differ at {bad}"


def manifest(root):
    tracker = (pathlib.Path(root) / "latest_checkpointed_iteration.txt").read_text().strip()
    return json.loads((pathlib.Path(root) / f"iter_{int(tracker):07d}" / "manifest.json").read_text())


# --- parity with peft ---------------------------------------------------------------------------------------------

def make_peft_adapter(trestle, hf_dir, base, peft_dir, adapter, seed, targets=HF_TARGETS, alpha=ALPHA,
                      parameters=None):
    """A PEFT adapter made by `peft` on `hf_dir`'s model with random non-zero A and B on every projection of `targets`
    it has (and on the fused `parameters`: target_parameters), saved in `peft_dir`, and its import into Trestle on
    `base` as `adapter`."""
    import peft
    model = auto_model(hf_dir).from_pretrained(hf_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=alpha, target_modules=targets,
                                                       target_parameters=parameters, init_lora_weights=False,
                                                       task_type="CAUSAL_LM"))
    with torch.no_grad():  # nn.Linear's default B (uniform ±1/sqrt(r)) would swamp the base model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)
    model.save_pretrained(peft_dir)
    trestle.run("convert", "--from", "hf-peft", peft_dir, "--base", base, "--to", "trestle", adapter, "--quiet")


@pytest.fixture(scope="module")
def peft_adapter(setup, trestle):
    make_peft_adapter(trestle, setup / "hf", setup / "base", setup / "peft", setup / "adapter", 5)
    return setup / "peft", setup / "adapter"


_expected = {}


def peft_losses(hf_dir, samples, peft_dir):
    """peft's model on `hf_dir`'s trained with `peft_dir`'s adapter (cached), going down."""
    if peft_dir not in _expected:
        _expected[peft_dir] = train_transformers(
            hf_dir, samples, iters=ITERS, global_batch=GBS, micro_batch=MBS, lr=LR, min_lr=MIN_LR,
            warmup_iters=WARMUP, weight_decay=WD, clip_grad=CLIP, beta2=BETA2, peft_adapter=peft_dir)
        losses = _expected[peft_dir]
        assert losses[ITERS] < losses[1] - 0.05, f"peft's loss does not go down: {losses}"
    return _expected[peft_dir]


@pytest.mark.parametrize("layout", ci_cases(["tp1", "tp2-sp", "pp2", "dp2-distopt"], ["tp1", "dp2-distopt"]))
def test_imported_peft_adapter_trains_as_peft(setup, samples, trestle, tmp_path, peft_adapter, layout):
    peft_dir, adapter = peft_adapter
    expected = peft_losses(setup / "hf", samples, peft_dir)
    world, extra = LAYOUTS[layout]
    losses = train(trestle, setup, tmp_path, "--load", adapter, *extra, world=world, lora=())
    assert_close(losses, expected, f"LoRA at {layout} against peft")


def train_imported(trestle, setup, samples, root, tmp_path, layout, what):
    """root/adapter (imported from root/peft on root/base) trained 20 iterations at `layout` and saved in
    tmp_path/ckpt, with peft's losses on root/hf (1e-5); returns the saved tensors' names."""
    expected = peft_losses(root / "hf", samples, root / "peft")
    world, extra = LAYOUTS[layout]
    losses = train(trestle, setup, tmp_path, "--load", root / "adapter", "--save", tmp_path / "ckpt", *extra,
                   world=world, lora=(), base=root / "base")
    assert_close(losses, expected, f"{what} LoRA at {layout} against peft")
    return manifest(tmp_path / "ckpt")["tensors"]


def gemma4_peft(setup, trestle, family):
    """test_train_families' Gemma 4 model (dense: keys as values in the full-attention layers, the last two layers
    reusing the first two's keys and values with MLPs twice as wide, per-layer inputs; MoE: experts beside each layer's
    MLP), a PEFT adapter on every projection it has (q_proj alone in the KV-sharing layers, no v_proj where the keys
    are the values; the dense MLP's, not the fused experts'), and its import; cached per family."""
    root = setup / family
    if not (root / "adapter").exists():
        import test_gemma4_convert
        _, config = families.FAMILIES[family]
        test_gemma4_convert.save_tiny_gemma4(root / "hf", config, 31, qk_norm_scale=0.5)
        trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "base", "--quiet")
        make_peft_adapter(trestle, root / "hf", root / "base", root / "peft", root / "adapter", 6)
    return root


@pytest.mark.parametrize("family,layout", ci_cases(
    [(family, layout) for family in ("gemma4", "gemma4_moe") for layout in ("tp1", "tp2-sp")],
    [("gemma4", "tp2-sp"), ("gemma4_moe", "tp1")]))
def test_gemma4_peft_adapter_trains_as_peft(setup, samples, trestle, tmp_path, family, layout):
    """LoRA on Gemma 4's layers: the imported PEFT adapter trains with peft's losses (1e-5); the trained adapters export
    back to a PEFT adapter on the same modules whose logits on the base model are the merged export's (the MoE model's
    routed experts, which the imported adapter leaves out, get zero adapters that stay zero and are left out again)."""
    root = gemma4_peft(setup, trestle, family)
    names = train_imported(trestle, setup, samples, root, tmp_path, layout, family)
    shared = "decoder.layers.3.self_attention.linear_q_proj.adapter.adapter_q.linear_in.weight"
    assert (shared in names) == (family == "gemma4"), sorted(names)[:20]
    assert "decoder.layers.1.self_attention.linear_qkv.adapter.adapter_k.linear_in.weight" in names
    assert "decoder.layers.1.self_attention.linear_qkv.adapter.adapter_v.linear_in.weight" not in names
    check_export_is_the_merged_model(trestle, root, tmp_path)


# Gated DeltaNet's projections: Qwen3-Next fuses in_proj per key head into two, Qwen3.5 splits it in four. (Qwen3-Next's
# MLP targets name the shared expert's: peft turns gate_proj / up_proj / down_proj into target_parameters on the fused
# experts.)
GDN_TARGETS = {"qwen3_next": ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"],
               "qwen3_5": HF_TARGETS + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]}
GDN_ALPHA = {"qwen3_next": 32, "qwen3_5": ALPHA}


def gated_delta_net_peft(setup, trestle, family):
    """test_train_families' Qwen3-Next (MoE) or Qwen3.5 model, a PEFT adapter on every projection it has (the gated
    attention's q_proj with its gates, Gated DeltaNet's in_proj parts and out_proj; Qwen3.5's MLP), and its import;
    cached per family."""
    root = setup / family
    if not (root / "adapter").exists():
        config_class, config = families.FAMILIES[family]
        save_tiny_model(root / "hf", config_class, config, seed=33)
        trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "base", "--quiet")
        make_peft_adapter(trestle, root / "hf", root / "base", root / "peft", root / "adapter", 7,
                          targets=GDN_TARGETS[family], alpha=GDN_ALPHA[family])
    return root


@pytest.mark.parametrize("family,layout", ci_cases(
    [(family, layout) for family in GDN_TARGETS for layout in ("tp1", "tp2-sp", "pp2", "dp2-distopt")],
    [("qwen3_next", "tp2-sp"), ("qwen3_5", "pp2")]))
def test_gated_delta_net_peft_adapter_trains_as_peft(setup, samples, trestle, tmp_path, family, layout):
    """LoRA on Qwen3-Next's and Qwen3.5's layers: the imported PEFT adapter (canonical: one adapter per Hugging Face
    projection, in_proj's rows split over the tp ranks by heads) trains with peft's losses (1e-5); its trained adapters
    export back to a PEFT adapter on the same modules whose logits on the base model are the merged export's."""
    root = gated_delta_net_peft(setup, trestle, family)
    names = train_imported(trestle, setup, samples, root, tmp_path, layout, family)
    parts = ["adapter_qkvz", "adapter_ba"] if family == "qwen3_next" else ["adapter_qkv", "adapter_z", "adapter_b",
                                                                           "adapter_a"]
    for part in parts:
        assert f"decoder.layers.0.self_attention.in_proj.adapter.{part}.linear_in.weight" in names, sorted(names)[:20]
    assert "decoder.layers.0.self_attention.in_proj.adapter.adapter_ba.linear_out.weight.alpha" in names or \
        family != "qwen3_next"
    assert "decoder.layers.3.self_attention.linear_qkv.adapter.adapter_q.linear_out.weight" in names
    assert not any(n.startswith("decoder.layers.0.self_attention.linear_qkv") for n in names)
    check_export_is_the_merged_model(trestle, root, tmp_path)


def test_gated_delta_net_adapters_resume(setup, samples, trestle, tmp_path):
    """Qwen3.5's canonical adapters (in_proj's B in the base's pieces) saved at iteration 10 resume at tp 1 with the
    uninterrupted run's losses and an identical final checkpoint (optimizer state included), and at tp 2 with sequence
    parallelism (each piece re-split by heads) within 1e-5 of peft's."""
    root = gated_delta_net_peft(setup, trestle, "qwen3_5")
    expected = peft_losses(root / "hf", samples, root / "peft")
    adapters = dict(lora=(), base=root / "base")
    full = train(trestle, setup, tmp_path / "full", "--load", root / "adapter", "--save", tmp_path / "whole",
                 "--save-interval", 10, **adapters)
    train(trestle, setup, tmp_path / "first", "--load", root / "adapter", "--save", tmp_path / "part",
          "--exit-interval", 10, **adapters)
    resumed = train(trestle, setup, tmp_path / "resumed", "--load", tmp_path / "part", "--save", tmp_path / "part",
                    "--save-interval", 10, **adapters)
    assert resumed == {i: full[i] for i in range(11, ITERS + 1)}, (resumed, full)
    trestle.run("diff", tmp_path / "whole", tmp_path / "part", "--quiet")
    other = train(trestle, setup, tmp_path / "other", "--load", tmp_path / "part", "--ckpt-step", 10, TP, 2,
                  "--sequence-parallel", world=2, **adapters)
    assert_close(other, {i: expected[i] for i in range(11, ITERS + 1)}, "Qwen3.5 LoRA resumed at tp 2")


def check_export_is_the_merged_model(trestle, root, tmp_path, *export):
    """The trained adapters of tmp_path/ckpt export (with `export`'s options) to a PEFT adapter with the imported one's
    keys, whose logits on root/hf's model in transformers are those of the merged export (1e-4); returns the exported
    adapter_config.json."""
    import peft
    trestle.run("convert", "--from", "trestle", tmp_path / "ckpt", "--to", "hf-peft", tmp_path / "peft", *export,
                "--quiet")
    exported = safetensors.torch.load_file(tmp_path / "peft" / "adapter_model.safetensors")
    imported = safetensors.torch.load_file(root / "peft" / "adapter_model.safetensors")
    assert sorted(exported) == sorted(imported)
    changed = [k for k in exported if not torch.equal(exported[k], imported[k])]
    assert len(changed) == len(exported), sorted(set(exported) - set(changed))[:8]  # every adapter trained
    trestle.run("convert", "--from", "trestle", tmp_path / "ckpt", "--to", "hf", tmp_path / "merged", "--merge-lora",
                "--quiet")
    base = auto_model(root / "hf").from_pretrained(root / "hf", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    merged = auto_model(root / "hf").from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([[2, 5, 17, 42, 7, 99, 3, 250, 11, 64]])
    with torch.no_grad():
        a, m = adapted(input_ids=ids, use_cache=False).logits, merged(input_ids=ids, use_cache=False).logits
    assert (a - m).abs().max() < 1e-4, (a - m).abs().max()
    return json.loads((tmp_path / "peft" / "adapter_config.json").read_text())


MLA_TARGETS = {"deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
               "deepseek_v3_no_q_latent": ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}
# (peft turns MLP targets of DeepSeek-V3, even the dense layer's and the shared experts', into target_parameters on
# the fused experts: test_fused_expert_peft_adapter_trains_as_peft.)


def latent_attention_peft(setup, trestle, model):
    """test_train_families' DeepSeek-V3 model (with its query latent, or without: q_lora_rank None), a PEFT adapter on
    every projection of its multi-latent attention, and its import; cached per model."""
    root = setup / model
    if not (root / "adapter").exists():
        config_class, config = families.FAMILIES["deepseek_v3"]
        if model == "deepseek_v3_no_q_latent":
            config = dict(config, q_lora_rank=None, initializer_range=0.1)  # else attention alone barely learns
        save_tiny_model(root / "hf", config_class, config, seed=37)
        trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "base", "--quiet")
        make_peft_adapter(trestle, root / "hf", root / "base", root / "peft", root / "adapter", 11,
                          targets=MLA_TARGETS[model], alpha=32)
    return root


@pytest.mark.parametrize("model,layout", ci_cases(
    [(model, layout) for model in MLA_TARGETS for layout in ("tp1", "tp2-sp", "tp2", "pp2", "dp2-distopt")],
    [("deepseek_v3", "tp2")]))
def test_latent_attention_peft_adapter_trains_as_peft(setup, samples, trestle, tmp_path, model, layout):
    """LoRA on DeepSeek-V3's multi-latent attention (Megatron-Bridge's linear_q_down_proj, linear_q_up_proj or
    linear_q_proj, linear_kv_down_proj, linear_kv_up_proj targets; the down projections' adapters replicated over the
    tp ranks as their bases are, the up projections' split by heads): the imported PEFT adapter trains with peft's
    losses (1e-5), and its trained adapters export to a PEFT adapter whose logits on the base model are the merged
    export's."""
    root = latent_attention_peft(setup, trestle, model)
    names = train_imported(trestle, setup, samples, root, tmp_path, layout, model)
    attention = "decoder.layers.1.self_attention."
    queries = ["linear_q_proj"] if model.endswith("no_q_latent") else ["linear_q_down_proj", "linear_q_up_proj"]
    assert {n for n in names if n.startswith(attention) and ".adapter." in n} == {
        f"{attention}{m}.adapter.linear_{io}.weight" for m in [*queries, "linear_kv_down_proj", "linear_kv_up_proj",
                                                                "linear_proj"] for io in ("in", "out")}
    check_export_is_the_merged_model(trestle, root, tmp_path)


# Routed experts as transformers 5 builds them, fused: peft adapts their parameters (target_parameters). DeepSeek-V3's
# MLP targets are moved there by peft itself (gate_up_proj at rank 2r and alpha 2·alpha: rank_pattern, alpha_pattern;
# the dense layer's and the shared experts' MLPs are left without adapters); GPT-OSS's are named, on its transposed,
# interleaved experts.
FUSED_EXPERT_PEFT = {
    "deepseek_v3": dict(targets=MLA_TARGETS["deepseek_v3"] + ["gate_proj", "up_proj", "down_proj"], alpha=32),
    # (separate q, k, v adapters beside the experts' fused gate_up: Trestle's peft type)
    "gpt_oss": dict(targets=["q_proj", "k_proj", "v_proj", "o_proj"],
                    parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


def fused_expert_peft(setup, trestle, family):
    """test_train_families' model, a PEFT adapter on its attention and fused experts (FUSED_EXPERT_PEFT), and its
    import; cached per family."""
    root = setup / f"{family}_fused_experts"
    if not (root / "adapter").exists():
        config_class, config = families.FAMILIES[family]
        save_tiny_model(root / "hf", config_class, config, seed=41)
        trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "base", "--quiet")
        make_peft_adapter(trestle, root / "hf", root / "base", root / "peft", root / "adapter", 13,
                          **FUSED_EXPERT_PEFT[family])
    return root


@pytest.mark.parametrize("family,layout", ci_cases(
    [(family, layout) for family in FUSED_EXPERT_PEFT
     for layout in ("tp1", "tp2-sp", "ep2", "dp2-distopt", "tp2-sp-etp1")],
    [("deepseek_v3", "ep2"), ("gpt_oss", "tp2-sp"), ("deepseek_v3", "tp2-sp-etp1")]))
def test_fused_expert_peft_adapter_trains_as_peft(setup, samples, trestle, tmp_path, family, layout):
    """PEFT adapters on fused expert parameters (one ParamWrapper per parameter over all experts): imported, each
    expert's slice of A and B becomes its Megatron expert's adapter (a rank of 2r padding the other adapters with zero
    components, which stay zero; GPT-OSS's separate q, k, v adapters beside them make the peft type: canonical, but
    one A on each expert's gate and up) and trains with peft's losses (1e-5); exported with --hf-expert-layout fused, the
    trained adapters are the imported adapter's keys, shapes and ranks again, with the logits of the merged export."""
    root = fused_expert_peft(setup, trestle, family)
    peft_config = json.loads((root / "peft" / "adapter_config.json").read_text())
    deepseek = family == "deepseek_v3"
    if deepseek:  # what peft made of the MLP targets
        assert sorted(peft_config["target_parameters"]) == ["down_proj", "gate_up_proj"], peft_config
        assert list(peft_config["rank_pattern"].values()) == [2 * RANK], peft_config
    lora = trestle.inspect(root / "adapter", checksums=False)["model"]["lora"]
    assert lora["type"] == ("lora" if deepseek else "peft") and lora["rank"] == (2 if deepseek else 1) * RANK, lora
    names = train_imported(trestle, setup, samples, root, tmp_path, layout, family)
    for fc in ("linear_fc1", "linear_fc2"):
        assert f"decoder.layers.1.mlp.experts.local_experts.3.{fc}.adapter.linear_in.weight" in names
    if not deepseek:
        assert "decoder.layers.1.self_attention.linear_qkv.adapter.adapter_k.linear_in.weight" in names
    config = check_export_is_the_merged_model(trestle, root, tmp_path, "--hf-expert-layout", "fused")
    exported = safetensors.torch.load_file(tmp_path / "peft" / "adapter_model.safetensors")
    imported = safetensors.torch.load_file(root / "peft" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in imported.items()}
    assert config["r"] == RANK and sorted(config["rank_pattern"].values()) == ([2 * RANK] if deepseek else [])


# (peft refuses out_proj on a Mamba model: its fused kernels read that weight directly.)
NEMOTRON_H_TARGETS = ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


def save_nemotron_h(directory, family, seed):
    """test_train_families' Nemotron-H model (its steps unclamped, as megatron-core runs them)."""
    config_class, config = families.FAMILIES[family]
    save_tiny_model(directory, config_class, config, seed=seed)
    hf_config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(hf_config, **families.UNCLAMPED)))


@pytest.mark.parametrize("layout", ci_cases(["tp1", "tp2-sp", "pp2", "dp2-distopt"], ["tp2-sp"]))
def test_nemotron_h_peft_adapter_trains_as_peft(setup, samples, trestle, tmp_path, layout):
    """LoRA on Nemotron-H's hybrid layers (Megatron-Bridge's in_proj target on the Mamba mixers, B saved in the base's
    five pieces z, x, B, C, dt and split over the tp ranks by heads and groups; attention; the squared-ReLU MLP's
    ungated fc1): the imported PEFT adapter trains with peft's losses (1e-5), and its trained adapters export to a
    PEFT adapter whose logits on the base model are the merged export's."""
    root = setup / "nemotron_h"
    if not (root / "adapter").exists():
        save_nemotron_h(root / "hf", "nemotron_h", 35)
        trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "base", "--quiet")
        make_peft_adapter(trestle, root / "hf", root / "base", root / "peft", root / "adapter", 9,
                          targets=NEMOTRON_H_TARGETS, alpha=32)
    names = train_imported(trestle, setup, samples, root, tmp_path, layout, "nemotron_h")
    mixer = "decoder.layers.0.mixer.in_proj.adapter."
    assert {n for n in names if n.startswith(mixer)} == {
        mixer + "linear_in.weight", *(mixer + "linear_out.weight." + piece for piece in ("z", "x", "B", "C", "dt"))}
    assert "decoder.layers.3.mlp.linear_fc1.adapter.linear_out.weight" in names
    check_export_is_the_merged_model(trestle, root, tmp_path)


@pytest.mark.parametrize("layout", ci_cases(["tp2-sp", "ep2"], ["ep2"]))
def test_nemotron_h_moe_adapters_train_alike(setup, trestle, tmp_path, tmp_path_factory, layout):
    """Nemotron 3's latent MoE with adapters on every target (the experts' in the latent space, the shared expert's,
    the Mamba mixers' in_proj and out_proj): the losses at tp 2 with sequence parallelism and ep 2 equal one rank's,
    going down; the PEFT export is refused naming the mixers' out_proj, which peft does not adapt."""
    base = setup / "nemotron_h_moe_base"
    if not base.exists():
        save_nemotron_h(setup / "nemotron_h_moe_hf", "nemotron_h_moe", 36)
        trestle.run("convert", "--from", "hf", setup / "nemotron_h_moe_hf", "--to", "trestle", base, "--quiet")
    targets = ["--lora-target-modules", "linear_qkv,linear_proj,in_proj,out_proj,linear_fc1,linear_fc2"]
    if "nemotron_h_moe" not in _moe:
        out = tmp_path_factory.mktemp("nemotron_h_moe_tp1")
        _moe["nemotron_h_moe"] = moe_train(trestle, setup, base, out, *targets, "--save", out / "ckpt")
        names = manifest(out / "ckpt")["tensors"]
        assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.adapter.linear_in.weight" in names
        assert "decoder.layers.1.mlp.shared_experts.linear_fc2.adapter.linear_out.weight" in names
        result = trestle.run_raw("convert", "--from", "trestle", out / "ckpt", "--to", "hf-peft", out / "peft")
        assert result.returncode != 0 and "decoder.layers.0.mixer.out_proj" in result.stderr and \
            "peft refuses" in result.stderr, result.stderr
        assert not (out / "peft").exists()
    expected = _moe["nemotron_h_moe"]
    assert expected[6] < expected[1], expected
    world, extra = MOE_LAYOUTS[layout] if layout in MOE_LAYOUTS else LAYOUTS[layout]
    losses = moe_train(trestle, setup, base, tmp_path, *targets, *extra, world=world)
    assert_close(losses, expected, f"Nemotron-H MoE LoRA at {layout}")


# Vision-language models: PEFT adapters on the language model alone, named by a regular expression (Gemma 3's SigLIP
# tower has q_proj, k_proj, v_proj too).
VL_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def vision_language_peft(setup, trestle, model):
    """test_train_families' tiny Qwen3-VL (or Qwen3-VL-MoE), Gemma 3 with vision or Gemma 4 with vision and audio, a
    PEFT adapter on every projection of its language model (and Qwen3-VL-MoE's fused experts), and its import; cached
    per model."""
    root = setup / model
    if not (root / "adapter").exists():
        import test_gemma3_vl_convert
        import test_qwen3_vl_convert
        import test_gemma4_convert
        parameters = None
        if model == "gemma4_multimodal":
            test_gemma4_convert.save_tiny_gemma4_multimodal(root / "hf", 41, qk_norm_scale=0.5,
                                                            **families.FAMILIES["gemma4"][1])
        elif model == "qwen3_vl_moe":  # its experts fused: target_parameters
            import test_qwen3_vl_moe_convert
            # (stored as Qwen publishes it, transposed; transformers builds it [E, 2I, H], which peft adapts)
            test_qwen3_vl_moe_convert.save_tiny_qwen3_vl_moe(root / "hf", 41, transposed=True,
                                                             vocab_size=families.COMMON["vocab_size"])
            parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        else:
            save = {"qwen3_vl": test_qwen3_vl_convert.save_tiny_qwen3_vl,
                    "gemma3_vl": test_gemma3_vl_convert.save_tiny_gemma3_vl}[model]
            save(root / "hf", 41, vocab_size=families.COMMON["vocab_size"])
        trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "base", "--quiet")
        # (alpha 128 on Qwen3-VL-MoE: at 32 its loss falls by under 0.05 in 20 iterations)
        make_peft_adapter(trestle, root / "hf", root / "base", root / "peft", root / "adapter", 8, targets=VL_TARGETS,
                          alpha=128 if parameters else 32, parameters=parameters)
    return root


@pytest.mark.parametrize("model,layout", ci_cases(
    [(model, layout) for model in ("qwen3_vl", "gemma3_vl") for layout in ("tp1", "tp2-sp", "pp2", "dp2-distopt")] +
    [("gemma4_multimodal", "tp1")] + [("qwen3_vl_moe", layout) for layout in ("tp1", "tp2-sp", "ep2")],
    [("gemma3_vl", "tp2-sp")]))
def test_vision_language_peft_adapter_trains_as_peft(setup, samples, trestle, tmp_path, model, layout):
    """LoRA on a vision-language model's text: the imported PEFT adapter (its language model's projections) trains with
    peft's losses (1e-5), the towers carried frozen from the base and not saved with the adapters; the trained adapters
    export to a PEFT adapter whose logits on the base model are the merged export's (towers included), naming the
    language model's modules by a regular expression where their names are also the tower's (Gemma 3's)."""
    root = vision_language_peft(setup, trestle, model)
    names = train_imported(trestle, setup, samples, root, tmp_path, layout, model)
    assert all(".adapter." in n for n in names if not n.startswith("optimizer.")), sorted(names)[:20]
    config = check_export_is_the_merged_model(trestle, root, tmp_path)
    targets = config["target_modules"]
    assert isinstance(targets, str) == (model not in ("qwen3_vl", "qwen3_vl_moe")), targets  # Gemma's towers too
    if model == "qwen3_vl_moe":  # q, k, v apart and the experts' fused gate_up: the peft type
        assert trestle.inspect(root / "adapter", checksums=False)["model"]["lora"]["type"] == "peft"
        assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"], config


# --- adapters from scratch ----------------------------------------------------------------------------------------

_runs = {}


def scratch_run(trestle, setup, layout, tmp_path_factory, *extra):
    key = (layout, *map(str, extra))
    if key not in _runs:
        out = tmp_path_factory.mktemp("scratch_" + layout)
        world, layout_extra = LAYOUTS[layout]
        if layout == "tp1" and not extra:
            layout_extra = [*layout_extra, "--save", out / "ckpt", "--save-interval", 10]
        _runs[key] = (train(trestle, setup, out, *layout_extra, *extra, world=world), out / "ckpt")
    return _runs[key]


def test_first_loss_is_the_base_models_and_saves_hold_adapters_only(setup, trestle, tmp_path, tmp_path_factory):
    before = tree_digest(setup / "base")
    losses, ckpt = scratch_run(trestle, setup, "tp1", tmp_path_factory)
    assert tree_digest(setup / "base") == before, "training LoRA changed the base checkpoint"
    full = loop.train(trestle, setup, tmp_path, load=setup / "base", iters=4)[0]
    assert loop.close(losses[1], full[1], 1e-6), (losses[1], full[1])
    assert losses[ITERS] < losses[1] - 0.05, losses
    m = manifest(ckpt)
    base_dir = pathlib.Path(m["model"]["lora"]["base"]["path"])
    assert base_dir.parent == (setup / "base").resolve()
    assert m["model"]["lora"]["base"]["manifest_xxh3_64"] == trestle.inspect(base_dir, checksums=False).get(
        "manifest_xxh3_64", m["model"]["lora"]["base"]["manifest_xxh3_64"])
    assert m["model"]["lora"]["rank"] == RANK and m["model"]["lora"]["alpha"] == ALPHA
    weights = [n for n in m["tensors"] if not n.startswith("optimizer.")]
    assert weights and all(".adapter." in n for n in weights), weights
    assert len(weights) == LLAMA["num_hidden_layers"] * 4 * 2
    assert any(n.startswith("optimizer.exp_avg.") for n in m["tensors"])
    # The adapters' weights are under 2% of the base's (the tiny model's data files are mostly 4 KiB alignment).
    def elements(m, keep):
        return sum(math.prod(t["global_shape"]) for n, t in m["tensors"].items() if keep(n))
    ratio = elements(m, lambda n: ".adapter." in n and not n.startswith("optimizer.")) / elements(
        manifest(setup / "base"), lambda n: True)
    assert ratio < 0.02, ratio


@pytest.mark.parametrize("layout,extra", ci_cases(
    [("tp2-sp", ()), ("pp2", ()), ("dp2-distopt", ()), ("cp2", ()), ("tp1", ("--recompute-granularity", "full"))],
    [("tp2-sp", ()), ("pp2", ()), ("cp2", ()), ("tp1", ("--recompute-granularity", "full"))]))
def test_same_losses_in_every_layout(setup, trestle, tmp_path_factory, layout, extra):
    expected, _ = scratch_run(trestle, setup, "tp1", tmp_path_factory)
    losses, _ = scratch_run(trestle, setup, layout, tmp_path_factory, *extra)
    assert_close(losses, expected, f"LoRA from scratch at {layout} {extra}")


def test_resume_is_bit_exact_and_continues_on_another_layout(setup, trestle, tmp_path, tmp_path_factory):
    expected, ckpt = scratch_run(trestle, setup, "tp1", tmp_path_factory)
    # With the first run's LoRA flags repeated, as a requeued job's command line does (they were refused); the default
    # targets given in another order.
    resumed = train(trestle, setup, tmp_path / "same", "--load", ckpt, "--ckpt-step", 10, "--save",
                    tmp_path / "same" / "ckpt", "--lora-target-modules", "linear_fc2,linear_fc1,linear_proj,linear_qkv")
    assert sorted(resumed) == list(range(11, ITERS + 1))
    assert all(resumed[i] == expected[i] for i in resumed), (resumed, expected)
    # The saved adapters and their optimizer state are the uninterrupted run's, bit for bit.
    trestle.run("diff", ckpt, tmp_path / "same" / "ckpt", "--quiet")
    other = train(trestle, setup, tmp_path / "other", "--load", ckpt, "--ckpt-step", 10, TP, 2,
                  "--sequence-parallel", world=2, lora=())
    assert_close(other, {i: expected[i] for i in other}, "resumed at tp 2")


def test_canonical_type_trains_in_layouts(setup, trestle, tmp_path):
    canonical = ("--lora-rank", RANK, "--lora-alpha", ALPHA, "--lora-type", "canonical")
    one = train(trestle, setup, tmp_path / "tp1", iters=6, lora=canonical)
    two = train(trestle, setup, tmp_path / "tp2", TP, 2, "--sequence-parallel", world=2, iters=6, lora=canonical)
    assert_close(two, one, "canonical LoRA at tp 2")
    assert one[6] < one[1], one


def test_no_save_optim_keeps_the_adapters_only(setup, trestle, tmp_path):
    """Megatron's --no-save-optim: the adapter checkpoint holds the adapters alone (rank-16 adapters on TinyLlama's shape
    are 0.95% of its elements: 1.9% of a bf16 base's bytes in fp32). Resuming from it is refused without
    --no-load-optim, as Megatron-LM's load_checkpoint stops; with it the optimizer starts fresh."""
    train(trestle, setup, tmp_path / "a", "--save", tmp_path / "a" / "ckpt", "--no-save-optim", iters=4)
    m = manifest(tmp_path / "a" / "ckpt")
    assert m["tensors"] and all(".adapter." in n for n in m["tensors"]), sorted(m["tensors"])
    out = tmp_path / "b"
    out.mkdir()
    resume = ["train", "--data-path", setup / "data" / "kjv_text_document", "--split", "98,2,0", "--micro-batch-size",
              MBS, "--global-batch-size", GBS, "--seq-length", SEQ, "--train-iters", 6, "--lr", LR, "--eval-iters", 0,
              "--load", tmp_path / "a" / "ckpt", "--pretrained-checkpoint", setup / "base"]
    refused = trestle.run_raw(*resume, timeout=300)
    assert refused.returncode == 1 and "iteration 4 holds no optimizer state" in refused.stderr and \
        "--no-load-optim" in refused.stderr, refused.stderr
    log = trestle.run(*resume, "--no-load-optim", timeout=300)
    assert "no optimizer state: the optimizer starts fresh" in log, log


def test_refusals(setup, trestle, tmp_path, tmp_path_factory):
    _, ckpt = scratch_run(trestle, setup, "tp1", tmp_path_factory)
    common = ["train", "--data-path", setup / "data" / "kjv_text_document", "--micro-batch-size", MBS,
              "--global-batch-size", GBS, "--seq-length", SEQ, "--train-iters", 2, "--lr", LR]
    result = trestle.run_raw(*common, "--load", ckpt)
    assert result.returncode != 0 and "--pretrained-checkpoint" in result.stderr, result.stderr
    save_tiny_model(tmp_path / "other_hf", "LlamaConfig", LLAMA, seed=22)
    trestle.run("convert", "--from", "hf", tmp_path / "other_hf", "--to", "trestle", tmp_path / "other", "--quiet")
    result = trestle.run_raw(*common, "--load", ckpt, "--pretrained-checkpoint", tmp_path / "other")
    assert result.returncode != 0 and "digest" in result.stderr, result.stderr
    result = trestle.run_raw(*common, "--pretrained-checkpoint", setup / "base", "--lora-rank", 2, "--save",
                             setup / "base")
    assert result.returncode != 0 and "never rewritten" in result.stderr, result.stderr
    result = trestle.run_raw(*common, "--pretrained-checkpoint", setup / "base", "--lora-rank", 2,
                             "--lora-target-modules", "linear_q")
    assert result.returncode != 0 and "linear_q'" in result.stderr, result.stderr
    result = trestle.run_raw(*common, "--load", setup / "base", "--lora-rank", 2)
    assert result.returncode != 0 and "--pretrained-checkpoint" in result.stderr, result.stderr
    # A Megatron base is named as one (its tracker's iteration 0 was said not to be a committed checkpoint), and an
    # adapter checkpoint is not resharded (its adapters were "neither weights of the model nor optimizer state").
    trestle.run("convert", "--from", "trestle", setup / "base", "--to", "megatron-dist", tmp_path / "mdist", "--quiet")
    result = trestle.run_raw(*common, "--pretrained-checkpoint", tmp_path / "mdist", "--lora-rank", 2)
    assert result.returncode != 0 and f"--pretrained-checkpoint {tmp_path / 'mdist'} is a megatron-dist checkpoint; " \
        "LoRA's base is a Trestle checkpoint: convert it first" in result.stderr, result.stderr
    result = trestle.run_raw("reshard", ckpt, tmp_path / "resharded", "--tp", 2)
    assert result.returncode == 1 and "an adapter checkpoint is not resharded" in result.stderr, result.stderr
    # Resuming the adapters takes their configuration: a LoRA flag saying otherwise is named with the saved value.
    for flag, value, saved in (("--lora-rank", RANK + 1, RANK), ("--lora-alpha", ALPHA * 2, ALPHA),
                               ("--lora-type", "canonical", "lora"), ("--lora-target-modules", "linear_qkv", None)):
        result = trestle.run_raw(*common, "--load", ckpt, "--pretrained-checkpoint", setup / "base", flag, value)
        assert result.returncode != 0 and f"{flag} {value}: the adapter checkpoint" in result.stderr and \
            (saved is None or f"trained with {saved} " in result.stderr), result.stderr


def iteration_dir(root):
    tracker = (pathlib.Path(root) / "latest_checkpointed_iteration.txt").read_text().strip()
    return pathlib.Path(root) / f"iter_{int(tracker):07d}"


def test_the_base_is_known_by_its_weights(setup, trestle, tmp_path, tmp_path_factory):
    """The adapters' base may be resharded (its weights moved bit for bit: reshard records their origin) or written
    again in another layout (then compared tensor by tensor with the recorded base): resuming and merging take it and
    say so; a base with other weights is refused naming a tensor that differs."""
    expected, ckpt = scratch_run(trestle, setup, "tp1", tmp_path_factory)
    digest = xxhash.xxh3_64_hexdigest((iteration_dir(setup / "base") / "manifest.json").read_bytes())
    trestle.run("reshard", setup / "base", tmp_path / "base_tp2", "--tp", 2, "--quiet")
    trestle.run("reshard", tmp_path / "base_tp2", tmp_path / "base_back", "--tp", 1, "--quiet")
    for resharded in ("base_tp2", "base_back"):
        assert manifest(tmp_path / resharded)["training"]["weights_origin_xxh3_64"] == digest, resharded
        shown = trestle.inspect(tmp_path / resharded, checksums=False)
        assert shown["weights_origin_xxh3_64"] == digest and shown["manifest_xxh3_64"] == xxhash.xxh3_64_hexdigest(
            (iteration_dir(tmp_path / resharded) / "manifest.json").read_bytes()), shown
    common = ["train", "--data-path", setup / "data" / "kjv_text_document", "--split", "98,2,0", "--micro-batch-size",
              MBS, "--global-batch-size", GBS, "--seq-length", SEQ, "--train-iters", ITERS, "--lr", LR, "--min-lr",
              MIN_LR, "--lr-warmup-iters", WARMUP, "--lr-decay-style", "cosine", "--weight-decay", WD, "--clip-grad",
              CLIP, "--adam-beta2", BETA2, "--log-interval", 1, "--eval-interval", 1000, "--eval-iters", 0]

    def resume(base, name, load=ckpt, step=10):
        log = tmp_path / f"{name}.jsonl"
        result = trestle.run_raw(*common, "--load", load, "--ckpt-step", step, "--pretrained-checkpoint", base,
                                 "--log-json", log, timeout=300)
        assert result.returncode == 0, result.stderr
        return loop.read_losses(log)[0], result.stderr

    # Back in its own layout the weights are the same bits: the resumed losses are the uninterrupted run's exactly.
    losses, said = resume(tmp_path / "base_back", "back")
    assert sorted(losses) == list(range(11, ITERS + 1)) and all(losses[i] == expected[i] for i in losses), losses
    assert "holds the weights the adapters of" in said and f"weights origin is {digest}" in said, said
    losses, said = resume(tmp_path / "base_tp2", "tp2")
    assert_close(losses, {i: expected[i] for i in losses}, "resumed on the resharded base")
    # Converted again from Hugging Face at tp 2: another manifest, no recorded origin; compared with the recorded base.
    trestle.run("convert", "--from", "hf", setup / "hf", "--to", "trestle", tmp_path / "converted", "--tp", 2,
                "--quiet")
    assert "weights_origin_xxh3_64" not in manifest(tmp_path / "converted")["training"]
    result = trestle.run_raw(*common, "--load", ckpt, "--ckpt-step", 10, "--pretrained-checkpoint",
                             tmp_path / "converted", "--log-json", tmp_path / "converted.jsonl", "--save",
                             tmp_path / "on_converted", "--exit-interval", 12, timeout=300)
    assert result.returncode == 0 and "with the same model and every tensor equal bit for bit" in result.stderr, \
        result.stderr
    losses = loop.read_losses(tmp_path / "converted.jsonl")[0]
    # Its saves record the base given, with the weights origin of the one compared: the original base is theirs too.
    recorded = manifest(tmp_path / "on_converted")["model"]["lora"]["base"]
    assert recorded["weights_origin_xxh3_64"] == digest and recorded["manifest_xxh3_64"] != digest, recorded
    assert_close(losses, {i: expected[i] for i in losses}, "resumed on the base converted again")
    # Other weights of the same model: refused, naming a tensor and how many of its elements differ.
    save_tiny_model(tmp_path / "other_hf", "LlamaConfig", LLAMA, seed=22)
    trestle.run("convert", "--from", "hf", tmp_path / "other_hf", "--to", "trestle", tmp_path / "other", "--quiet")
    result = trestle.run_raw(*common, "--load", ckpt, "--pretrained-checkpoint", tmp_path / "other", timeout=300)
    assert result.returncode == 1 and "is not the base the adapters of" in result.stderr and \
        "differs from the recorded base's in" in result.stderr, result.stderr
    # A base of another shape whose manifest claims the recorded origin (edited, its checksum member dropped): the
    # adapters stored wider than its layers are refused, not cut to fit.
    save_tiny_model(tmp_path / "narrow_hf", "LlamaConfig", dict(LLAMA, hidden_size=32, intermediate_size=64), seed=23)
    trestle.run("convert", "--from", "hf", tmp_path / "narrow_hf", "--to", "trestle", tmp_path / "narrow", "--quiet")
    narrow = iteration_dir(tmp_path / "narrow") / "manifest.json"
    edited = json.loads(narrow.read_text())
    edited["training"]["weights_origin_xxh3_64"] = digest
    del edited["manifest_xxh3_64"]
    narrow.write_text(json.dumps(edited))
    result = trestle.run_raw(*common, "--load", ckpt, "--pretrained-checkpoint", tmp_path / "narrow", timeout=300)
    assert result.returncode == 1 and "linear_in.weight has the global shape [4, 64]; the model's is [4, 32]" in \
        result.stderr, result.stderr
    # Merging takes the resharded base as the base and writes the same files.
    trestle.run("convert", "--from", "trestle", ckpt, "--to", "hf", tmp_path / "merged", "--merge-lora", "--quiet")
    merged = trestle.run_raw("convert", "--from", "trestle", ckpt, "--to", "hf", tmp_path / "merged_tp2",
                             "--merge-lora", "--base", tmp_path / "base_tp2", "--quiet")
    assert merged.returncode == 0 and "in another layout or copy" in merged.stderr, merged.stderr
    for file in (tmp_path / "merged").glob("*.safetensors"):
        assert file.read_bytes() == (tmp_path / "merged_tp2" / file.name).read_bytes(), file.name
    # Adapters trained on the resharded base record its origin: the original base is theirs too.
    train(trestle, setup, tmp_path / "on_tp2", "--save", tmp_path / "on_tp2" / "ckpt", "--exit-interval", 2,
          base=tmp_path / "base_tp2")
    base = manifest(tmp_path / "on_tp2" / "ckpt")["model"]["lora"]["base"]
    assert base["weights_origin_xxh3_64"] == digest and base["manifest_xxh3_64"] != digest, base
    losses, said = resume(setup / "base", "on_tp2", load=tmp_path / "on_tp2" / "ckpt", step=2)
    assert sorted(losses) == list(range(3, ITERS + 1)) and "in another layout or copy" in said, (losses, said)


QWEN2_MOE = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=256, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                 num_experts_per_tok=2, shared_expert_intermediate_size=48, rms_norm_eps=1e-6,
                 tie_word_embeddings=False)
MOE_LAYOUTS = {"ep2": (2, ["--expert-model-parallel-size", 2]),
               "tp2-sp-ep2": (4, [TP, 2, "--sequence-parallel", "--expert-model-parallel-size", 2]),
               "dp2-distopt": (2, ["--use-distributed-optimizer"])}


MOE_MODELS = {"qwen2_moe": ("Qwen2MoeConfig", QWEN2_MOE),
              "deepseek_v3": ("DeepseekV3Config", dict(families.FAMILIES["deepseek_v3"][1], num_hidden_layers=2))}


def moe_base(setup, trestle, model):
    if not (setup / f"{model}_base").exists():
        config_class, config = MOE_MODELS[model]
        save_tiny_model(setup / f"{model}_hf", config_class, config, seed=23)
        trestle.run("convert", "--from", "hf", setup / f"{model}_hf", "--to", "trestle", setup / f"{model}_base",
                    "--quiet")
    return setup / f"{model}_base"


def moe_train(trestle, setup, base, out, *extra, world=1, lora_type="canonical"):
    out.mkdir(parents=True, exist_ok=True)
    log = out / "log.jsonl"
    trestle.run("train", "--nproc-per-node", world, "--data-path", setup / "data" / "kjv_text_document",
                "--split", "98,2,0", "--micro-batch-size", MBS, "--global-batch-size", GBS, "--seq-length", SEQ,
                "--train-iters", 6, "--lr", LR, "--min-lr", MIN_LR, "--lr-warmup-iters", 2,
                "--lr-decay-style", "cosine", "--weight-decay", WD, "--clip-grad", CLIP, "--log-interval", 1,
                "--eval-interval", 1000, "--eval-iters", 0, "--log-json", log, "--pretrained-checkpoint", base,
                "--lora-rank", RANK, "--lora-type", lora_type, *extra, timeout=300)
    return loop.read_losses(log)[0]


_moe = {}


def check_dense_mlp_adapters_load_in_peft(trestle, setup, out):
    """DeepSeek-V3's dense layer's and shared experts' MLPs are named as the experts' projections, which peft on
    transformers 5 moves onto the fused experts: the per-expert export says so; the fused export names those MLPs by
    their weights in target_parameters, and peft loads it with the merged export's logits; imported again, it exports
    the same file."""
    import peft
    said = trestle.run("convert", "--from", "trestle", out / "ckpt", "--to", "hf-peft", out / "peft")
    assert "adapters on other MLPs of those names (model.layers.0.mlp.gate_proj, ...) would then not load" in said, said
    trestle.run("convert", "--from", "trestle", out / "ckpt", "--to", "hf-peft", out / "fused", "--hf-expert-layout",
                "fused", "--quiet")
    config = json.loads((out / "fused" / "adapter_config.json").read_text())
    assert not {"gate_proj", "up_proj", "down_proj"} & set(config["target_modules"]), config
    assert {"gate_proj.weight", "experts.gate_up_proj"} <= set(config["target_parameters"]), config
    trestle.run("convert", "--from", "trestle", out / "ckpt", "--to", "hf", out / "merged", "--merge-lora", "--quiet")
    hf = setup / "deepseek_v3_hf"
    adapted = peft.PeftModel.from_pretrained(auto_model(hf).from_pretrained(hf, dtype=torch.float32),
                                             str(out / "fused")).eval()
    merged = auto_model(hf).from_pretrained(out / "merged", dtype=torch.float32).eval()
    base = auto_model(hf).from_pretrained(hf, dtype=torch.float32).eval()
    ids = torch.tensor([[2, 5, 17, 42, 7, 99, 3, 250, 11, 64]])
    with torch.no_grad():
        a, m, b = (x(input_ids=ids, use_cache=False).logits for x in (adapted, merged, base))
    assert (a - m).abs().max() < 1e-4 < (b - m).abs().max(), ((a - m).abs().max(), (b - m).abs().max())
    trestle.run("convert", "--from", "hf-peft", out / "fused", "--base", setup / "deepseek_v3_base", "--to", "trestle",
                out / "imported", "--quiet")
    trestle.run("convert", "--from", "trestle", out / "imported", "--to", "hf-peft", out / "again",
                "--hf-expert-layout", "fused", "--quiet")
    again = safetensors.torch.load_file(out / "again" / "adapter_model.safetensors")
    first = safetensors.torch.load_file(out / "fused" / "adapter_model.safetensors")
    assert sorted(again) == sorted(first) and all(torch.equal(again[k], first[k]) for k in first)
    assert json.loads((out / "again" / "adapter_config.json").read_text()) == config


@pytest.mark.parametrize("model,layout", ci_cases([("qwen2_moe", layout) for layout in MOE_LAYOUTS] +
                                                  [("deepseek_v3", "tp2-sp-ep2")],
                                                  [("qwen2_moe", "ep2"), ("deepseek_v3", "tp2-sp-ep2")]))
def test_expert_adapters_train_alike_in_every_layout(setup, trestle, tmp_path, tmp_path_factory, model, layout):
    """Adapters on every routed expert and the shared expert (and attention; DeepSeek-V3: each projection of its
    multi-latent attention, its dense first layer, its frozen expert bias) train the same at ep 2, tp 2 x ep 2 with
    sequence parallelism and under the distributed optimizer as at one rank, and save per expert (Qwen2-MoE as the
    peft type: the routed experts' gate and up with one adapter, the shared expert's and attention's canonical).
    DeepSeek-V3's PEFT export says that peft on transformers 5 would not load its dense and shared-expert MLP
    adapters."""
    base = moe_base(setup, trestle, model)
    targets = ["--lora-target-modules", "linear_q_down_proj,linear_q_up_proj,linear_kv_down_proj,linear_kv_up_proj,"
               "linear_proj,linear_fc1,linear_fc2"] if model == "deepseek_v3" else []
    lora_type = "canonical" if model == "deepseek_v3" else "peft"
    if model not in _moe:
        out = tmp_path_factory.mktemp(f"{model}_tp1")
        _moe[model] = moe_train(trestle, setup, base, out, "--save", out / "ckpt", *targets, lora_type=lora_type)
        names = manifest(out / "ckpt")["tensors"]
        expert_fc1 = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.adapter."
        assert expert_fc1 + ("adapter_up.linear_out.weight" if model == "deepseek_v3" else "linear_out.weight") in names
        assert "decoder.layers.1.mlp.shared_experts.linear_fc1.adapter.adapter_gate.linear_in.weight" in names
        assert "decoder.layers.1.mlp.shared_experts.linear_fc2.adapter.linear_in.weight" in names
        assert all(".adapter." in n for n in names if not n.startswith("optimizer."))
        if model == "deepseek_v3":
            check_dense_mlp_adapters_load_in_peft(trestle, setup, out)
    expected = _moe[model]
    assert expected[6] < expected[1], expected
    world, extra = MOE_LAYOUTS[layout]
    assert_close(moe_train(trestle, setup, base, tmp_path, *extra, *targets, world=world, lora_type=lora_type),
                 expected, f"{model} LoRA at {layout}")


@pytest.mark.parametrize("family", ci_cases(["gemma2", "gemma3", "olmo2", "phi3", "gpt_oss"], ["gpt_oss"]))
def test_every_family_trains_adapters_alike_at_tp2(setup, trestle, tmp_path, family):
    """Adapters on the families the trainer-breadth work added (CI: GPT-OSS's biased linears, sinks, alternating
    windows and clamped experts, each expert adapted): the same losses at tp 2 with sequence parallelism as at one
    rank, going down."""
    config_class, config = families.FAMILIES[family]
    config = dict(config, num_hidden_layers=2)
    if "layer_types" in config:  # Gemma 3: one local and one global layer
        config["layer_types"] = ["sliding_attention", "full_attention"]
    save_tiny_model(tmp_path / "hf", config_class, config, seed=24)
    trestle.run("convert", "--from", "hf", tmp_path / "hf", "--to", "trestle", tmp_path / "base", "--quiet")
    one = moe_train(trestle, setup, tmp_path / "base", tmp_path / "tp1")
    two = moe_train(trestle, setup, tmp_path / "base", tmp_path / "tp2", TP, 2, "--sequence-parallel", world=2)
    assert_close(two, one, f"{family} LoRA at tp 2")
    assert one[6] < one[1], one


@pytest.mark.parametrize("layout", ci_cases(["tp2-sp", "ep2", "dp2-distopt"], ["tp2-sp"]))
def test_gated_delta_net_fused_adapters_train_alike(setup, trestle, tmp_path, tmp_path_factory, layout):
    """Qwen3.5-MoE with Megatron-Bridge's LoRA (one adapter per linear) on every target, in_proj and out_proj included:
    in_proj's B is saved in the base's six pieces (each split over the tp ranks by heads); the losses at tp 2 with
    sequence parallelism, ep 2 and under the distributed optimizer equal one rank's, going down."""
    config_class, config = families.FAMILIES["qwen3_5_moe"]
    base = setup / "qwen3_5_moe_base"
    if not base.exists():
        save_tiny_model(setup / "qwen3_5_moe_hf", config_class, config, seed=25)
        trestle.run("convert", "--from", "hf", setup / "qwen3_5_moe_hf", "--to", "trestle", base, "--quiet")
    targets = ["--lora-target-modules", "linear_qkv,linear_proj,in_proj,out_proj,linear_fc1,linear_fc2"]
    if "qwen3_5_moe" not in _moe:
        out = tmp_path_factory.mktemp("qwen3_5_moe_tp1")
        _moe["qwen3_5_moe"] = moe_train(trestle, setup, base, out, *targets, "--save", out / "ckpt", lora_type="lora")
        names = manifest(out / "ckpt")["tensors"]
        in_proj = "decoder.layers.0.self_attention.in_proj.adapter."
        assert {n for n in names if n.startswith(in_proj)} == {
            in_proj + "linear_in.weight", *(in_proj + "linear_out.weight." + piece
                                            for piece in ("query", "key", "value", "z", "beta", "alpha"))}, names
        assert "decoder.layers.0.self_attention.out_proj.adapter.linear_out.weight" in names
        assert "decoder.layers.1.self_attention.linear_qkv.adapter.linear_out.weight" in names
    expected = _moe["qwen3_5_moe"]
    assert expected[6] < expected[1], expected
    world, extra = MOE_LAYOUTS[layout] if layout in MOE_LAYOUTS else LAYOUTS[layout]
    losses = moe_train(trestle, setup, base, tmp_path, *targets, *extra, world=world, lora_type="lora")
    assert_close(losses, expected, f"Qwen3.5-MoE LoRA at {layout}")

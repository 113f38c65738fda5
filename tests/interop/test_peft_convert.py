"""LoRA adapters between Trestle and Hugging Face PEFT (`trestle convert --to hf-peft`, `--to hf --merge-lora`,
`--from hf-peft --base`), checked against `peft` and `transformers`:

- adapters trained by `trestle train` (fused `lora` and `canonical` types, a grouped-query model) export to a PEFT
  adapter that `peft` loads with no missing or unexpected keys and whose logits equal the merged export's (1e-5, fp32);
  the merged weights are W + (alpha / r) B A of the exported A and B;
- a PEFT adapter made by `peft` imports and exports back bit-exactly (at tp 1 and tp 2), a partial one (q and v only)
  gets zero k adapters, Phi-3's fused qkv_proj / gate_up_proj import as the fused type;
- MoE adapters on every expert (Mixtral, Qwen3-MoE) export in the per-expert layout `peft` loads for those models;
- bad input is refused naming the file and tensor, and nothing is written; an adapter checkpoint goes to hf only merged,
  and only onto its own base; `trestle inspect` and the Python package see adapters too.
"""
import json
import os
import pathlib
import sys
import warnings

import pytest
import safetensors.torch
import torch
import transformers

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from models import save_tiny_model  # noqa: E402
import test_train_loop as loop  # noqa: E402

RANK, ALPHA = 4, 8
LLAMA = dict(loop.LLAMA, num_hidden_layers=2)  # 4 heads, 2 KV heads: the fused QKV order matters
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3 = dict(vocab_size=4096, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, tie_word_embeddings=False)
MIXTRAL = dict(vocab_size=512, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
               tie_word_embeddings=False)
QWEN3_MOE = dict(vocab_size=512, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=256,
                 tie_word_embeddings=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    root = tmp_path_factory.mktemp("peft")
    (root / "data").mkdir()
    trestle.run("preprocess", "--input", loop.CORPUS / "kjv.jsonl", "--output-prefix", root / "data" / "kjv",
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", loop.CORPUS / "tokenizer.json",
                "--append-eod", "--quiet")
    save_tiny_model(root / "hf", "LlamaConfig", LLAMA, seed=31)
    trestle.run("convert", "--from", "hf", root / "hf", "--to", "trestle", root / "base", "--quiet")
    return root


def train_adapters(trestle, setup, out, lora_type):
    """Six iterations of LoRA from scratch: B is non-zero after them."""
    trestle.run("train", "--data-path", setup / "data" / "kjv_text_document", "--split", "98,2,0",
                "--micro-batch-size", 2, "--global-batch-size", 4, "--seq-length", 32, "--train-iters", 6,
                "--lr", 1e-2, "--log-interval", 1, "--eval-interval", 1000, "--eval-iters", 0,
                "--pretrained-checkpoint", setup / "base", "--lora-rank", RANK, "--lora-alpha", ALPHA,
                "--lora-type", lora_type, "--save", out, timeout=300)
    return out


def tokens(vocab):
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(7))


def load_peft(hf_dir, peft_dir):
    """`peft`'s model of the adapter on the base, failing on any missing or unexpected adapter key."""
    import peft
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(base, peft_dir).eval()
    bad = [str(w.message) for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message)]
    assert not bad, bad
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def hf_tensors(directory):
    out = {}
    for f in sorted(pathlib.Path(directory).glob("*.safetensors")):
        out.update(safetensors.torch.load_file(f))
    return out


def check_merged(trestle, hf_dir, adapter_ckpt, peft_dir, out, vocab, base_ckpt=None):
    """The merged export equals W + (alpha / r) B A and gives `peft`'s logits. MoE (base_ckpt given): both exported
    with per-expert tensors, the names PEFT's adapter has."""
    experts = ["--hf-expert-layout", "original"] if base_ckpt else []
    trestle.run("convert", "--from", "trestle", adapter_ckpt, "--to", "hf", out, "--merge-lora", *experts, "--quiet")
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    adapters = safetensors.torch.load_file(peft_dir / "adapter_model.safetensors")
    base_dir = hf_dir
    if base_ckpt:
        base_dir = out.parent / (out.name + "-base")
        trestle.run("convert", "--from", "trestle", base_ckpt, "--to", "hf", base_dir, *experts, "--quiet")
    base, merged = hf_tensors(base_dir), hf_tensors(out)
    assert sorted(base) == sorted(merged)
    modules = {k[len("base_model.model."):-len(".lora_A.weight")] for k in adapters if k.endswith(".lora_A.weight")}
    assert modules
    for m in modules:
        a = adapters[f"base_model.model.{m}.lora_A.weight"].double()
        b = adapters[f"base_model.model.{m}.lora_B.weight"].double()
        w = base[m + ".weight"].double()
        torch.testing.assert_close(merged[m + ".weight"].double(), w + scale * b @ a, rtol=0, atol=2e-6)
    untouched = [k for k in base if k[:-len(".weight")] not in modules]
    assert untouched and all(torch.equal(base[k], merged[k]) for k in untouched)
    ids = tokens(vocab)
    want = logits(transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), ids)
    got = logits(load_peft(hf_dir, peft_dir), ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, logits(transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32).eval(), ids), atol=1e-4), "the adapters change nothing"


@pytest.mark.parametrize("lora_type", ["lora", "canonical"])
def test_trained_adapters_export_to_peft_with_the_merged_logits(setup, trestle, tmp_path, lora_type):
    ckpt = train_adapters(trestle, setup, tmp_path / "ckpt", lora_type)
    trestle.run("convert", "--from", "trestle", ckpt, "--to", "hf-peft", tmp_path / "peft", "--quiet")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == RANK and config["lora_alpha"] == ALPHA
    assert sorted(config["target_modules"]) == sorted(HF_TARGETS)
    keys = safetensors.torch.load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert len(keys) == LLAMA["num_hidden_layers"] * len(HF_TARGETS) * 2
    if lora_type == "lora":  # one fused adapter: q, k and v share its A
        layer = "base_model.model.model.layers.0.self_attn."
        assert torch.equal(keys[layer + "q_proj.lora_A.weight"], keys[layer + "k_proj.lora_A.weight"])
    check_merged(trestle, setup / "hf", ckpt, tmp_path / "peft", tmp_path / "merged", LLAMA["vocab_size"])


def make_peft(hf_dir, out, targets, seed=5, scale_b=0.05, parameters=None):
    """A PEFT adapter with random non-zero A and B (on `parameters` too: target_parameters), saved by `peft`."""
    import peft
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets,
                                                       target_parameters=parameters, init_lora_weights=False,
                                                       task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale_b)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_peft_adapter_imports_and_exports_back_exactly(setup, trestle, tmp_path, tp):
    peft_dir = make_peft(setup / "hf", tmp_path / "peft", HF_TARGETS)
    trestle.run("convert", "--from", "hf-peft", peft_dir, "--base", setup / "base", "--to", "trestle",
                tmp_path / "adapter", "--tp", tp, "--quiet")
    info = trestle.inspect(tmp_path / "adapter", checksums=False)
    lora = info["model"]["lora"]
    assert lora["type"] == "canonical" and lora["rank"] == RANK and lora["alpha"] == ALPHA
    assert lora["target_modules"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert info["layout"]["tp"] == tp
    trestle.run("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf-peft", tmp_path / "back", "--quiet")
    want = safetensors.torch.load_file(peft_dir / "adapter_model.safetensors")
    got = safetensors.torch.load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    check_merged(trestle, setup / "hf", tmp_path / "adapter", tmp_path / "back", tmp_path / "merged",
                 LLAMA["vocab_size"])


def test_a_non_finite_adapter_value_stays_in_its_own_module_when_merged(setup, trestle, tmp_path):
    """q, k and v adapters become one linear_qkv adapter (their A stacked, B block-diagonal): a NaN in q's A merges
    into q's rows only, as PEFT's merge of each module alone does (it spread into k's and v's rows through B's zero
    blocks)."""
    peft_dir = make_peft(setup / "hf", tmp_path / "peft", HF_TARGETS)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def poison(t):
        t[key] = t[key].clone()
        t[key][0, 0] = float("nan")
    bad = rewrite(peft_dir, tmp_path / "bad", tensors=poison)
    trestle.run("convert", "--from", "hf-peft", bad, "--base", setup / "base", "--to", "trestle", tmp_path / "adapter",
                "--quiet")
    trestle.run("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf", tmp_path / "merged",
                "--merge-lora", "--quiet")
    merged = hf_tensors(tmp_path / "merged")
    reference = load_peft(setup / "hf", bad).merge_and_unload().state_dict()
    for proj in ("q_proj", "k_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        assert bool(merged[name].isnan().any()) == (proj == "q_proj"), proj
        torch.testing.assert_close(merged[name], reference[name], rtol=0, atol=2e-6, equal_nan=True)


def test_partial_peft_adapter_gets_zero_adapters_elsewhere_and_exports_without_them(setup, trestle, tmp_path):
    """q and v adapters import as canonical linear_qkv adapters with zero k adapters (zero A and B: they change nothing
    and stay zero in training); the export leaves those out, giving back the adapter as it was."""
    peft_dir = make_peft(setup / "hf", tmp_path / "peft", ["q_proj", "v_proj"])
    trestle.run("convert", "--from", "hf-peft", peft_dir, "--base", setup / "base", "--to", "trestle",
                tmp_path / "adapter", "--quiet")
    info = trestle.inspect(tmp_path / "adapter", checksums=False)
    assert info["model"]["lora"]["target_modules"] == ["linear_qkv"]
    assert "decoder.layers.1.self_attention.linear_qkv.adapter.adapter_k.linear_in.weight" in \
        {t["name"] for t in info["tensors"]}
    trestle.run("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf-peft", tmp_path / "back", "--quiet")
    got = safetensors.torch.load_file(tmp_path / "back" / "adapter_model.safetensors")
    want = safetensors.torch.load_file(peft_dir / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((tmp_path / "back" / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
    ids = tokens(LLAMA["vocab_size"])
    torch.testing.assert_close(logits(load_peft(setup / "hf", tmp_path / "back"), ids),
                               logits(load_peft(setup / "hf", peft_dir), ids), rtol=1e-6, atol=1e-6)
    # One layer's q_proj alone: its last name and any layer number would select the other layer's too, so the export
    # lists its full name.
    one = "model.layers.0.self_attn.q_proj"
    only = rewrite(peft_dir, tmp_path / "one", lambda t: [t.pop(k) for k in list(t) if f".{one}." not in k],
                   lambda c: c.__setitem__("target_modules", [one]))
    trestle.run("convert", "--from", "hf-peft", only, "--base", setup / "base", "--to", "trestle",
                tmp_path / "one_adapter", "--quiet")
    trestle.run("convert", "--from", "trestle", tmp_path / "one_adapter", "--to", "hf-peft", tmp_path / "one_back",
                "--quiet")
    assert json.loads((tmp_path / "one_back" / "adapter_config.json").read_text())["target_modules"] == [one]
    got = safetensors.torch.load_file(tmp_path / "one_back" / "adapter_model.safetensors")
    assert sorted(got) == [f"base_model.model.{one}.lora_A.weight", f"base_model.model.{one}.lora_B.weight"]


def test_phi3_fused_projections_import_as_the_fused_type(trestle, tmp_path):
    save_tiny_model(tmp_path / "hf", "Phi3Config", PHI3, seed=8)
    trestle.run("convert", "--from", "hf", tmp_path / "hf", "--to", "trestle", tmp_path / "base", "--quiet")
    peft_dir = make_peft(tmp_path / "hf", tmp_path / "peft", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    trestle.run("convert", "--from", "hf-peft", peft_dir, "--base", tmp_path / "base", "--to", "trestle",
                tmp_path / "adapter", "--tp", 2, "--quiet")
    assert trestle.inspect(tmp_path / "adapter", checksums=False)["model"]["lora"]["type"] == "lora"
    trestle.run("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf-peft", tmp_path / "back", "--quiet")
    want = safetensors.torch.load_file(peft_dir / "adapter_model.safetensors")
    got = safetensors.torch.load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    check_merged(trestle, tmp_path / "hf", tmp_path / "adapter", tmp_path / "back", tmp_path / "merged",
                 PHI3["vocab_size"])


def per_expert_adapter(out, config, experts_prefix, names, num_experts, ffn):
    """A PEFT adapter on every expert's three linears in the per-expert layout (what `peft` loads for the model)."""
    torch.manual_seed(11)
    h = config["hidden_size"]
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for e in range(num_experts):
            for name, (rows, cols) in zip(names, [(ffn, h), (ffn, h), (h, ffn)], strict=True):
                module = f"base_model.model.model.layers.{layer}.{experts_prefix}.{e}.{name}"
                tensors[module + ".lora_A.weight"] = torch.randn(RANK, cols) * 0.2
                tensors[module + ".lora_B.weight"] = torch.randn(rows, RANK) * 0.05
    out.mkdir()
    safetensors.torch.save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "target_modules": names,
        "base_model_name_or_path": "tiny", "bias": "none"}))
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_expert_adapters_export_in_the_layout_peft_loads(trestle, tmp_path, family):
    if family == "mixtral":
        config, cls, prefix, names, experts, ffn = MIXTRAL, "MixtralConfig", "block_sparse_moe.experts", \
            ["w1", "w3", "w2"], MIXTRAL["num_local_experts"], MIXTRAL["intermediate_size"]
    else:
        config, cls, prefix, names, experts, ffn = QWEN3_MOE, "Qwen3MoeConfig", "mlp.experts", \
            ["gate_proj", "up_proj", "down_proj"], QWEN3_MOE["num_experts"], QWEN3_MOE["moe_intermediate_size"]
    save_tiny_model(tmp_path / "hf", cls, config, seed=12)
    trestle.run("convert", "--from", "hf", tmp_path / "hf", "--to", "trestle", tmp_path / "base", "--quiet")
    peft_dir = per_expert_adapter(tmp_path / "peft", config, prefix, names, experts, ffn)
    said = trestle.run("convert", "--from", "hf-peft", peft_dir, "--base", tmp_path / "base", "--to", "trestle",
                       tmp_path / "adapter", "--ep", 2)
    # peft 0.21 on transformers 5 fuses each expert's gate and up adapters into one of rank 2r on gate_up_proj and
    # trains its off-diagonal blocks: imported exactly, they train apart here, and the import says so.
    assert "holds per-expert gate and up adapters; peft on transformers 5 loads them as one adapter on each " \
        "expert's fused gate_up_proj" in said, said
    lora = trestle.inspect(tmp_path / "adapter", checksums=False)["model"]["lora"]
    assert lora["target_modules"] == ["linear_fc1", "linear_fc2"] and lora["type"] == "canonical"
    trestle.run("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf-peft", tmp_path / "back", "--quiet")
    want = safetensors.torch.load_file(peft_dir / "adapter_model.safetensors")
    got = safetensors.torch.load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    check_merged(trestle, tmp_path / "hf", tmp_path / "adapter", tmp_path / "back", tmp_path / "merged",
                 config["vocab_size"], base_ckpt=tmp_path / "base")


@pytest.mark.parametrize("attention", [True, False])
def test_fused_expert_adapters_import_and_export_in_both_layouts(trestle, tmp_path, attention):
    """A PEFT adapter on Qwen3-MoE's fused experts (target_parameters: one ParamWrapper per parameter, A [E·r, H],
    B [out, r·E], gate_up_proj's nested in down_proj's), with or without adapters on its attention, imports exactly:
    with q, k and v apart, as peft-type adapters (canonical, but one A on each expert's gate and up, as peft trains
    them); alone, as fused adapters. Exported with --hf-expert-layout fused it is the same adapter again
    (target_modules null without attention); exported per expert (the files' layout), each expert's gate_proj,
    up_proj and down_proj; peft gives both the logits of the merged export."""
    save_tiny_model(tmp_path / "hf", "Qwen3MoeConfig", QWEN3_MOE, seed=13)
    trestle.run("convert", "--from", "hf", tmp_path / "hf", "--to", "trestle", tmp_path / "base", "--quiet")
    peft_dir = make_peft(tmp_path / "hf", tmp_path / "peft", ["q_proj", "k_proj", "v_proj", "o_proj"] if attention
                         else None, parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    want = safetensors.torch.load_file(peft_dir / "adapter_model.safetensors")
    experts, ffn, h = QWEN3_MOE["num_experts"], QWEN3_MOE["moe_intermediate_size"], QWEN3_MOE["hidden_size"]
    assert want[LAYER0 + "mlp.experts.base_layer.lora_A.weight"].shape == (experts * RANK, h)  # gate_up_proj
    assert want[LAYER0 + "mlp.experts.lora_B.weight"].shape == (h, RANK * experts)  # down_proj
    imported = trestle.run("convert", "--from", "hf-peft", peft_dir, "--base", tmp_path / "base", "--to", "trestle",
                           tmp_path / "adapter", "--ep", 2)
    assert "note:" not in imported, imported
    lora = trestle.inspect(tmp_path / "adapter", checksums=False)["model"]["lora"]
    assert lora["type"] == ("peft" if attention else "lora") and lora["rank"] == RANK
    if attention:  # target_modules also naming the MLP's projections, which transformers 5 builds only fused
        regex = rewrite(peft_dir, tmp_path / "regex", None, lambda c: c.__setitem__(
            "target_modules", r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"))
        trestle.run("convert", "--from", "hf-peft", regex, "--base", tmp_path / "base", "--to", "trestle",
                    tmp_path / "regex_adapter", "--quiet")
        assert trestle.inspect(tmp_path / "regex_adapter", checksums=False)["model"]["lora"]["type"] == "peft"
    assert lora["target_modules"] == ["linear_qkv", "linear_proj"] * attention + ["linear_fc1", "linear_fc2"]
    trestle.run("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf-peft", tmp_path / "fused",
                "--hf-expert-layout", "fused", "--quiet")
    got = safetensors.torch.load_file(tmp_path / "fused" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((tmp_path / "fused" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"] and not config["rank_pattern"]
    assert (config["target_modules"] is None) == (not attention), config
    trestle.run("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf-peft", tmp_path / "per_expert",
                "--quiet")
    per_expert = safetensors.torch.load_file(tmp_path / "per_expert" / "adapter_model.safetensors")
    assert LAYER0 + "mlp.experts.3.up_proj.lora_A.weight" in per_expert and not any(".base_layer." in k for k in
                                                                                     per_expert)
    gate_up_a = want[LAYER0 + "mlp.experts.base_layer.lora_A.weight"]
    torch.testing.assert_close(per_expert[LAYER0 + "mlp.experts.3.up_proj.lora_A.weight"],
                               gate_up_a[3 * RANK:4 * RANK], rtol=0, atol=0)
    gate_up_b = want[LAYER0 + "mlp.experts.base_layer.lora_B.weight"]  # [2I, r·E], expert 3's column k at k·E + 3
    torch.testing.assert_close(per_expert[LAYER0 + "mlp.experts.3.up_proj.lora_B.weight"],
                               gate_up_b[ffn:, 3::experts], rtol=0, atol=0)
    ids = tokens(QWEN3_MOE["vocab_size"])
    reference = logits(load_peft(tmp_path / "hf", peft_dir), ids)
    for exported in ("fused", "per_expert"):
        torch.testing.assert_close(logits(load_peft(tmp_path / "hf", tmp_path / exported), ids), reference,
                                   rtol=1e-5, atol=1e-5)
    trestle.run("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf", tmp_path / "merged",
                "--merge-lora", "--quiet")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    torch.testing.assert_close(logits(merged, ids), reference, rtol=1e-5, atol=1e-5)


def rewrite(peft_dir, out, tensors=None, config=None):
    out.mkdir()
    t = safetensors.torch.load_file(peft_dir / "adapter_model.safetensors")
    c = json.loads((peft_dir / "adapter_config.json").read_text())
    if tensors:
        tensors(t)
    if config:
        config(c)
    safetensors.torch.save_file(t, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(c))
    return out


LAYER0 = "base_model.model.model.layers.0."
BAD = {
    "missing key": (lambda t: t.pop(LAYER0 + "self_attn.k_proj.lora_B.weight"), None,
                    "missing " + LAYER0 + "self_attn.k_proj.lora_B.weight"),
    "wrong shape": (lambda t: t.__setitem__(LAYER0 + "mlp.up_proj.lora_A.weight", torch.zeros(RANK, 32)), None,
                    LAYER0 + "mlp.up_proj.lora_A.weight is [4, 32], expected [4, 64]"),
    "rank unlike config": (None, lambda c: c.__setitem__("r", 8), ", expected [8, "),
    "target LoRA cannot adapt": (None, lambda c: c["target_modules"].append("lm_head"),
                                 "'lm_head' selects lm_head, no linear"),
    "targets selecting nothing": (None, lambda c: c.__setitem__("target_modules", ["w_q", "w_k"]),
                                  '["w_q","w_k"] selects no linear'),
    "unexpected key": (lambda t: t.__setitem__(LAYER0 + "mlp.gate.lora_A.weight", torch.zeros(RANK, 64)), None,
                       "unexpected tensor " + LAYER0 + "mlp.gate.lora_A.weight"),
    "dora": (None, lambda c: c.__setitem__("use_dora", True), "DoRA"),
    "subset of layers": (None, lambda c: c.__setitem__("layers_to_transform", [0]),
                         "(layers_to_transform) = [0]: a subset of the 2 layers (layer 1 is not adapted)"),
    "linear targeted twice": (None, lambda c: c.__setitem__("target_parameters", ["mlp.up_proj.weight"]),
                              "up_proj is selected by target_modules and by target_parameters"),
    "parameter LoRA cannot adapt": (None, lambda c: c.__setitem__("target_parameters", ["embed_tokens.weight"]),
                                    "'embed_tokens.weight' is neither a fused expert parameter nor a linear's weight"),
}


def test_linears_named_by_their_weight_in_target_parameters_import_alike(setup, trestle, tmp_path):
    """peft wraps a linear named by its 2-D weight in target_parameters as one linear with the same keys: such an
    adapter imports to the same adapters as the one naming the modules."""
    peft_dir = make_peft(setup / "hf", tmp_path / "peft", HF_TARGETS)

    def by_weight(c):
        c["target_modules"] = ["q_proj", "k_proj", "v_proj", "o_proj"]
        c["target_parameters"] = ["mlp.gate_proj.weight", "up_proj.weight", "model.layers.0.mlp.down_proj.weight",
                                  "model.layers.1.mlp.down_proj.weight"]
    weights = rewrite(peft_dir, tmp_path / "weights", None, by_weight)
    for name, source in (("modules", peft_dir), ("weights", weights)):
        trestle.run("convert", "--from", "hf-peft", source, "--base", setup / "base", "--to", "trestle",
                    tmp_path / f"{name}_ckpt", "--quiet")
        trestle.run("convert", "--from", "trestle", tmp_path / f"{name}_ckpt", "--to", "hf-peft",
                    tmp_path / f"{name}_out", "--quiet")
    one, other = (safetensors.torch.load_file(tmp_path / f"{n}_out" / "adapter_model.safetensors")
                  for n in ("modules", "weights"))
    assert sorted(one) == sorted(other) and all(torch.equal(one[k], other[k]) for k in one)
    assert any(".mlp.down_proj." in k for k in one)


def test_lm_head_of_a_tied_model_is_named_as_a_module_lora_cannot_adapt(setup, trestle, tmp_path):
    """A tied model's lm_head holds no tensor of its own, but transformers builds it and peft wraps it when
    target_modules names it: refused as the untied model's is, not passed over as a name that selects nothing."""
    save_tiny_model(tmp_path / "tied_hf", "LlamaConfig", dict(LLAMA, tie_word_embeddings=True), seed=8)
    trestle.run("convert", "--from", "hf", tmp_path / "tied_hf", "--to", "trestle", tmp_path / "tied", "--quiet")
    peft_dir = make_peft(setup / "hf", tmp_path / "peft", HF_TARGETS)  # (the same modules' shapes)
    bad = rewrite(peft_dir, tmp_path / "bad", None, lambda c: c["target_modules"].append("lm_head"))
    result = trestle.run_raw("convert", "--from", "hf-peft", bad, "--base", tmp_path / "tied", "--to", "trestle",
                             tmp_path / "out", "--quiet")
    assert result.returncode == 1 and "'lm_head' selects lm_head, no linear" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_layers_to_transform_naming_every_layer_imports_as_no_restriction(setup, trestle, tmp_path):
    """peft's layers_to_transform listing every layer (or, as an int, the one layer of a one-layer model) adapts what
    no list adapts: the import is the plain adapter's, bit for bit (a subset is refused: BAD)."""
    peft_dir = make_peft(setup / "hf", tmp_path / "peft", HF_TARGETS)
    listed = rewrite(peft_dir, tmp_path / "listed", None,
                     lambda c: c.update(layers_to_transform=[1, 0], layers_pattern="layers"))
    for name, source in (("plain", peft_dir), ("listed", listed)):
        trestle.run("convert", "--from", "hf-peft", source, "--base", setup / "base", "--to", "trestle",
                    tmp_path / f"{name}_ckpt", "--quiet")
        trestle.run("convert", "--from", "trestle", tmp_path / f"{name}_ckpt", "--to", "hf-peft", tmp_path / f"{name}_out",
                    "--quiet")
    one, other = (safetensors.torch.load_file(tmp_path / f"{n}_out" / "adapter_model.safetensors")
                  for n in ("plain", "listed"))
    assert sorted(one) == sorted(other) and all(torch.equal(one[k], other[k]) for k in one)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_peft_adapter_is_refused_and_nothing_written(setup, trestle, tmp_path, case):
    peft_dir = make_peft(setup / "hf", tmp_path / "peft", HF_TARGETS)
    tensors, config, message = BAD[case]
    bad = rewrite(peft_dir, tmp_path / "bad", tensors, config)
    result = trestle.run_raw("convert", "--from", "hf-peft", bad, "--base", setup / "base", "--to", "trestle",
                             tmp_path / "out", "--quiet")
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")], "staging left behind"


def test_base_of_another_shape_is_refused(setup, trestle, tmp_path):
    peft_dir = make_peft(setup / "hf", tmp_path / "peft", HF_TARGETS)
    save_tiny_model(tmp_path / "hf2", "LlamaConfig", dict(LLAMA, hidden_size=32), seed=4)
    trestle.run("convert", "--from", "hf", tmp_path / "hf2", "--to", "trestle", tmp_path / "base2", "--quiet")
    result = trestle.run_raw("convert", "--from", "hf-peft", peft_dir, "--base", tmp_path / "base2", "--to", "trestle",
                             tmp_path / "out", "--quiet")
    assert result.returncode != 0 and "adapter_model.safetensors" in result.stderr and "expected" in result.stderr
    assert not (tmp_path / "out").exists()


def test_adapter_checkpoint_goes_to_hf_only_merged_onto_its_base(setup, trestle, tmp_path):
    peft_dir = make_peft(setup / "hf", tmp_path / "peft", HF_TARGETS)
    trestle.run("convert", "--from", "hf-peft", peft_dir, "--base", setup / "base", "--to", "trestle",
                tmp_path / "adapter", "--quiet")
    result = trestle.run_raw("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf", tmp_path / "out")
    assert result.returncode != 0 and "--merge-lora" in result.stderr and not (tmp_path / "out").exists()
    # Another model as --base: its digest is not the recorded one.
    save_tiny_model(tmp_path / "hf2", "LlamaConfig", LLAMA, seed=99)
    trestle.run("convert", "--from", "hf", tmp_path / "hf2", "--to", "trestle", tmp_path / "base2", "--quiet")
    result = trestle.run_raw("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf", tmp_path / "out",
                             "--merge-lora", "--base", tmp_path / "base2")
    assert result.returncode != 0 and "is not the base" in result.stderr and not (tmp_path / "out").exists()
    # The base moved: found again with --base.
    os.rename(setup / "base", tmp_path / "moved")
    try:
        result = trestle.run_raw("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf", tmp_path / "out",
                                 "--merge-lora")
        assert result.returncode != 0 and "--base" in result.stderr
        trestle.run("convert", "--from", "trestle", tmp_path / "adapter", "--to", "hf", tmp_path / "out",
                    "--merge-lora", "--base", tmp_path / "moved", "--quiet")
    finally:
        os.rename(tmp_path / "moved", setup / "base")
    assert (tmp_path / "out" / "config.json").exists()


def test_inspect_shows_adapters(setup, trestle, tmp_path):
    peft_dir = make_peft(setup / "hf", tmp_path / "peft", HF_TARGETS)
    shown = json.loads(trestle.run("inspect", peft_dir, "--json"))
    assert shown["format"] == "hf-peft" and shown["r"] == RANK and shown["lora_alpha"] == ALPHA
    assert sorted(shown["target_modules"]) == sorted(HF_TARGETS) and shown["modules"] == 14
    text = trestle.run("inspect", peft_dir)
    assert "rank          4, alpha 8" in text
    trestle.run("convert", "--from", "hf-peft", peft_dir, "--base", setup / "base", "--to", "trestle",
                tmp_path / "adapter", "--quiet")
    text = trestle.run("inspect", tmp_path / "adapter")
    assert "LoRA adapters  canonical, rank 4, alpha 8 (scale 2)" in text and "base " in text


def test_python_package_converts_adapters(setup, tmp_path):
    path = os.environ.get("TRESTLE_PYTHON_PATH")
    if not path or not os.path.isdir(path):
        pytest.fail("set TRESTLE_PYTHON_PATH to <build>/python (ctest does this)")
    sys.path.insert(0, path)
    import trestle as trestle_py
    peft_dir = make_peft(setup / "hf", tmp_path / "peft", HF_TARGETS)
    trestle_py.convert(peft_dir, tmp_path / "adapter", from_format="hf-peft", to_format="trestle", base=setup / "base")
    trestle_py.convert(tmp_path / "adapter", tmp_path / "back", from_format="trestle", to_format="hf-peft")
    trestle_py.convert(tmp_path / "adapter", tmp_path / "merged", from_format="trestle", to_format="hf",
                       merge_lora=True)
    want = safetensors.torch.load_file(peft_dir / "adapter_model.safetensors")
    got = safetensors.torch.load_file(tmp_path / "back" / "adapter_model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert (tmp_path / "merged" / "config.json").exists()
    with pytest.raises(ValueError, match="base"):
        trestle_py.convert(peft_dir, tmp_path / "x", from_format="hf-peft", to_format="trestle")

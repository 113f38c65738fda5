"""Trestle's Megatron tensor names against Megatron-Bridge's mappings, family by family (issue 35: a checkpoint Trestle
writes should load where Megatron-Bridge's would).

Each family's tiny random Hugging Face model (made by the family's convert test's saver) is converted with `trestle
convert --from hf ... --to trestle`, and the checkpoint's tensor names are compared with the mapping registry
Megatron-Bridge 0.6.2's AutoBridge builds for the same model (megatron_bridge_names.py prints them, in one run for every
family; scripts/setup fetches Megatron-Bridge, so without it this test fails):
- every Trestle name matches one of the bridge's Megatron name patterns (as MegatronMappingRegistry matches them), the
  Hugging Face tensors that mapping reads are in the model, a one-to-one mapping's (ONE_TO_ONE) Trestle tensor holds
  the bytes of its Hugging Face tensor, and a fused QKV or gated MLP has the rows of its parts;
- the other way, every Hugging Face tensor the bridge maps is in the Trestle checkpoint under the name the bridge gives.

Spellings that are one tensor in Megatron-Core count as the same name (spellings()):
- Megatron-Core's local spec's per-expert `mlp.experts.local_experts.E.linear_fc1.weight` and Transformer Engine's
  grouped GEMM `mlp.experts.linear_fc1.weightE` (the registries list one or both; Megatron-Core loads either into the
  other);
- Transformer Engine's fused norms (`self_attention.linear_qkv.layer_norm_weight`) and the local spec's separate ones
  (`input_layernorm.weight`), which the registry itself aliases one way (_SEPARATE_LAYERNORM_REWRITES, copied here);
- megatron-core's Mamba and Gated DeltaNet save in_proj and conv1d in parts (their sharded_state_dict:
  `mixer.in_proj.weight.z`, `.x`, `.B`, ..., `self_attention.in_proj.weight.query`, ...): Trestle names the parts as
  those checkpoints do, the registry maps the parameter they make up (no byte check: a part is not the whole);
- Trestle's own format holds a vision-language model's language model at the top level (`decoder.`, `embedding.`,
  `output_layer.`: a GPT model to its trainer and resharder); Megatron-Bridge's VL models, and Trestle's torch_dist
  output (test_gemma3_vl_convert.py, test_qwen3_vl_convert.py), put it under `language_model.`.
Every other difference is in DIFFERENCES, with its reason. A name neither matching nor listed fails the test, and so
does an entry that no longer matches a name, so the table stays what is true.
"""
import json
import os
import re
import subprocess
import sys
import zlib

import pytest
import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from models import load_hf_tensors, save_tiny_model  # noqa: E402
from test_deepseek_convert import add_mtp_layer as add_deepseek_mtp_layer, save_deepseek  # noqa: E402
from test_gemma3_vl_convert import BOI, EOI, IMAGE, TEXT as GEMMA3_VL_TEXT, VISION as GEMMA3_VL_VISION  # noqa: E402
from test_gemma4_convert import DENSE as GEMMA4_DENSE, MOE as GEMMA4_MOE, save_tiny_gemma4  # noqa: E402
from test_glm4_moe_convert import save_glm  # noqa: E402
from test_gpt_oss_convert import save_gpt_oss  # noqa: E402
from test_megatron_bridge import MODELS as BRIDGE_MODELS, assembled, read_manifest  # noqa: E402
from test_nemotron_h_convert import MODELS as NEMOTRON_H_MODELS  # noqa: E402
from test_qwen3_next_convert import MODELS as QWEN3_NEXT_MODELS, add_mtp_layer as add_qwen3_next_mtp_layer  # noqa: E402
from test_qwen3_vl_convert import save_tiny_qwen3_vl  # noqa: E402
from test_qwen3_vl_moe_convert import save_tiny_qwen3_vl_moe  # noqa: E402

HELPER = os.path.join(os.path.dirname(__file__), "megatron_bridge_names.py")


# --- the tiny models: the convert tests' own ------------------------------------------------------------------------

def saved(config_class, config, name, dtype, original=True):
    """save_tiny_model of a convert test's MODELS entry, seeded by its name as those tests do."""
    def save(directory):
        save_tiny_model(str(directory), config_class, {k: v for k, v in config.items() if v is not None},
                        seed=zlib.crc32(name.encode()), dtype=dtype, save_original_format=original)
    return save


def bridge_test_model(name):
    config_class, config, dtype, original = BRIDGE_MODELS[name]
    return saved(config_class, config, name, dtype, original)


def qwen3_next_test_model(name):
    config_class, config, original = QWEN3_NEXT_MODELS[name]
    return saved(config_class, config, name, torch.bfloat16, original)


def save_gemma3_vl(directory):
    """test_gemma3_vl_convert.py's model (its fixture's, norms moved off 1)."""
    torch.manual_seed(9)
    config = transformers.Gemma3Config(text_config=GEMMA3_VL_TEXT, vision_config=GEMMA3_VL_VISION,
                                       mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=BOI,
                                       eoi_token_index=EOI)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)


def with_mtp(save, add_mtp_layer):
    """`save`, then the multi-token-prediction layer its convert test's add_mtp_layer adds."""
    def save_with_mtp(directory):
        plain = directory.parent / (directory.name + "_no_mtp")
        save(plain)
        add_mtp_layer(str(plain), str(directory))
    return save_with_mtp


# family -> (the model bridge Megatron-Bridge's AutoBridge picks for it, what saves its tiny model)
FAMILIES = {
    "llama": ("LlamaBridge", bridge_test_model("llama")),
    "qwen3": ("Qwen3Bridge", bridge_test_model("qwen3")),
    "gemma2": ("Gemma2Bridge", bridge_test_model("gemma2")),
    "gemma3": ("Gemma3ModelBridge", bridge_test_model("gemma3")),
    "gemma3_vl": ("Gemma3VLBridge", save_gemma3_vl),
    "qwen3_moe": ("Qwen3MoEBridge", bridge_test_model("qwen3_moe")),
    "qwen3_next": ("Qwen3NextBridge", with_mtp(qwen3_next_test_model("next"), add_qwen3_next_mtp_layer)),
    "qwen3_5": ("Qwen35Bridge", qwen3_next_test_model("q35")),
    "qwen3_5_moe": ("Qwen35MoEBridge", qwen3_next_test_model("q35_moe")),
    "glm4_moe": ("GLM45Bridge", with_mtp(lambda d: save_glm(d, "qk"), add_deepseek_mtp_layer)),
    "nemotron_h": ("NemotronHBridge", saved("NemotronHConfig", NEMOTRON_H_MODELS["hybrid"], "hybrid", torch.bfloat16)),
    "nemotron_h_moe": ("NemotronHBridge", saved("NemotronHConfig", NEMOTRON_H_MODELS["moe"], "moe", torch.bfloat16)),
    "qwen3_vl": ("Qwen3VLBridge", lambda d: save_tiny_qwen3_vl(d, seed=5)),
    "qwen3_vl_moe": ("Qwen3VLMoEBridge", lambda d: save_tiny_qwen3_vl_moe(d, seed=9)),
    "deepseek_v3": ("DeepSeekV3Bridge", with_mtp(lambda d: save_deepseek(d, "v3"), add_deepseek_mtp_layer)),
    "gpt_oss": ("GPTOSSBridge", lambda d: save_gpt_oss(d, torch.bfloat16, 1)),
    "gemma4": ("Gemma4Bridge", lambda d: save_tiny_gemma4(d, GEMMA4_DENSE, 3)),
    "gemma4_moe": ("Gemma4Bridge", lambda d: save_tiny_gemma4(d, GEMMA4_MOE, 4)),
}


# --- the differences that remain ------------------------------------------------------------------------------------
# (kind, Trestle name pattern, Megatron-Bridge's name for it, why), by family. kind:
#   "renamed": Megatron-Bridge's tensor under another name; checked as Megatron-Bridge's name (the Hugging Face tensors
#              it reads, the bytes) after the rename;
#   "differs": Megatron-Bridge's tensor of that name holds something else; only that the bridge maps that name is
#              checked (Megatron-Bridge's name None: the same as Trestle's);
#   "trestle_only": Megatron-Bridge's model has no such tensor.

MTP_LAYER = ("renamed", r"mtp\.layers\.(\d+)\.transformer_layer\.(.+)", r"mtp.layers.\1.mtp_model_layer.\2",
             "megatron-core 0.19 renamed the module MultiTokenPredictionLayer.transformer_layer to mtp_model_layer, "
             "the parameter name Megatron-Bridge 0.6.2 maps; its sharded_state_dict still saves and loads a GPT "
             "model's MTP layer under transformer_layer. (MultiTokenPredictionLayer.sharded_state_dict's prefix "
             "mapping), the key Trestle writes and megatron-core 0.16.1 (the venv's pin, into which "
             "test_deepseek_convert.py loads a Trestle checkpoint's MTP layer) has")

DIFFERENCES = {
    "qwen3_next": [MTP_LAYER],
    "deepseek_v3": [MTP_LAYER],
    "gemma4": [
        ("differs", r"decoder\.layers\.(\d+)\.self_attention\.linear_q_proj\.weight",
         r"decoder.layers.\1.self_attention.linear_qkv.weight",
         "a layer sharing an earlier layer's keys and values has no k_proj or v_proj: Trestle holds its queries "
         "alone; Megatron-Bridge gives it a whole linear_qkv with zero keys and values (_Gemma4DenseQKVMapping)"),
        ("differs", r"decoder\.layers\.1\.self_attention\.linear_qkv\.weight", None,
         "layer 1 is a full-attention layer with keys as values (attention_k_eq_v, no v_proj): Trestle holds "
         "[queries; key] per group; Megatron-Bridge copies k_proj in as the values, a linear_qkv of [q; k; v]"),
    ],
    "gemma4_moe": [
        ("trestle_only", r"output_layer\.weight", None,
         "Megatron-Bridge's Gemma 4 bridge maps no lm_head (Gemma 4's releases tie it to the embedding); the MoE "
         "model of test_gemma4_convert.py is untied, so Trestle writes its output layer"),
    ],
}


# --- Megatron-Bridge's matching, and the spellings that are one tensor ---------------------------------------------

def registry_regex(pattern):
    """MegatronMappingRegistry._convert_pattern_to_regex: `**` any characters, `*` a number."""
    return re.compile("^" + re.escape(pattern).replace(r"\*\*", "(.*)").replace(r"\*", r"(\d+)") + "$")


def resolve(pattern, captures):
    """MegatronParamMapping._resolve_names for one name: the captures fill the `**`s, then the `*`s, in order."""
    captures = list(captures)
    for wildcard in ("**", "*"):
        while wildcard in pattern and captures:
            pattern = pattern.replace(wildcard, captures.pop(0), 1)
    return pattern


def hf_names(hf):
    return list(hf.values()) if isinstance(hf, dict) else [hf]


def lookup(mappings, name):
    """The first mapping whose Megatron pattern matches `name` (megatron_to_hf_lookup's order), with its Hugging Face
    names resolved; None if none does."""
    for m in mappings:
        match = registry_regex(m["megatron"]).match(name)
        if match:
            hf = m["hf"]
            return dict(m, hf={k: resolve(v, match.groups()) for k, v in hf.items()} if isinstance(hf, dict)
                        else resolve(hf, match.groups()))
    return None


TE_NORMS = [  # MegatronMappingRegistry._SEPARATE_LAYERNORM_REWRITES
    ("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    ("mixer.in_proj.layer_norm_weight", "norm.weight")]


def spellings(name):
    """[(spelling, whole)]: `name` and its other spellings in Megatron-Core (the module docstring's); whole is False
    for the parameter `name` is a part of."""
    whole = True
    part = re.fullmatch(r"(.*\.(?:mixer|self_attention)\.(?:in_proj|conv1d)\.(?:weight|bias))\.\w+", name)
    if part:
        name, whole = part[1], False
    names = [name]
    if name.startswith(("decoder.", "embedding.", "output_layer.")):
        names.append("language_model." + name)
    for n in list(names):
        local = re.fullmatch(r"(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))", n)
        grouped = re.fullmatch(r"(.*\.mlp\.experts)\.(linear_fc[12]\.(?:weight|bias))(\d+)", n)
        if local:
            names.append(f"{local[1]}.{local[3]}{local[2]}")
        if grouped:
            names.append(f"{grouped[1]}.local_experts.{grouped[3]}.{grouped[2]}")
        for te, separate in TE_NORMS:
            for a, b in ((te, separate), (separate, te)):
                if n.endswith("." + a):
                    names.append(n[:-len(a)] + b)
    return [(n, whole) for n in names]


def difference_for(family, name):
    """(the DIFFERENCES entry for Trestle's `name`, or None; Megatron-Bridge's name for that tensor, None if it has
    none)."""
    for entry in DIFFERENCES.get(family, []):
        kind, pattern, bridge_name, _ = entry
        match = re.fullmatch(pattern, name)
        if match:
            if kind == "trestle_only":
                return entry, None
            return entry, match.expand(bridge_name) if bridge_name else name
    return None, name


# --- the checks -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory, trestle_convert):
    """family -> (HF directory, Trestle checkpoint, Megatron-Bridge's mappings for the model)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family, (_, save) in FAMILIES.items():
        hf_dir, ckpt = root / family, root / (family + "_trestle")
        save(hf_dir)
        trestle_convert.run("convert", "--from", "hf", hf_dir, "--to", "trestle", ckpt, "-q")
        out[family] = (hf_dir, ckpt)
    result = subprocess.run([sys.executable, HELPER, *(f"{bridge}={out[f][0]}" for f, (bridge, _) in FAMILIES.items())],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"megatron_bridge_names.py failed:\n{result.stderr[-4000:]}"
    listed = json.loads(result.stdout)
    assert listed["megatron_bridge"] == "0.6.2", listed["megatron_bridge"]
    return {family: (*out[family], model["mappings"]) for family, model in zip(FAMILIES, listed["models"], strict=True)}


# Mappings that copy one Hugging Face tensor as it is (split over tensor-parallel ranks, or permuted by permute_dims).
ONE_TO_ONE = ("AutoMapping", "ReplicatedMapping", "ColumnParallelMapping", "RowParallelMapping")


def check_against_hf(found, whole, hf, iteration, entry):
    """(what is wrong, None if nothing; what was compared: "bytes", "rows" or "names") for Trestle's tensor `entry` as
    Megatron-Bridge's mapping `found` (resolved) reads the Hugging Face tensors `hf`."""
    missing = [n for n in hf_names(found["hf"]) if not any(registry_regex(n).match(k) for k in hf)]
    if missing:
        return f"Megatron-Bridge's {found['megatron']} reads {missing}, not in the model", "names"
    if not whole or "*" in json.dumps(found["hf"]):
        return None, "names"
    if found["class"] in ONE_TO_ONE:
        want = hf[found["hf"]]
        if "permute_dims" in found:
            want = want.permute(*found["permute_dims"])
        got, _ = assembled(iteration, entry)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            return f"not the bytes of {found['hf']}, which Megatron-Bridge's {found['megatron']} is", "bytes"
        return None, "bytes"
    if isinstance(found["hf"], dict) and re.search(r"QKVMapping|GatedMLPMapping", found["class"]):
        parts = [hf[n].shape for n in found["hf"].values()]
        rows = sum(p[0] for p in parts)
        if entry["global_shape"] != [rows, *parts[0][1:]]:
            return f"shape {entry['global_shape']}, not the {rows} rows of {sorted(found['hf'].values())}", "rows"
        return None, "rows"
    return None, "names"


@pytest.mark.parametrize("family", FAMILIES)
def test_trestle_names_are_megatron_bridge_names(converted, family):
    """Every tensor of the Trestle checkpoint is one Megatron-Bridge's registry maps, from the same Hugging Face
    tensors, or is in DIFFERENCES."""
    hf_dir, ckpt, mappings = converted[family]
    hf = load_hf_tensors(hf_dir)
    iteration, manifest = read_manifest(ckpt)
    used, problems, compared = set(), [], {"bytes": 0, "rows": 0, "names": 0}
    for name, entry in sorted(manifest["tensors"].items()):
        difference, bridge_name = difference_for(family, name)
        if difference:
            used.add(difference[1])
        if bridge_name is None:
            continue
        candidates = [(found, whole) for spelling, whole in spellings(bridge_name)
                      for found in [lookup(mappings, spelling)] if found]
        if not candidates:
            problems.append(f"{name}: Megatron-Bridge has no {bridge_name}")
            continue
        if difference and difference[0] == "differs":
            continue
        verdicts = [check_against_hf(found, whole, hf, iteration, entry) for found, whole in candidates]
        good = [kind for problem, kind in verdicts if problem is None]
        if not good:
            problems.append(f"{name}: {verdicts[0][0]}")
        elif not difference:
            compared[good[0]] += 1
    stale = [entry[1] for entry in DIFFERENCES.get(family, []) if entry[1] not in used]
    print(f"{family}: {len(manifest['tensors'])} Trestle names, {sum(compared.values())} Megatron-Bridge's as they are "
          f"({compared['bytes']} by bytes, {compared['rows']} by rows, {compared['names']} by Hugging Face names)")
    assert not problems and not stale, "\n".join(problems + [f"DIFFERENCES entry matches no name: {s}" for s in stale])


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_tensors_reach_the_names_megatron_bridge_gives(converted, family):
    """Every Hugging Face tensor of the model that the bridge maps is in the Trestle checkpoint under the Megatron name
    the bridge gives it (or under a name DIFFERENCES gives for it)."""
    hf_dir, ckpt, mappings = converted[family]
    names = [difference_for(family, n)[1] for n in read_manifest(ckpt)[1]["tensors"]]
    spelled = {s for n in names if n for s, _ in spellings(n)}
    problems = []
    for key in sorted(load_hf_tensors(hf_dir)):
        targets = {resolve(m["megatron"], match.groups()) for m in mappings for pattern in hf_names(m["hf"])
                   for match in [registry_regex(pattern).match(key)] if match}
        if targets and not any(registry_regex(t).match(s) for t in targets for s in spelled):
            problems.append(f"{key}: Megatron-Bridge maps it to {sorted(targets)}, not in the Trestle checkpoint")
    assert not problems, "\n".join(problems)

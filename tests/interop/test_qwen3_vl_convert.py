"""Qwen3-VL (Qwen3VLForConditionalGeneration: a Qwen3 language model under model.language_model, a vision tower and
its mergers under model.visual) through `trestle convert`, checked against transformers.

- tiny random models of awkward sizes (vision depth 3 with deepstack mergers after blocks 0 and 2, patch 4, temporal
  patch 2, merge 2; vocab 301) go hf -> trestle -> hf bit-exactly at tp 1, tp 2 and pp 2, with config.json (its
  vision_config and text_config) and the processor's files carried through, and transformers' logits for a prompt with
  an image in it are unchanged by the round trip;
- the Trestle checkpoint holds the language model under Megatron-Core's names, each piece on its rank, and the vision
  tower under Megatron-Bridge's names (its Qwen3VLBridge: Megatron-Core's layer names, the fused QKV per head), whole
  (replicated over tp) on the first stage;
- torch_dist under Megatron-Bridge's Qwen3VLModel keys at tp 1 and tp 2 x pp 2: the language model's under
  language_model. with its layers stacked; the vision tower's blocks and deepstack mergers stacked as its
  TransformerBlock saves them, each linear module's _extra_state beside them; and back bit-exactly;
- a vision_config that does not fit the language model is refused naming the field (training its text, in full
  and with LoRA: test_train_families.py, test_lora_train.py).
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
from models import assert_bit_exact, iteration_dir, load_hf_tensors  # noqa: E402
from test_megatron_bridge import assembled, megatron_qkv, read_manifest  # noqa: E402

IMAGE, VISION_START, VISION_END = 290, 291, 292
TEXT = dict(vocab_size=301, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True})
VISION = dict(depth=3, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=32, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
# The processor's files, carried through as they are.
SIDE_FILES = {"preprocessor_config.json": '{"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 4}\n',
              "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}\n"}


def save_tiny_qwen3_vl(directory, seed, config_class=transformers.Qwen3VLConfig,
                       model_class=transformers.Qwen3VLForConditionalGeneration, **text):
    torch.manual_seed(seed)
    config = config_class(text_config=dict(TEXT, **text), vision_config=VISION, image_token_id=IMAGE,
                          vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                          tie_word_embeddings=False)
    model = model_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms start at 1 and biases at 0: moved, so a misplaced one shows
                p.add_(torch.randn_like(p) * 0.1)
            elif p.dim() == 3:  # fused experts start at zero
                p.normal_(0, 0.2)
    model.save_pretrained(directory)
    for name, text_ in SIDE_FILES.items():
        with open(os.path.join(directory, name), "w") as f:
            f.write(text_)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_vl") / "hf"
    save_tiny_qwen3_vl(directory, seed=5)
    return directory


def logits_with_an_image(directory):
    """transformers' logits for text around one 8x8-patch image (a 1 x 8 x 8 grid of 4-pixel patches: 16 tokens after
    the 2 x 2 merge), in fp32."""
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    grid = torch.tensor([[1, 8, 8]])
    pixels = torch.randn(64, 3 * 2 * 4 * 4)
    ids = torch.tensor([[1, 5, VISION_START] + [IMAGE] * 16 + [VISION_END, 17, 42, 7, 99]])
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).long(),
                     use_cache=False).logits


# Megatron-Bridge 0.6.2's Qwen3VLBridge for the vision tower: (Megatron name, Hugging Face name), first match.
VISION_NAMES = [
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.layer_norm_(weight|bias)", r"blocks.\1.norm1.\2"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.layer_norm_(weight|bias)", r"blocks.\1.norm2.\2"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.(weight|bias)", r"blocks.\1.attn.qkv.\2"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj\.(weight|bias)", r"blocks.\1.attn.proj.\2"),
    (r"decoder\.layers\.(\d+)\.mlp\.(linear_fc[12]\.(?:weight|bias))", r"blocks.\1.mlp.\2"),
    (r"decoder\.deepstack_merger_list\.(\d+)\.patch_norm\.(weight|bias)", r"deepstack_merger_list.\1.norm.\2"),
    (r"decoder\.deepstack_merger_list\.(\d+)\.(linear_fc[12]\.(?:weight|bias))", r"deepstack_merger_list.\1.\2"),
    (r"merger\.patch_norm\.(weight|bias)", r"merger.norm.\1"),
    (r"(merger\.linear_fc[12]\.(?:weight|bias)|patch_embed\.proj\.(?:weight|bias)|pos_embed\.weight)", r"\1"),
]


def vision_hf_name(name):
    """The Hugging Face tensor Megatron-Bridge maps vision_model.X `name` from."""
    rest = name[len("vision_model."):]
    for megatron, hf in VISION_NAMES:
        match = re.fullmatch(megatron, rest)
        if match:
            return "model.visual." + match.expand(hf)
    raise AssertionError(f"{name} is not a Megatron-Bridge name of the Qwen3-VL vision tower")


def expected_vision(hf, name, heads=VISION["num_heads"]):
    """Vision tensor `name` from the HF tensors: Hugging Face's qkv [all q; all k; all v] in Megatron-Core's order, per
    head [q; k; v] (ConcatenatedQKVMapping with no GQA); the rest as they are."""
    t = hf[vision_hf_name(name)]
    if re.search(r"linear_qkv\.(weight|bias)$", name):
        return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    return t


def expected_megatron(hf, c, name):
    """What Trestle's canonical tensor `name` holds, from the HF tensors: the Qwen3 language model's usual mapping, and
    the vision tower's as Megatron-Bridge's."""
    if name.startswith("vision_model."):
        return expected_vision(hf, name)
    t = c["text_config"]
    lm = "model.language_model."
    simple = {"embedding.word_embeddings.weight": lm + "embed_tokens.weight",
              "decoder.final_layernorm.weight": lm + "norm.weight", "output_layer.weight": "lm_head.weight"}
    if name in simple:
        return hf[simple[name]]
    i, rest = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name).groups()
    p = f"{lm}layers.{i}."
    if rest == "self_attention.linear_qkv.weight":
        d = t["head_dim"]
        q, k, v = (hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        return megatron_qkv(q.view(-1, d, q.shape[1]), k.view(-1, d, k.shape[1]), v.view(-1, d, v.shape[1]),
                            t["num_key_value_heads"]).reshape(-1, q.shape[1])
    if rest == "mlp.linear_fc1.weight":
        return torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]])
    return hf[p + {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                   "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
                   "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
                   "mlp.linear_fc2.weight": "mlp.down_proj.weight",
                   "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
                   "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}[rest]]


def check_trestle_checkpoint(hf_dir, ckpt, tp, pp):
    """Every canonical tensor, put together from its chunks (each element exactly once), equals the HF-made one and sits
    on its layer's stage; the vision tower's tensors are stored whole (replicated over tp) by the first stage."""
    hf = load_hf_tensors(hf_dir)
    c = json.load(open(os.path.join(hf_dir, "config.json")))
    iteration_dir, manifest = read_manifest(ckpt)
    vision = {n for n in manifest["tensors"] if n.startswith("vision_model.")}
    assert sorted(vision_hf_name(n) for n in vision) == sorted(n for n in hf if n.startswith("model.visual."))
    assert len(vision) == 3 + 3 * 12 + 6 + 2 * 6, sorted(vision)
    layers = c["text_config"]["num_hidden_layers"]
    for name, entry in manifest["tensors"].items():
        expected = expected_megatron(hf, c, name)
        assert list(expected.shape) == entry["global_shape"], name
        layer = re.match(r"decoder\.layers\.(\d+)\.", name)
        first = name.startswith(("embedding", "vision_model"))
        stage = int(layer.group(1)) // (layers // pp) if layer else (0 if first else pp - 1)
        whole, placed = assembled(iteration_dir, entry)
        for rank, chunk in placed:
            assert rank // tp == stage, f"{name} on pipeline rank {rank // tp}, expected {stage}"
            if name.startswith("vision_model."):
                assert chunk["shape"] == entry["global_shape"], f"{name} is split, not replicated"
        assert torch.equal(whole, expected.to(whole.dtype)), name


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_round_trip_bit_exact_with_logits(trestle_convert, hf_model, tmp_path, tp, pp):
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    trestle_convert.run("convert", "--from", "hf", hf_model, "--to", "trestle", ckpt, "--tp", tp, "--pp", pp, "-q")
    check_trestle_checkpoint(hf_model, ckpt, tp, pp)
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_bit_exact(load_hf_tensors(hf_model), load_hf_tensors(back))
    assert json.load(open(back / "config.json")) == json.load(open(hf_model / "config.json"))
    for name, text in SIDE_FILES.items():
        assert (back / name).read_text() == text, name
    assert torch.equal(logits_with_an_image(back), logits_with_an_image(hf_model))


def test_the_vision_tower_changes_the_logits(hf_model, tmp_path):
    """The image reaches the logits (so the round trip above checks the vision tower): one vision block's weight
    changed changes them."""
    changed = tmp_path / "changed"
    shutil.copytree(hf_model, changed)
    tensors = load_hf_tensors(changed)
    tensors["model.visual.blocks.1.mlp.linear_fc2.weight"] = tensors["model.visual.blocks.1.mlp.linear_fc2.weight"] * 2
    import safetensors.torch
    for f in os.listdir(changed):
        if f.endswith(".safetensors"):
            os.remove(changed / f)
    safetensors.torch.save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    assert not torch.allclose(logits_with_an_image(changed), logits_with_an_image(hf_model))


def test_bf16_cast_marks_every_config(trestle_convert, hf_model, tmp_path):
    """--dtype bf16: the weights are stored in bf16 and config.json says so, in its text and vision parts too where
    they name a dtype (as older saves do: "float32" in each), through trestle and hf -> hf alike (which left the parts'
    float32)."""
    import shutil
    source = tmp_path / "source"
    shutil.copytree(hf_model, source)
    config = json.load(open(source / "config.json"))
    for part in ("text_config", "vision_config"):
        config[part]["dtype"] = "float32"
    (source / "config.json").write_text(json.dumps(config, indent=2))
    trestle_convert.run("convert", "--from", "hf", source, "--to", "trestle", tmp_path / "ckpt", "--dtype", "bf16",
                        "-q")
    trestle_convert.run("convert", "--from", "trestle", tmp_path / "ckpt", "--to", "hf", tmp_path / "back", "-q")
    trestle_convert.run("convert", "--from", "hf", source, "--to", "hf", tmp_path / "hf_hf", "--dtype", "bf16", "-q")
    for out in ("back", "hf_hf"):
        assert {t.dtype for t in load_hf_tensors(tmp_path / out).values()} == {torch.bfloat16}
        config = json.load(open(tmp_path / out / "config.json"))
        for part in (config, config["text_config"], config["vision_config"]):
            named = [part[k] for k in ("dtype", "torch_dtype") if k in part]
            assert named, (out, part)
            assert all(d == "bfloat16" for d in named), (out, part)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_torch_dist_under_megatron_bridge_names_and_back(trestle_convert, hf_model, tmp_path, tp, pp):
    """torch_dist as Megatron-Bridge's Qwen3VLModel names it: the language model's keys under language_model. (its
    layers stacked), the vision tower's as vision_model.X holding model.visual.X; and back to the same bytes."""
    import torch.distributed.checkpoint as dcp
    from test_megatron_dist_convert import read_dcp
    dist, back = tmp_path / "dist", tmp_path / "back"
    trestle_convert.run("convert", "--from", "hf", hf_model, "--to", "megatron-dist", dist, "--tp", tp, "--pp", pp,
                        "-q")
    saved = read_dcp(iteration_dir(dist))
    hf = load_hf_tensors(hf_model)
    c = json.load(open(hf_model / "config.json"))
    weights = {k: v for k, v in saved.items() if not k.startswith("optimizer.") and "_extra_state" not in k}
    vision = {k for k in weights if k.startswith("vision_model.")}
    check_stacked_vision_tower(hf, weights, vision)
    objects = set(dcp.FileSystemReader(iteration_dir(dist)).read_metadata().state_dict_metadata)
    depth, mergers = VISION["depth"], len(VISION["deepstack_visual_indexes"])
    for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
        for i in range(depth):
            assert f"vision_model.decoder.layers.{module}._extra_state/shard_{i}_{depth}" in objects, (module, i)
    for module in ("linear_fc1", "linear_fc2"):
        for k in range(mergers):
            assert f"vision_model.decoder.deepstack_merger_list.{module}._extra_state/shard_{k}_{mergers}" in objects
        assert f"vision_model.merger.{module}._extra_state/shard_0_1" in objects
    lm = "language_model."
    assert set(weights) - vision == {lm + k for k in (
        "embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
        *("decoder.layers." + p for p in (
            "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
            "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight",
            "self_attention.linear_proj.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight")))}
    for i in range(c["text_config"]["num_hidden_layers"]):
        for rest in ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight", "self_attention.q_layernorm.weight"):
            assert torch.equal(weights[lm + "decoder.layers." + rest][i],
                               expected_megatron(hf, c, f"decoder.layers.{i}.{rest}")), (i, rest)
    vocab = c["text_config"]["vocab_size"]
    assert torch.equal(weights[lm + "embedding.word_embeddings.weight"][:vocab],
                       hf["model.language_model.embed_tokens.weight"])
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", back, "-q")
    assert_bit_exact(hf, load_hf_tensors(back))
    assert json.load(open(back / "config.json")) == c


def check_stacked_vision_tower(hf, weights, vision):
    """The vision tower's keys `vision` of a torch_dist checkpoint's `weights`, as Megatron-Bridge's Qwen3VLModel saves
    them: its blocks under vision_model.decoder.layers.<param> [depth, ...] and its deepstack mergers under
    vision_model.decoder.deepstack_merger_list.<param> [count, ...] (Megatron-Core's TransformerBlock stacks both),
    the final merger and the patch and position embeddings as they are; every Hugging Face vision tensor read once."""
    stacks = {"vision_model.decoder.layers.": VISION["depth"],
              "vision_model.decoder.deepstack_merger_list.": len(VISION["deepstack_visual_indexes"])}
    read = []
    for key in vision:
        prefix = next((p for p in stacks if key.startswith(p)), None)
        if prefix is None:
            assert torch.equal(weights[key], expected_vision(hf, key)), key
            read.append(vision_hf_name(key))
            continue
        assert weights[key].shape[0] == stacks[prefix], (key, weights[key].shape)
        for i in range(stacks[prefix]):
            name = f"{prefix}{i}.{key[len(prefix):]}"
            assert torch.equal(weights[key][i], expected_vision(hf, name)), name
            read.append(vision_hf_name(name))
    assert sorted(read) == sorted(n for n in hf if n.startswith("model.visual."))
    assert len(vision) == 3 + 12 + 6 + 6, sorted(vision)


def test_what_is_not_supported_is_refused(trestle_convert, hf_model, tmp_path):
    for change, needle in [({"out_hidden_size": 48}, "out_hidden_size 48 is not the language model's hidden_size 32"),
                           ({"deepstack_visual_indexes": [0, 3]}, "deepstack_visual_indexes holds 3"),
                           ({"depth": -1}, "vision_config.depth must be a positive integer"),
                           ({"num_heads": 3}, "hidden_size 16 is not a multiple of num_heads 3")]:
        bad = tmp_path / ("bad_" + next(iter(change)))
        shutil.copytree(hf_model, bad)
        config = json.load(open(bad / "config.json"))
        config["vision_config"].update(change)
        json.dump(config, open(bad / "config.json", "w"))
        result = trestle_convert.run_raw("convert", "--from", "hf", bad, "--to", "trestle", tmp_path / "out")
        assert result.returncode != 0 and needle in result.stderr, (change, result.stderr)
        assert not (tmp_path / "out").exists()


def test_inspect_verify_reshard_and_diff(trestle_convert, hf_model, tmp_path):
    """inspect names the family; verify --against the Hugging Face model finds every tensor equal (the vision tower's
    too); a reshard to pp 2 keeps every tensor bit-equal (diff)."""
    out = trestle_convert.run("inspect", hf_model)
    assert "Qwen3-VL" in out and "qwen3_vl" in out, out
    ckpt, other = tmp_path / "ckpt", tmp_path / "pp2"
    trestle_convert.run("convert", "--from", "hf", hf_model, "--to", "trestle", ckpt, "--tp", 2, "-q")
    out = trestle_convert.run("verify", ckpt, "--against", hf_model)
    assert "vision_model.decoder.layers.2.self_attention.linear_qkv.weight" in out, out
    assert "ok: 76 tensors compared" in out, out
    trestle_convert.run("reshard", ckpt, other, "--tp", 1, "--pp", 2, "--quiet")
    check_trestle_checkpoint(hf_model, other, 1, 2)
    out = trestle_convert.run("diff", ckpt, other)
    assert "76 tensors: 76 bit-equal, 0 not" in out, out

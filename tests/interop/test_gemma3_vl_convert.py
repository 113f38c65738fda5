"""Gemma 3 with vision (Gemma3ForConditionalGeneration, as transformers saves it: a Gemma 3 language model under
language_model.model, a SigLIP vision tower under vision_tower and the multi-modal projector) through `trestle
convert`, checked against transformers.

- a tiny random model (2 SigLIP layers with the attention-pooling head, 32-pixel images of 8-pixel patches pooled to 4
  tokens; a text model with windowed and global layers; tied embeddings) goes hf -> trestle -> hf bit-exactly at tp 2
  and pp 2 with config.json carried, and transformers' logits for a prompt with an image are unchanged;
- torch_dist as Megatron-Bridge's Gemma3VLModel names it: language_model.* beside vision_tower.*
  and multi_modal_projector.{mm_soft_embed_norm.weight, proj.weight}, the projection transposed to a linear's
  [text hidden, vision hidden]; and back to the same bytes;
- the vision tower as Google publishes it on the hub (vision_tower.vision_model.*) reads to the same checkpoint and
  goes back under those names.
"""
import json
import os
import shutil
import sys

import pytest
import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from models import assert_bit_exact, iteration_dir, load_hf_tensors  # noqa: E402
from test_megatron_bridge import assembled, read_manifest  # noqa: E402

IMAGE, BOI, EOI = 290, 291, 292
TEXT = dict(vocab_size=301, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=4, query_pre_attn_scalar=8, rms_norm_eps=1e-6,
            layer_types=["sliding_attention", "full_attention"])
VISION = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, image_size=32,
              patch_size=8, num_channels=3, vision_use_head=True)


def save_tiny_gemma3_vl(directory, seed, outer=None, **text):
    torch.manual_seed(seed)
    config = transformers.Gemma3Config(text_config=dict(TEXT, **text), vision_config=VISION, mm_tokens_per_image=4,
                                       image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI,
                                       **(outer or {}))
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms start at 1 (or 0) and biases at 0: moved, so a misplaced one shows
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return save_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3_vl") / "hf", 9)


def logits_with_an_image(directory):
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor([[2, 5, BOI] + [IMAGE] * 4 + [EOI, 17, 42, 7, 99]])
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=torch.randn(1, 3, 32, 32), token_type_ids=(ids == IMAGE).long(),
                     use_cache=False).logits


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_round_trip_bit_exact_with_logits(trestle_convert, hf_model, tmp_path, tp, pp):
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    trestle_convert.run("convert", "--from", "hf", hf_model, "--to", "trestle", ckpt, "--tp", tp, "--pp", pp, "-q")
    hf = load_hf_tensors(hf_model)
    iteration, manifest = read_manifest(ckpt)
    carried = {n for n in manifest["tensors"] if n.startswith(("vision_tower.", "multi_modal_projector."))}
    assert carried == {n for n in hf if n.startswith("vision_tower.")} | {
        "multi_modal_projector.mm_soft_embed_norm.weight", "multi_modal_projector.proj.weight"}
    for name in carried:
        whole, placed = assembled(iteration, manifest["tensors"][name])
        assert all(rank // tp == 0 for rank, _ in placed), name  # the first stage's
        expected = (hf["multi_modal_projector.mm_input_projection_weight"].t()
                    if name == "multi_modal_projector.proj.weight" else
                    hf["multi_modal_projector.mm_soft_emb_norm.weight"]
                    if name.startswith("multi_modal_projector.") else hf[name])
        assert torch.equal(whole, expected), name
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_bit_exact(hf, load_hf_tensors(back))
    assert json.load(open(back / "config.json")) == json.load(open(hf_model / "config.json"))
    assert torch.equal(logits_with_an_image(back), logits_with_an_image(hf_model))


def test_torch_dist_under_megatron_bridge_names_and_back(trestle_convert, hf_model, tmp_path):
    from test_megatron_dist_convert import read_dcp
    dist, back = tmp_path / "dist", tmp_path / "back"
    trestle_convert.run("convert", "--from", "hf", hf_model, "--to", "megatron-dist", dist, "--tp", 2, "-q")
    saved = read_dcp(iteration_dir(dist))
    weights = {k for k in saved if not k.startswith("optimizer.") and "_extra_state" not in k}
    hf = load_hf_tensors(hf_model)
    assert {k for k in weights if k.startswith("vision_tower.")} == {n for n in hf if n.startswith("vision_tower.")}
    assert torch.equal(saved["multi_modal_projector.proj.weight"],
                       hf["multi_modal_projector.mm_input_projection_weight"].t())
    assert "language_model.decoder.layers.self_attention.linear_proj.post_layernorm.weight" in weights
    assert "language_model.output_layer.weight" not in weights  # tied
    assert all(k.startswith(("language_model.", "vision_tower.", "multi_modal_projector.")) for k in weights), weights
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", back, "-q")
    assert_bit_exact(hf, load_hf_tensors(back))


def nested_copy(hf_model, directory):
    """The model as Google publishes Gemma 3 on the hub: its vision tower under vision_tower.vision_model.*."""
    import safetensors.torch
    shutil.copytree(hf_model, directory)
    for f in os.listdir(directory):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(directory / f)
    tensors = {("vision_tower.vision_model." + n[len("vision_tower."):] if n.startswith("vision_tower.") else n): t
               for n, t in load_hf_tensors(hf_model).items()}
    safetensors.torch.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return tensors


def test_the_hub_layout_of_the_vision_tower_is_read_and_kept(trestle_convert, hf_model, tmp_path):
    """The vision tower as the hub holds it (vision_tower.vision_model.X) converts to the same Trestle checkpoint as
    transformers' own names, and goes back under the names it came with, bit-exactly, through a Trestle checkpoint and
    through torch_dist; verify compares a checkpoint with either form; transformers' logits are unchanged."""
    nested = tmp_path / "nested"
    tensors = nested_copy(hf_model, nested)
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    trestle_convert.run("convert", "--from", "hf", nested, "--to", "trestle", ckpt, "--tp", 2, "-q")
    flat_ckpt = tmp_path / "flat_ckpt"
    trestle_convert.run("convert", "--from", "hf", hf_model, "--to", "trestle", flat_ckpt, "--tp", 2, "-q")
    out = trestle_convert.run("diff", ckpt, flat_ckpt)
    assert "bit-equal, 0 not" in out, out
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_bit_exact(tensors, load_hf_tensors(back))
    assert torch.equal(logits_with_an_image(back), logits_with_an_image(hf_model))
    for against in (nested, hf_model):
        out = trestle_convert.run("verify", ckpt, "--against", against)
        assert "ok:" in out, out
    dist, dist_back = tmp_path / "dist", tmp_path / "dist_back"
    trestle_convert.run("convert", "--from", "hf", nested, "--to", "megatron-dist", dist, "--tp", 2, "-q")
    trestle_convert.run("convert", "--from", "megatron-dist", dist, "--to", "hf", dist_back, "-q")
    assert_bit_exact(tensors, load_hf_tensors(dist_back))


def test_an_untied_head_and_tying_as_transformers_reads_them(trestle_convert, tmp_path):
    """Untied, transformers saves the head as language_model.lm_head.weight (refused: "missing: lm_head.weight"): it goes
    hf -> trestle -> hf bit-exactly under that name. Tying is the outer config's tie_word_embeddings, else
    Gemma3Config's default (true), never text_config's: a text_config saying false under an outer config without the
    key (transformers ties it) was refused."""
    untied = save_tiny_gemma3_vl(tmp_path / "untied", 4, outer=dict(tie_word_embeddings=False))
    hf = load_hf_tensors(untied)
    assert "language_model.lm_head.weight" in hf and "lm_head.weight" not in hf
    trestle_convert.run("convert", "--from", "hf", untied, "--to", "trestle", tmp_path / "ckpt", "--tp", 2, "-q")
    trestle_convert.run("convert", "--from", "trestle", tmp_path / "ckpt", "--to", "hf", tmp_path / "back", "-q")
    assert_bit_exact(hf, load_hf_tensors(tmp_path / "back"))
    assert torch.equal(logits_with_an_image(tmp_path / "back"), logits_with_an_image(untied))

    tied = save_tiny_gemma3_vl(tmp_path / "tied", 5)
    config = json.load(open(tied / "config.json"))
    config.pop("tie_word_embeddings", None)
    config["text_config"]["tie_word_embeddings"] = False
    json.dump(config, open(tied / "config.json", "w"))
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(tied)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # transformers ties it
    trestle_convert.run("convert", "--from", "hf", tied, "--to", "trestle", tmp_path / "tied_ckpt", "-q")
    trestle_convert.run("convert", "--from", "trestle", tmp_path / "tied_ckpt", "--to", "hf", tmp_path / "tied_back",
                        "-q")
    assert torch.equal(logits_with_an_image(tmp_path / "tied_back"), logits_with_an_image(tied))


def test_the_hubs_sparse_config_takes_transformers_text_defaults(trestle_convert, tmp_path):
    # The hub's Gemma 3 configs (google/gemma-3-4b-it's) leave out of text_config what equals Gemma3TextConfig's
    # defaults: 8 heads, 4 KV heads, head_dim 256, query_pre_attn_scalar 256, vocabulary 262208, RoPE bases. Read as
    # hidden / heads they gave another model (head dim 32 here) and the conversion failed on its shapes.
    text = dict(hidden_size=64, intermediate_size=96, model_type="gemma3_text", num_hidden_layers=2,
                rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=16)
    vision = dict(hidden_size=16, image_size=32, intermediate_size=24, model_type="siglip_vision_model",
                  num_attention_heads=2, num_hidden_layers=1, patch_size=8, vision_use_head=False)
    sparse = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 4,
              "image_token_index": IMAGE, "boi_token_index": BOI, "eoi_token_index": EOI,
              "text_config": text, "vision_config": vision}
    hf, ckpt, back = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "back"
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE,
        boi_token_index=BOI, eoi_token_index=EOI)).eval()
    assert (model.config.text_config.head_dim, model.config.text_config.num_attention_heads) == (256, 8)
    model.save_pretrained(hf)
    (hf / "config.json").write_text(json.dumps(sparse))
    out = trestle_convert.run("inspect", hf)
    assert "heads 8, kv heads 4, head dim 256, vocab 262208" in out, out
    trestle_convert.run("convert", "--from", "hf", hf, "--to", "trestle", ckpt, "--tp", 2, "-q")
    trestle_convert.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "-q")
    assert_bit_exact(load_hf_tensors(hf), load_hf_tensors(back))
    assert json.load(open(back / "config.json")) == sparse
    assert torch.equal(logits_with_an_image(back), logits_with_an_image(hf))

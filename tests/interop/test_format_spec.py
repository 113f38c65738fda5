"""docs/format.md is enough to read Trestle checkpoints: the pure-Python reader written from it alone
(docs/examples/read_trestle.py) reads checkpoints the C++ writer made — converted from Hugging Face at tp2/pp2 (raw
and zstd blocks, carried tokenizer files), a training checkpoint with optimizer state, and its distributed-optimizer
reshard (flat ranges) — and gets the Hugging Face source's weights and the same tensors at every layout; every manifest
validates against docs/manifest.schema.json; a flipped byte fails the block's checksum."""
import json
import pathlib
import sys

import jsonschema
import xxhash
import numpy
import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "examples"))
sys.path.insert(0, str(pathlib.Path(__file__).parent))
import read_trestle  # noqa: E402
from models import load_hf_tensors, save_tiny_model  # noqa: E402

SCHEMA = json.loads((ROOT / "docs" / "manifest.schema.json").read_text())
CORPUS = ROOT / "train" / "data" / "corpus"
LLAMA = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "llama"
    save_tiny_model(str(directory), "LlamaConfig", LLAMA, seed=5, dtype=torch.bfloat16,
                    tokenizer_config={"model_max_length": 64})
    return directory


def bits(tensor):
    return tensor.view(torch.uint16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()


def read_and_validate(root):
    iteration = read_trestle.iteration_directory(str(root))
    jsonschema.validate(json.loads((pathlib.Path(iteration) / "manifest.json").read_text()), SCHEMA)
    return read_trestle.read_checkpoint(str(root))


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_reads_a_converted_model(trestle, hf, tmp_path, codec):
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "ckpt", "--tp", 2, "--pp", 2,
                "--codec", codec, "--quiet")
    manifest, tensors = read_and_validate(tmp_path / "ckpt")
    assert {c["codec"] for t in manifest["tensors"].values() for c in t["chunks"]} == {codec}
    assert "hf_files/tokenizer_config.json" in manifest["files"]
    source = load_hf_tensors(str(hf))
    embedding = tensors["embedding.word_embeddings.weight"]
    assert embedding.shape == (300, 32) and (embedding == bits(source["model.embed_tokens.weight"])).all()
    assert (tensors["decoder.final_layernorm.weight"] == bits(source["model.norm.weight"])).all()
    fc1 = numpy.concatenate([bits(source["model.layers.2.mlp.gate_proj.weight"]),
                             bits(source["model.layers.2.mlp.up_proj.weight"])])
    assert (tensors["decoder.layers.2.mlp.linear_fc1.weight"] == fc1).all()
    # The same tensors at another layout.
    trestle.run("reshard", tmp_path / "ckpt", tmp_path / "tp1", "--tp", 1, "--pp", 1, "--quiet")
    _, again = read_and_validate(tmp_path / "tp1")
    assert sorted(again) == sorted(tensors)
    for name in tensors:
        assert (again[name] == tensors[name]).all(), name


def test_reads_training_state_and_flat_ranges(trestle, hf, tmp_path):
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "start", "--quiet")
    (tmp_path / "data").mkdir()
    trestle.run("preprocess", "--input", CORPUS / "kjv.jsonl", "--output-prefix", tmp_path / "data" / "kjv",
                "--tokenizer-type", "bytes", "--append-eod", "--quiet")
    trestle.run("train", "--nproc-per-node", 2, "--tensor-model-parallel-size", 2, "--load", tmp_path / "start",
                "--data-path", tmp_path / "data" / "kjv_text_document", "--split", "98,2,0",
                "--micro-batch-size", 1, "--global-batch-size", 2, "--seq-length", 16, "--train-iters", 2,
                "--lr", "1e-3", "--eval-iters", 0, "--save", tmp_path / "trained", timeout=300)
    manifest, tensors = read_and_validate(tmp_path / "trained")
    assert manifest["iteration"] == 2 and manifest["training"]["consumed_train_samples"] == 4
    assert len(manifest["training"]["ranks"]) == 2 and "cpu_rng_state" in manifest["training"]["ranks"][1]
    assert tensors["optimizer.step"].shape == () and int(tensors["optimizer.step"]) == 2
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert (tensors["optimizer.fp32_param." + name] == tensors[name]).all()  # fp32 parameters are their own masters
    # The distributed optimizer's shards: flat ranges of each rank's piece.
    trestle.run("reshard", tmp_path / "trained", tmp_path / "dp2", "--tp", 2, "--dp", 2, "--quiet")
    manifest2, sharded = read_and_validate(tmp_path / "dp2")
    assert any("flat" in c for c in manifest2["tensors"]["optimizer.exp_avg." + name]["chunks"])
    for key in tensors:
        assert (sharded[key] == tensors[key]).all(), key


def test_a_flipped_byte_fails_the_block_checksum(trestle, hf, tmp_path):
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "ckpt", "--quiet")
    iteration = pathlib.Path(read_trestle.iteration_directory(str(tmp_path / "ckpt")))
    manifest = json.loads((iteration / "manifest.json").read_text())
    chunk = manifest["tensors"]["decoder.layers.0.mlp.linear_fc2.weight"]["chunks"][0]
    with open(iteration / chunk["file"], "r+b") as f:
        f.seek(chunk["byte_offset"] + 7)
        byte = f.read(1)
        f.seek(chunk["byte_offset"] + 7)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(read_trestle.FormatError, match="linear_fc2.weight: block 0 .* fails its checksum"):
        read_trestle.read_checkpoint(str(tmp_path / "ckpt"))


def test_a_flipped_bit_anywhere_in_the_manifest_is_detected(trestle, hf, tmp_path):
    """manifest.json ends with its own XXH3-64 ("manifest_xxh3_64", over every byte before the comma that precedes
    it): one bit flipped at any of 150 places spread over the manifest (or in the checksum's digits) makes `trestle
    verify` and the spec-only Python reader refuse it, naming manifest.json; never a silently different manifest."""
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", tmp_path / "ckpt", "--quiet")
    path = pathlib.Path(read_trestle.iteration_directory(str(tmp_path / "ckpt"))) / "manifest.json"
    original = path.read_bytes()
    member = original.rindex(b',\n "manifest_xxh3_64": "')
    assert json.loads(original)["manifest_xxh3_64"] == xxhash.xxh3_64_hexdigest(original[:member])
    digits = original.rindex(b'"', 0, len(original) - 3) - 16
    places = sorted(set(range(0, member, max(1, member // 150)))) + [digits, digits + 15]
    for n, at in enumerate(places):
        damaged = bytearray(original)
        damaged[at] ^= 1 << (n % 7)  # bits 0-6: the byte stays ASCII, so the flip is not simply invalid UTF-8
        path.write_bytes(bytes(damaged))
        result = trestle.run_raw("verify", tmp_path / "ckpt")
        assert result.returncode == 1 and "manifest.json" in result.stderr, (at, chr(original[at]), result.stderr)
        with pytest.raises(read_trestle.FormatError,
                           match=r"manifest\.json: (not valid JSON|the manifest does not match its checksum)"):
            read_trestle.read_checkpoint(str(tmp_path / "ckpt"))
    path.write_bytes(original)
    assert trestle.run_raw("verify", tmp_path / "ckpt").returncode == 0

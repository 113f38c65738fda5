"""A model in the Hugging Face hub cache, laid out by huggingface_hub's own functions (models--org--name/{blobs, refs,
snapshots/<rev>/} whose files are relative links into blobs/): `trestle convert --from hf <snapshot>` reads it and
the model comes back bit-exact with its side files; a config, tokenizer or weights file linked out of the tree is
refused naming the file and its target, and nothing is written."""
import hashlib
import os
import shutil

import huggingface_hub
import pytest
from huggingface_hub import file_download

from models import assert_bit_exact, load_hf_tensors, save_tiny_model

LLAMA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
REPO_ID = "trestle-test/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"
TOKENIZER_CONFIG = {"model_max_length": 64}


def cache_model(model_dir, cache_dir):
    """Stores every file of `model_dir` in a hub cache as huggingface_hub's downloads do (each blob named by its hash,
    the snapshot's file a relative link to it, refs/main naming the revision); returns the snapshot directory."""
    storage = cache_dir / file_download.repo_folder_name(repo_id=REPO_ID, repo_type="model")
    (storage / "blobs").mkdir(parents=True)
    snapshot = storage / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for name in sorted(os.listdir(model_dir)):
        data = (model_dir / name).read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        file_download._create_symlink(str(blob), str(snapshot / name), new_blob=True)
    file_download._cache_commit_hash_for_specific_revision(str(storage), "main", REVISION)
    return snapshot


@pytest.fixture
def snapshot(tmp_path):
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0, tokenizer_config=TOKENIZER_CONFIG)
    snapshot = cache_model(hf, tmp_path / "hub")
    # The layout is the hub's own: huggingface_hub finds the snapshot offline, and every file in it is a relative link.
    found = huggingface_hub.snapshot_download(REPO_ID, cache_dir=tmp_path / "hub", local_files_only=True)
    assert os.path.samefile(found, snapshot)
    for name in os.listdir(snapshot):
        assert os.readlink(snapshot / name).startswith("../../blobs/"), name
    return snapshot


def test_converts_from_a_hub_cache_snapshot_and_back(trestle, snapshot, tmp_path):
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    trestle.run("convert", "--from", "hf", snapshot, "--to", "trestle", ckpt, "--tp", "2", "--quiet")
    trestle.run("convert", "--from", "trestle", ckpt, "--to", "hf", back, "--quiet")
    assert_bit_exact(load_hf_tensors(snapshot), load_hf_tensors(back))
    assert (back / "tokenizer_config.json").read_bytes() == (snapshot / "tokenizer_config.json").read_bytes()
    assert not (back / "tokenizer_config.json").is_symlink()
    # hf -> hf reads the snapshot too, config.json included.
    rewritten = tmp_path / "rewritten"
    trestle.run("convert", "--from", "hf", snapshot, "--to", "hf", rewritten)
    assert_bit_exact(load_hf_tensors(snapshot), load_hf_tensors(rewritten))
    for name in ("config.json", "tokenizer_config.json"):
        assert (rewritten / name).read_bytes() == (snapshot / name).read_bytes(), name


@pytest.mark.parametrize("to", ["trestle", "hf", "megatron-dist"])
@pytest.mark.parametrize("name", ["tokenizer_config.json", "config.json", "model.safetensors"])
def test_refuses_a_file_linked_out_of_the_tree(trestle, snapshot, tmp_path, name, to):
    # The linked file is a valid one (the model's own, moved out), so only where it lies can make it refused.
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copyfile(snapshot / name, outside / name)
    (snapshot / name).unlink()
    (snapshot / name).symlink_to(os.path.relpath(outside / name, snapshot))
    out = tmp_path / "out"
    result = trestle.run_raw("convert", "--from", "hf", snapshot, "--to", to, out, "--quiet")
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert f"{snapshot / name}: a symbolic link to {outside.resolve() / name}" in result.stderr, result.stderr
    assert "outside the model directory" in result.stderr, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["hf", "hub", "outside"]  # no output, not even a partial one


def test_refuses_a_blobs_directory_that_is_a_link(trestle, snapshot, tmp_path):
    # A cache-shaped directory whose blobs/ is itself a link (blobs -> /etc) is no cache: its "blobs" are any files.
    storage = snapshot.parent.parent
    shutil.move(storage / "blobs", tmp_path / "elsewhere")
    (storage / "blobs").symlink_to(tmp_path / "elsewhere")
    for to in ("trestle", "hf"):
        out = tmp_path / f"out_{to}"
        result = trestle.run_raw("convert", "--from", "hf", snapshot, "--to", to, out, "--quiet")
        assert result.returncode == 1, (to, result.returncode, result.stdout, result.stderr)
        assert "outside the model directory" in result.stderr, result.stderr
        assert str(tmp_path / "elsewhere") in result.stderr, result.stderr
        assert not out.exists()


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_inspect_and_verify_refuse_weights_linked_out_of_the_tree(trestle, snapshot, tmp_path, command):
    # The same rule as convert's: a weights file linked out of the tree is not read.
    ckpt = tmp_path / "ckpt"
    trestle.run("convert", "--from", "hf", snapshot, "--to", "trestle", ckpt, "--quiet")
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(snapshot / "model.safetensors", outside)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(outside)
    args = ["inspect", snapshot] if command == "inspect" else ["verify", ckpt, "--against", snapshot]
    result = trestle.run_raw(*args)
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert f"{snapshot / 'model.safetensors'}: a symbolic link to {outside.resolve()}" in result.stderr, result.stderr

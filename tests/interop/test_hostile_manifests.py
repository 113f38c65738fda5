"""Checkpoints edited by a stranger: a Trestle manifest whose chunks overlap (a duplicated chunk, or an overlap hidden
by a gap of the same size) is refused by every reader (convert --to hf, reshard, verify) naming the tensor, and a
side-file name that tries to leave the checkpoint directory, or a side file replaced by a link, writes nothing outside
the output; a manifest claiming a tensor far larger than its file is refused by verify without allocating the claim;
a chunk box whose end overflows 64 bits, a world size of 0, a key twice in one object and absurd nesting are refused;
stored weights the recorded model has no place for are refused by every writer (megatron-dist too), a 'training' or
'model' that is no object and side files that are no list of names by every reader, and a tracker or hf_files/
replaced by a link is not followed.
"""
import json
import os
import shutil
import subprocess

import pytest

from models import assert_link_is_not_followed, save_tiny_model

LLAMA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


@pytest.fixture
def converted(tmp_path, trestle):
    hf = tmp_path / "hf"
    save_tiny_model(hf, "LlamaConfig", LLAMA, seed=0, randomise_vectors=False, tokenizer_config={"model_max_length": 64})
    ckpt = tmp_path / "ckpt"
    trestle.run("convert", "--from", "hf", hf, "--to", "trestle", ckpt, "--tp", "2", "--quiet")
    return ckpt


def manifest_path(ckpt):
    iteration = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    return ckpt / f"iter_{iteration:07d}" / "manifest.json"


def edit_manifest(ckpt, edit):
    path = manifest_path(ckpt)
    manifest = json.loads(path.read_text())
    manifest.pop("manifest_xxh3_64")  # an edited manifest without its checksum is read (as older ones are)
    edit(manifest)
    path.write_text(json.dumps(manifest))


def refused_everywhere(trestle, ckpt, tmp_path, expected):
    for args in (["convert", "--from", "trestle", ckpt, "--to", "hf", tmp_path / "out_hf"],
                 ["reshard", ckpt, tmp_path / "out_reshard", "--tp", "1"],
                 ["verify", ckpt]):
        result = trestle.run_raw(*args)
        assert result.returncode == 1, (args, result.returncode, result.stdout, result.stderr)
        assert expected in result.stderr, (args, result.stderr)
    assert not (tmp_path / "out_hf").exists() or not any((tmp_path / "out_hf").glob("*.safetensors"))


def test_duplicated_chunk_is_refused(trestle, converted, tmp_path):
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    edit_manifest(converted, lambda m: m["tensors"][name]["chunks"].append(m["tensors"][name]["chunks"][0]))
    refused_everywhere(trestle, converted, tmp_path, name)


def test_overlap_hidden_by_an_equal_gap_is_refused(trestle, converted, tmp_path):
    # Two TP chunks of linear_proj (split on dim 1): point the second at the first's columns. The element count still
    # adds up to the tensor's, but half the columns are held twice and half never.
    name = "decoder.layers.1.self_attention.linear_proj.weight"

    def overlap(m):
        chunks = m["tensors"][name]["chunks"]
        assert len(chunks) == 2
        chunks[1]["offset"] = chunks[0]["offset"]
    edit_manifest(converted, overlap)
    refused_everywhere(trestle, converted, tmp_path, name)


def test_chunk_file_name_with_a_nul_is_refused(trestle, converted, tmp_path):
    # "rank_00001.bin\0x" would open rank_00001.bin: the OS sees the path end at the NUL.
    name = "decoder.layers.1.self_attention.linear_proj.weight"

    def nul(m):
        chunk = m["tensors"][name]["chunks"][-1]
        chunk["file"] = chunk["file"] + "\u0000x"
    edit_manifest(converted, nul)
    refused_everywhere(trestle, converted, tmp_path, "\\x00x' is not a file name in the iteration directory")


@pytest.mark.parametrize("bad_name", ["../escaped.txt", "/tmp/trestle-absolute-escape.txt", "sub/dir.txt", "..",
                                      "tokenizer.json\u0000.txt"])
def test_side_file_names_cannot_leave_the_directory(trestle, converted, tmp_path, bad_name):
    outside = tmp_path / "escaped.txt"
    edit_manifest(converted, lambda m: m["model"]["hf"]["side_files"].append(bad_name))
    out = tmp_path / "out" / "hf"
    out.parent.mkdir()
    result = trestle.run_raw("convert", "--from", "trestle", converted, "--to", "hf", out)
    assert result.returncode != 0, result.stdout
    assert "not a plain file name" in result.stderr, result.stderr
    assert not outside.exists()
    if os.path.isabs(bad_name):
        assert not os.path.exists(bad_name)


def test_linked_side_file_in_a_checkpoint_is_not_followed(trestle, converted, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the output")
    side = manifest_path(converted).parent / "hf_files" / "tokenizer_config.json"
    side.unlink()
    side.symlink_to(secret)
    out = tmp_path / "out_hf"
    result = trestle.run_raw("convert", "--from", "trestle", converted, "--to", "hf", out)
    assert result.returncode != 0, result.stdout
    assert "tokenizer_config.json" in result.stderr and "link" in result.stderr, result.stderr
    for root, _, files in os.walk(out) if out.exists() else []:
        for f in files:
            assert "not for the output" not in open(os.path.join(root, f), errors="ignore").read()


def test_verify_does_not_allocate_what_a_manifest_claims(trestle, converted):
    # A tensor claimed to be 8 GiB (block table and sizes consistent) whose rank file holds a few KiB: verify must fail
    # on the missing bytes, naming the tensor, under an address-space limit far below the claim.
    import resource
    name = "decoder.final_layernorm.weight"
    blocks = 2048

    def huge(m):
        t = m["tensors"][name]
        t["global_shape"] = [blocks, 1 << 20]
        c = t["chunks"][0]
        c.update(offset=[0, 0], shape=[blocks, 1 << 20], stored_bytes=blocks * (4 << 20), xxh3_64=["0" * 16] * blocks)
    edit_manifest(converted, huge)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    result = subprocess.run([trestle.path, "verify", str(converted)], capture_output=True, text=True, timeout=120,
                            preexec_fn=limit)
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert name in result.stderr, result.stderr


def test_side_files_are_inside_the_commit_and_verified(trestle, converted, tmp_path):
    # The tokenizer file travels inside the committed iteration, recorded with its size and digest: a torn or edited
    # copy fails verify, a missing one fails every reader, and an intact one comes back with the export.
    manifest = json.loads(manifest_path(converted).read_text())
    assert "hf_files/tokenizer_config.json" in manifest["files"], manifest.get("files")
    side = manifest_path(converted).parent / "hf_files" / "tokenizer_config.json"
    assert side.read_text() == '{"model_max_length": 64}'
    assert not (converted / "hf_files").exists()
    trestle.run("verify", converted)
    out = tmp_path / "back"
    trestle.run("convert", "--from", "trestle", converted, "--to", "hf", out)
    assert (out / "tokenizer_config.json").read_text() == side.read_text()

    side.write_text('{"model_max_length": 65}')  # same size, other contents
    result = trestle.run_raw("verify", converted)
    assert result.returncode == 1 and "hf_files/tokenizer_config.json" in result.stderr, result.stderr
    side.write_text("{}")  # torn
    result = trestle.run_raw("convert", "--from", "trestle", converted, "--to", "hf", tmp_path / "torn")
    assert result.returncode == 1 and "tokenizer_config.json" in result.stderr, result.stderr
    side.unlink()
    result = trestle.run_raw("reshard", converted, tmp_path / "missing", "--tp", "1")
    assert result.returncode == 1 and "tokenizer_config.json" in result.stderr, result.stderr


@pytest.mark.parametrize("case,expected", [
    # offset + shape overflowing 64 bits must not wrap into "within the tensor"
    ("offset_overflow", "is not within the global shape [32]"),
    ("world_size_zero", "'world_size' must be between 1 and 2^24"),
    ("format_not_a_string", "not a Trestle manifest (expected \"format\": \"trestle\")"),  # found by fuzzing: threw
    ("duplicate_key", "the key 'iteration' appears twice in one object"),
    ("deep_nesting", "nesting deeper than 512 levels"),
])
def test_hostile_manifest_values_are_refused(trestle, converted, tmp_path, case, expected):
    path = manifest_path(converted)
    text = path.read_text()
    manifest = json.loads(text)
    manifest.pop("manifest_xxh3_64")
    if case == "offset_overflow":
        manifest["tensors"]["decoder.final_layernorm.weight"]["chunks"][0]["offset"] = [2 ** 63 - 1]
        text = json.dumps(manifest)
    elif case == "world_size_zero":
        manifest["world_size"] = 0
        text = json.dumps(manifest)
    elif case == "format_not_a_string":
        manifest["format"] = 2
        text = json.dumps(manifest)
    elif case == "duplicate_key":
        text = text.rstrip()[:-1] + ', "iteration": 7}'
    else:
        text = text.rstrip()[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}"
    path.write_text(text)
    for command in (["verify", converted], ["inspect", converted],
                    ["convert", "--from", "trestle", converted, "--to", "hf", tmp_path / "out"]):
        result = trestle.run_raw(*command)
        assert result.returncode == 1, (command, result.stdout, result.stderr)
        assert expected in result.stderr, (command, result.stderr)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field,value", [
    (("parallel", "norm_naming"), 5),
    (("parallel", "norm_naming"), "fast"),
    (("hf", "expert_layout"), []),
])
def test_model_fields_of_the_wrong_type_are_refused_naming_the_checkpoint(trestle, converted, tmp_path, field, value):
    # (these threw from the JSON library before: the CLI reported its message, naming neither the file nor the field)
    def edit(m):
        m["model"][field[0]][field[1]] = value
    edit_manifest(converted, edit)
    for args in (["convert", "--from", "trestle", converted, "--to", "hf", tmp_path / "out_hf"],
                 ["reshard", converted, tmp_path / "out_reshard", "--tp", "1"]):
        result = trestle.run_raw(*args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "iter_0000000: " in result.stderr and f"model.{field[0]}.{field[1]} is " in result.stderr, result.stderr


@pytest.mark.parametrize("case", ["fewer_layers_in_config", "extra_tensor", "tied_with_an_output_layer"])
def test_stored_tensors_the_model_does_not_describe_are_refused_by_every_writer(trestle, converted, tmp_path, case):
    """Weights the recorded model has no place for are never dropped: the torch_dist writer refuses them as the Hugging
    Face writer, reshard and verify do (it wrote the checkpoint without them before, exit 0)."""
    def edit(m):
        if case == "fewer_layers_in_config":
            m["model"]["hf"]["config"]["num_hidden_layers"] = 1
        elif case == "extra_tensor":
            m["tensors"]["decoder.extra.weight"] = m["tensors"]["decoder.final_layernorm.weight"]
        else:
            m["model"]["hf"]["config"]["tie_word_embeddings"] = True
    edit_manifest(converted, edit)
    refused_everywhere(trestle, converted, tmp_path, "")
    out = tmp_path / "out_dist"
    result = trestle.run_raw("convert", "--from", "trestle", converted, "--to", "megatron-dist", out)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "conversion accounting failed: not consumed by the mapping: " in result.stderr, result.stderr
    assert not out.exists()


@pytest.mark.parametrize("field,value,expected", [
    (("training",), 5, "'training' must be an object"),
    (("model",), [], "'model' must be an object"),
    (("model", "hf", "side_files"), "generation_config.json", "model.hf.side_files is \"generation_config.json\", "
                                                               "not a list of file names"),
    (("model", "hf", "side_files"), [7], "model.hf.side_files holds 7, not a file name"),
    # a side file in the place of a file the converters write (with its bytes in hf_files/ and the manifest's files it
    # replaced the exported config.json or weights, exit 0)
    (("model", "hf", "side_files"), ["tokenizer.json", "config.json"],
     "model.hf.side_files holds 'config.json', which cannot be a side file"),
    (("model", "hf", "side_files"), ["model.safetensors.index.json"],
     "model.hf.side_files holds 'model.safetensors.index.json', which cannot be a side file"),
])
def test_manifest_sections_of_the_wrong_type_are_refused(trestle, converted, tmp_path, field, value, expected):
    # ('training': 5 threw from the JSON library in reshard, naming nothing; side_files as a string dropped the side
    # files from every output, exit 0)
    def edit(m):
        parent = m
        for key in field[:-1]:
            parent = parent[key]
        parent[field[-1]] = value
    edit_manifest(converted, edit)
    for args in (["convert", "--from", "trestle", converted, "--to", "hf", tmp_path / "out_hf"],
                 ["convert", "--from", "trestle", converted, "--to", "megatron-dist", tmp_path / "out_dist"],
                 ["reshard", converted, tmp_path / "out_reshard", "--tp", "1"], ["verify", converted]):
        result = trestle.run_raw(*args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "iter_0000000" in result.stderr and expected in result.stderr, (args, result.stderr)
    assert not any((tmp_path / name).exists() for name in ("out_hf", "out_dist", "out_reshard"))


@pytest.mark.parametrize("linked", ["latest_checkpointed_iteration.txt", "iter_0000000/hf_files"])
def test_a_checkpoint_entry_replaced_by_a_link_is_not_followed(trestle, converted, tmp_path, linked):
    commands = [["verify", converted], ["convert", "--from", "trestle", converted, "--to", "hf", tmp_path / "out"]]
    assert_link_is_not_followed(trestle.run_raw, converted / linked, tmp_path / "elsewhere", commands, tmp_path / "out")


TRAIN = ["--mock-data", "--seq-length", 16, "--micro-batch-size", 1, "--global-batch-size", 1, "--lr", "1e-4",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", 96]


def set_config(key, value):
    def edit(m):
        m["model"]["hf"]["config"][key] = value
    return edit


def stray_tensor(m):
    m["tensors"]["decoder.extra.weight"] = m["tensors"]["decoder.final_layernorm.weight"]


def integer_weight(m):
    m["tensors"]["decoder.layers.0.mlp.linear_fc2.weight"]["dtype"] = "i32"  # (the bytes of the f32 it was)


@pytest.mark.parametrize("edit,expected", [
    # one key/value head where the stored QKV holds two: the loader read the smaller model's boxes out of it
    (set_config("num_key_value_heads", 1), "linear_qkv.weight is [64, 32], expected [48, 32]"),
    (set_config("num_hidden_layers", 1), "decoder.layers.1.self_attention.linear_qkv.weight"),
    (integer_weight, "tensor 'decoder.layers.0.mlp.linear_fc2.weight' is stored as i32; a model weight must be "
                     "floating point"),
    (stray_tensor, "decoder.extra.weight"),
], ids=["kv_heads", "layers", "integer", "stray"])
def test_train_loads_only_what_verify_accepts(trestle, converted, tmp_path, edit, expected):
    """`trestle train --load` held a checkpoint to less than verify and reshard do: it read the boxes its model needs
    out of whatever was stored, so a manifest describing a smaller model than its tensors, an integer weight or a
    stray tensor trained silently (and saved the smaller model)."""
    edit_manifest(converted, edit)
    refused_everywhere(trestle, converted, tmp_path, expected)
    result = trestle.run_raw("train", "--load", converted, *TRAIN, "--train-iters", 1, "--save", tmp_path / "save")
    assert result.returncode == 1 and expected in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "save").exists() or not any((tmp_path / "save").glob("iter_*"))


def test_adam_state_needs_its_step_and_floating_moments(trestle, converted, tmp_path):
    """A trained checkpoint whose Adam moments lost their step (or whose step or moments are relabelled) is refused by
    every reader and the trainer, as the torch_dist reader refuses a copy that lost common.pt: it resumed with the
    step at 0 (Adam's bias correction restarted) or the moments read as integers."""
    save = tmp_path / "save"
    trestle.run("train", "--load", converted, *TRAIN, "--train-iters", 2, "--save", save, "--save-interval", 2)
    moment = "optimizer.exp_avg.decoder.final_layernorm.weight"
    assert moment in json.loads(manifest_path(save).read_text())["tensors"]
    original = manifest_path(save).read_text()
    for edit, expected in [(lambda m: m["tensors"].pop("optimizer.step"), "holds optimizer state but not Adam's step"),
                           (lambda m: m["tensors"]["optimizer.step"].update(dtype="f64"),
                            "tensor 'optimizer.step' is f64 []; Adam's step is one integer"),
                           (lambda m: m["tensors"][moment].update(dtype="i32"),
                            f"tensor '{moment}' is stored as i32; Adam's state of a weight is floating point")]:
        manifest_path(save).write_text(original)
        edit_manifest(save, edit)
        for args in (["verify", save], ["reshard", save, tmp_path / "out", "--tp", 2],
                     ["train", "--load", save, *TRAIN, "--train-iters", 4]):
            result = trestle.run_raw(*args)
            assert result.returncode == 1 and expected in result.stderr, (args, result.stderr[-3000:])
        assert not (tmp_path / "out").exists()
        # the weights are still to be had, as the messages say: --model-only, --no-load-optim
        trestle.run("reshard", save, tmp_path / "weights", "--tp", 2, "--model-only", "-q")
        kept = json.loads(manifest_path(tmp_path / "weights").read_text())["tensors"]
        assert kept and not any(name.startswith("optimizer.") for name in kept)
        shutil.rmtree(tmp_path / "weights")
        trestle.run("train", "--load", save, *TRAIN, "--train-iters", 4, "--no-load-optim")
    manifest_path(save).write_text(original)
    trestle.run("train", "--load", save, *TRAIN, "--train-iters", 4)

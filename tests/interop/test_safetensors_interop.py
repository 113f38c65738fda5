"""Safetensors interop checked against the reference packages: files that `safetensors` (torch and numpy APIs) and
`transformers.save_pretrained` write are read by `trestle inspect` bit for bit (xxh3-64 from the `xxhash` package), and
checkpoints that `trestle convert --from hf --to hf` writes are read back by `safetensors.safe_open` and
`transformers.AutoModelForCausalLM.from_pretrained` with identical tensors and logits."""
import json
import os

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers
import xxhash
from huggingface_hub import split_torch_state_dict_into_shards
from models import assert_bit_exact, save_tiny_model
from safetensors import safe_open

# torch dtype -> the name `trestle inspect --json` reports (ckpt/dtype.h)
TORCH_DTYPES = {
    torch.bool: "bool", torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.uint16: "u16",
    torch.int32: "i32", torch.uint32: "u32", torch.int64: "i64", torch.uint64: "u64", torch.float16: "f16",
    torch.bfloat16: "bf16", torch.float32: "f32", torch.float64: "f64", torch.float8_e4m3fn: "f8_e4m3",
    torch.float8_e5m2: "f8_e5m2",
}
NUMPY_DTYPES = {
    np.bool_: "bool", np.uint8: "u8", np.int8: "i8", np.int16: "i16", np.uint16: "u16", np.int32: "i32",
    np.uint32: "u32", np.int64: "i64", np.uint64: "u64", np.float16: "f16", np.float32: "f32", np.float64: "f64",
}
TOKENIZER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
    "tokenizer_config.json": '{"model_max_length": 128}\n',
    "special_tokens_map.json": '{"bos_token": "<s>"}\n',
}


def raw_bytes(tensor):
    """The bytes safetensors stores for a tensor: its contiguous memory, whatever the dtype or shape."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_tensor(dtype, shape, generator):
    """Random bit patterns of `dtype` (NaNs included for floats), so every byte is checked."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator, dtype=torch.uint8).to(torch.bool)
    size = torch.empty((), dtype=dtype).element_size()
    numel = int(np.prod(shape, dtype=np.int64))
    raw = torch.randint(0, 256, (numel * size,), generator=generator, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def every_dtype_tensors(seed=0):
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, dtype in enumerate(TORCH_DTYPES):
        name = TORCH_DTYPES[dtype]
        tensors[f"{name}.matrix"] = random_tensor(dtype, (i + 2, 3), generator)
        tensors[f"{name}.empty"] = random_tensor(dtype, (0, 3), generator)
        tensors[f"{name}.scalar"] = random_tensor(dtype, (), generator)
    tensors["odd.f8"] = random_tensor(torch.float8_e4m3fn, (7,), generator)
    tensors["odd.vector"] = random_tensor(torch.float64, (5,), generator)
    return tensors


def check_inspect_matches(report, expected, file_of=None):
    """Every tensor in `expected` (name -> torch tensor) appears in the inspect report with identical dtype, shape,
    byte count and xxh3-64, and the report holds nothing else."""
    by_name = {t["name"]: t for t in report["tensors"]}
    assert sorted(by_name) == sorted(expected)
    for name, tensor in expected.items():
        got = by_name[name]
        data = raw_bytes(tensor)
        assert got["dtype"] == TORCH_DTYPES[tensor.dtype], name
        assert got["shape"] == list(tensor.shape), name
        assert got["bytes"] == len(data), name
        assert got["xxh3_64"] == xxhash.xxh3_64_hexdigest(data), name
        if file_of is not None:
            assert got["file"] == file_of[name], name
    assert report["totals"]["tensors"] == len(expected)
    assert report["totals"]["bytes"] == sum(len(raw_bytes(t)) for t in expected.values())
    assert report["totals"]["parameters"] == sum(t.numel() for t in expected.values())


def read_all(directory):
    """Every tensor of a safetensors checkpoint (file or directory), read with the reference reader."""
    paths = [directory] if os.path.isfile(directory) else [
        os.path.join(directory, f) for f in sorted(os.listdir(directory)) if f.endswith(".safetensors")]
    tensors, file_of, metadata = {}, {}, {}
    for path in paths:
        with safe_open(path, framework="pt") as f:
            metadata[os.path.basename(path)] = f.metadata()
            for key in f.keys():
                assert key not in tensors, f"{key} is in two files"
                tensors[key] = f.get_tensor(key)
                file_of[key] = os.path.basename(path)
    return tensors, file_of, metadata



# --- files the reference writers produce, read by trestle inspect ---

def test_inspect_reads_every_dtype_from_safetensors_torch(tmp_path, trestle):
    tensors = every_dtype_tensors()
    metadata = {"format": "pt", "producer": "safetensors.torch", "note": "ünïcode \"quotes\""}
    path = tmp_path / "every_dtype.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)

    report = trestle.inspect(path)
    check_inspect_matches(report, tensors, {name: path.name for name in tensors})
    assert len(report["files"]) == 1
    assert report["files"][0]["metadata"] == metadata
    assert report["files"][0]["bytes"] == path.stat().st_size
    assert "config" not in report

    # The same file as a one-file Hugging Face directory.
    assert trestle.inspect(tmp_path)["tensors"] == report["tensors"]


def test_inspect_reads_every_dtype_from_safetensors_numpy(tmp_path, trestle):
    rng = np.random.default_rng(1)
    arrays = {}
    for i, dtype in enumerate(NUMPY_DTYPES):
        raw = rng.integers(0, 256, size=(i + 1) * 4 * np.dtype(dtype).itemsize, dtype=np.uint8)
        if dtype is np.bool_:
            raw = raw % 2
        arrays[f"np.{NUMPY_DTYPES[dtype]}"] = raw.view(dtype).reshape(i + 1, 4)
        arrays[f"np.{NUMPY_DTYPES[dtype]}.empty"] = np.zeros((2, 0), dtype=dtype)
        arrays[f"np.{NUMPY_DTYPES[dtype]}.scalar"] = raw[: np.dtype(dtype).itemsize].view(dtype).reshape(())
    path = tmp_path / "numpy.safetensors"
    safetensors.numpy.save_file(arrays, str(path), metadata={"format": "np"})

    report = trestle.inspect(path)
    by_name = {t["name"]: t for t in report["tensors"]}
    assert sorted(by_name) == sorted(arrays)
    for name, array in arrays.items():
        data = np.ascontiguousarray(array).tobytes()
        got = by_name[name]
        assert got["dtype"] == NUMPY_DTYPES[array.dtype.type], name
        assert got["shape"] == list(array.shape), name
        assert got["bytes"] == len(data), name
        assert got["xxh3_64"] == xxhash.xxh3_64_hexdigest(data), name
    assert report["files"][0]["metadata"] == {"format": "np"}


def test_inspect_rejects_a_damaged_file_without_crashing(tmp_path, trestle):
    tensors = {"a": torch.arange(6, dtype=torch.float32), "b": torch.ones(2, dtype=torch.bfloat16)}
    path = tmp_path / "damaged.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    data = path.read_bytes()
    for what, damaged in [("truncated data", data[:-1]), ("trailing byte", data + b"\0"),
                          ("truncated header", data[:20]), ("short", data[:5])]:
        path.write_bytes(damaged)
        result = trestle.run_raw("inspect", path, "--json")
        assert result.returncode == 1, (what, result.returncode, result.stderr)
        assert str(path) in result.stderr, (what, result.stderr)


# --- a tiny Llama saved by transformers ---

LLAMA = dict(vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random bf16 LlamaForCausalLM saved sharded by save_pretrained, with stand-in tokenizer files."""
    directory = tmp_path_factory.mktemp("tiny_llama")
    model = save_tiny_model(directory, "LlamaConfig", LLAMA, seed=0, dtype=torch.bfloat16, randomise_vectors=False,
                            max_shard_size="200KB")
    for name, text in TOKENIZER_FILES.items():
        (directory / name).write_text(text)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return directory, model, state


@pytest.fixture(scope="session")
def tiny_llama_single_file(tiny_llama, tmp_path_factory):
    """The same model saved by save_pretrained as one model.safetensors."""
    _, model, _ = tiny_llama
    directory = tmp_path_factory.mktemp("tiny_llama_single")
    model.save_pretrained(directory)
    return directory / "model.safetensors"


@pytest.fixture(scope="session")
def tokens():
    return torch.randint(0, LLAMA["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(5))


def test_save_pretrained_fixture_is_sharded(tiny_llama):
    directory, _, _ = tiny_llama
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_inspect_reads_sharded_llama_bit_exactly(tiny_llama, trestle):
    directory, model, state = tiny_llama
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors, file_of, _ = read_all(str(directory))
    assert_bit_exact(state, tensors)

    report = trestle.inspect(directory)
    check_inspect_matches(report, tensors, index["weight_map"])
    assert report["totals"]["parameters"] == model.num_parameters()
    assert sorted(f["file"] for f in report["files"]) == sorted(set(index["weight_map"].values()))
    config = report["config"]
    assert config["architecture"] == "LlamaForCausalLM"
    assert config["model_type"] == "llama"
    assert config["num_layers"] == LLAMA["num_hidden_layers"]
    assert config["hidden_size"] == LLAMA["hidden_size"]
    assert config["ffn_hidden_size"] == LLAMA["intermediate_size"]
    assert config["num_attention_heads"] == LLAMA["num_attention_heads"]
    assert config["num_kv_heads"] == LLAMA["num_key_value_heads"]
    assert config["head_dim"] == LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
    assert config["vocab_size"] == LLAMA["vocab_size"]
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "bfloat16"


# --- checkpoints trestle convert writes, read by safetensors and transformers ---

@pytest.fixture(scope="session")
def reference_logits(tiny_llama, tokens):
    """Logits of the saved source checkpoint, loaded by transformers the same way the converted one will be."""
    directory, _, _ = tiny_llama
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        return model(tokens).logits


def hub_weight_map(state, max_shard_size):
    """save_pretrained's cutting of the tensors in the order trestle streams them (sorted by name)."""
    ordered = {name: state[name] for name in sorted(state)}
    split = split_torch_state_dict_into_shards(ordered, max_shard_size=max_shard_size)
    return split.tensor_to_filename, split.is_sharded


@pytest.mark.parametrize("max_shard_size", ["5GB", "300KB", "100KB", "20KB"])
def test_convert_output_loads_bit_exactly(tmp_path, tiny_llama, tokens, reference_logits, trestle_convert,
                                          max_shard_size):
    source, _, state = tiny_llama
    dst = tmp_path / "converted"
    trestle_convert.run("convert", "--from", "hf", source, "--to", "hf", dst, "--max-shard-size", max_shard_size,
                        "--quiet")

    # Layout: save_pretrained's file names and cutting, an index only when sharded.
    expected_map, sharded = hub_weight_map(state, max_shard_size)
    files = sorted(os.listdir(dst))
    weight_files = sorted(set(expected_map.values()))
    side_files = sorted(["config.json", "generation_config.json", *TOKENIZER_FILES])
    if sharded:
        assert files == sorted(weight_files + side_files + ["model.safetensors.index.json"])
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == expected_map
        assert index["metadata"]["total_size"] == sum(len(raw_bytes(t)) for t in state.values())
        assert index["metadata"]["total_parameters"] == sum(t.numel() for t in state.values())
    else:
        assert weight_files == ["model.safetensors"]
        assert files == sorted(["model.safetensors"] + side_files)
    for name in side_files:
        assert (dst / name).read_bytes() == (source / name).read_bytes(), name

    # The reference reader sees the same tensors, in the files the index names, with transformers' metadata.
    tensors, file_of, metadata = read_all(str(dst))
    assert_bit_exact(state, tensors)
    assert file_of == expected_map
    assert all(m.get("format") == "pt" for m in metadata.values())

    # transformers loads it: same state dict, same logits.
    model = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16).eval()
    assert_bit_exact(state, {k: v for k, v in model.state_dict().items()})
    with torch.no_grad():
        logits = model(tokens).logits
    assert torch.equal(logits, reference_logits)

    # And trestle reads back what it wrote with the checksums of the source.
    assert trestle_convert.inspect(dst)["tensors"] == [
        dict(t, file=expected_map[t["name"]]) for t in trestle_convert.inspect(source)["tensors"]]


def test_convert_every_dtype_file(tmp_path, trestle_convert):
    tensors = every_dtype_tensors(seed=7)
    metadata = {"format": "pt", "origin": "interop"}
    source = tmp_path / "every_dtype.safetensors"
    safetensors.torch.save_file(tensors, str(source), metadata=metadata)
    dst = tmp_path / "out"
    trestle_convert.run("convert", "--from", "hf", source, "--to", "hf", dst, "--quiet")
    assert sorted(os.listdir(dst)) == ["model.safetensors"]
    got, _, got_metadata = read_all(str(dst))
    assert_bit_exact(tensors, got)
    assert got_metadata["model.safetensors"] == metadata
    # safetensors' own loader (which checks the layout it expects) agrees.
    assert_bit_exact(tensors, safetensors.torch.load_file(str(dst / "model.safetensors")))


def test_convert_writes_the_same_bytes_as_safetensors(tmp_path, trestle_convert):
    """Same tensors and metadata give the reference writer's file byte for byte (layout order, header, padding)."""
    tensors = every_dtype_tensors(seed=3)
    tensors["z.late.name.i64"] = torch.arange(5)
    tensors["a.early.name.f64"] = torch.ones(2, dtype=torch.float64)
    # One key only: the reference keeps metadata in a Rust HashMap, so the order of several keys is arbitrary.
    metadata = {"format": "gr\u00fc\u00dfe \\ \"q\" \u0001\t"}
    reference = tmp_path / "reference.safetensors"
    safetensors.torch.save_file(tensors, str(reference), metadata=metadata)
    dst = tmp_path / "out"
    trestle_convert.run("convert", "--from", "hf", reference, "--to", "hf", dst, "--quiet")
    assert (dst / "model.safetensors").read_bytes() == reference.read_bytes()


def test_convert_to_one_file_matches_save_pretrained_bytes(tmp_path, tiny_llama, tiny_llama_single_file,
                                                           trestle_convert):
    source, _, _ = tiny_llama
    dst = tmp_path / "single"
    trestle_convert.run("convert", "--from", "hf", source, "--to", "hf", dst, "--quiet")
    assert (dst / "model.safetensors").read_bytes() == tiny_llama_single_file.read_bytes()


def special_floats(n, generator):
    """fp32 values that exercise rounding: halfway cases, subnormals, overflow, infinities, signed zeros."""
    bf16_half_ulp = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0x7F7FFFFF, 0x00000001, 0x80000000],
                                 dtype=torch.int64).to(torch.int32).view(torch.float32)
    specials = torch.tensor([0.0, 1.0, -1.0, 65504.0, 65520.0, 1e-8, 6e-8, 2.0 ** -24, 2.0 ** -25, 3e38, float("inf"),
                             float("-inf"), 1.0009765625, 1.00048828125, 0.1, 1e5, -65536.0], dtype=torch.float32)
    return torch.cat([bf16_half_ulp, specials, torch.randn(n, generator=generator) * 100])


@pytest.mark.parametrize("dtype_option, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                                       ("fp32", torch.float32)])
def test_convert_dtype_matches_torch_casts(tmp_path, trestle_convert, dtype_option, torch_dtype):
    generator = torch.Generator().manual_seed(11)
    f32 = special_floats(1000, generator).reshape(-1, 4)
    tensors = {"w.f32": f32, "w.bf16": f32.to(torch.bfloat16), "w.f16": f32.clamp(-6e4, 6e4).to(torch.float16),
               "ids.i64": torch.arange(10), "mask.bool": torch.tensor([True, False, True])}
    source = tmp_path / "src"
    source.mkdir()
    safetensors.torch.save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    (source / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "float32", "vocab_size": 10}))
    dst = tmp_path / "dst"
    trestle_convert.run("convert", "--from", "hf", source, "--to", "hf", dst, "--dtype", dtype_option, "--quiet")

    got, _, _ = read_all(str(dst))
    for name, tensor in tensors.items():
        expected = tensor.to(torch_dtype) if tensor.is_floating_point() else tensor
        assert got[name].dtype == expected.dtype, name
        assert got[name].shape == expected.shape, name
        # NaN never occurs in the inputs, so bitwise equality is the right test (it also checks signed zeros).
        assert raw_bytes(got[name]) == raw_bytes(expected), (name, (got[name] != expected).nonzero()[:5])
    config = json.loads((dst / "config.json").read_text())
    assert config["dtype"] == str(torch_dtype).removeprefix("torch.")


def test_convert_refuses_a_non_empty_destination(tmp_path, tiny_llama, trestle_convert):
    source, _, _ = tiny_llama
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"precious")
    result = trestle_convert.run_raw("convert", "--from", "hf", source, "--to", "hf", dst, "--quiet")
    assert result.returncode != 0
    assert str(dst) in result.stderr
    assert sorted(os.listdir(dst)) == ["model.safetensors"]
    assert (dst / "model.safetensors").read_bytes() == b"precious"


def test_convert_rejects_bad_options(tmp_path, tiny_llama, trestle_convert):
    source, _, _ = tiny_llama
    for args in (["--max-shard-size", "5XB"], ["--max-shard-size", "abc"], ["--dtype", "int8"], ["--dtype", "f8_e4m3"]):
        dst = tmp_path / ("dst_" + "_".join(args).replace("-", ""))
        result = trestle_convert.run_raw("convert", "--from", "hf", source, "--to", "hf", dst, *args, "--quiet")
        assert result.returncode == 2, (args, result.returncode, result.stderr)
        assert args[1] in result.stderr, (args, result.stderr)
        assert not dst.exists() or not any(dst.iterdir()), args


def test_named_chat_templates_travel_through_every_conversion(tiny_llama, tmp_path, trestle):
    """transformers saves a tokenizer's chat templates beyond the default one as additional_chat_templates/<name>.jinja:
    hf -> hf, hf -> trestle -> hf and trestle -> megatron-dist -> hf keep them, and transformers' tokenizer loaded from
    each output has both templates and renders the named one (it came back as the default alone, and
    apply_chat_template(chat_template="tool_use") rendered the words "tool_use")."""
    import shutil
    import tokenizers
    source = tmp_path / "source"
    shutil.copytree(tiny_llama[0], source)
    for name in TOKENIZER_FILES:
        (source / name).unlink()
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "</s>": 1, "hi": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")
    templates = {"default": "{% for m in messages %}{{ m.content }}{% endfor %}", "tool_use": "TOOLS {{ tools }}"}
    tokenizer.chat_template = templates
    tokenizer.save_pretrained(source)
    assert (source / "additional_chat_templates" / "tool_use.jinja").is_file()
    trestle.run("convert", "--from", "hf", source, "--to", "hf", tmp_path / "hf_hf", "-q")
    trestle.run("convert", "--from", "hf", source, "--to", "trestle", tmp_path / "ckpt", "-q")
    trestle.run("verify", tmp_path / "ckpt")
    trestle.run("convert", "--from", "trestle", tmp_path / "ckpt", "--to", "hf", tmp_path / "hf_trestle", "-q")
    trestle.run("convert", "--from", "trestle", tmp_path / "ckpt", "--to", "megatron-dist", tmp_path / "dist", "-q")
    trestle.run("convert", "--from", "megatron-dist", tmp_path / "dist", "--to", "hf", tmp_path / "hf_dist", "-q")
    for out in ("hf_hf", "hf_trestle", "hf_dist"):
        loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / out)
        assert loaded.chat_template == templates, out
        rendered = loaded.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="tool_use", tools=[],
                                              tokenize=False)
        assert rendered == "TOOLS []", (out, rendered)


def test_diff_pairs_the_layer_norms_of_either_naming(tiny_llama, tmp_path, trestle):
    """A checkpoint converted with --norms local and the same model with Transformer Engine's names (or its
    megatron-dist form, which saves TE names whatever the spec) hold the same tensors: `diff` pairs the norms across
    the two namings and finds them equal (it reported each norm as only in one of them, exit 1); a changed norm is
    still found, under the first checkpoint's name."""
    source = tiny_llama[0]
    local, te, dist = tmp_path / "local", tmp_path / "te", tmp_path / "dist"
    trestle.run("convert", "--from", "hf", source, "--to", "trestle", local, "--norms", "local", "-q")
    trestle.run("convert", "--from", "hf", source, "--to", "trestle", te, "-q")
    trestle.run("convert", "--from", "trestle", local, "--to", "megatron-dist", dist, "-q")
    for a, b in [(local, te), (te, local), (local, dist), (dist, local)]:
        result = trestle.run_raw("diff", a, b, "--json")
        assert result.returncode == 0, (a.name, b.name, result.stdout[-2000:], result.stderr[-2000:])
    changed = tmp_path / "changed"
    changed.mkdir()
    for f in source.iterdir():
        (changed / f.name).write_bytes(f.read_bytes())
    state = {}
    for f in sorted(changed.glob("*.safetensors")):
        tensors = safetensors.torch.load_file(f)
        if "model.layers.0.input_layernorm.weight" in tensors:
            tensors["model.layers.0.input_layernorm.weight"][3] += 1
            safetensors.torch.save_file(tensors, f, metadata={"format": "pt"})
        state.update(tensors)
    assert "model.layers.0.input_layernorm.weight" in state
    trestle.run("convert", "--from", "hf", changed, "--to", "trestle", tmp_path / "changed_te", "-q")
    result = trestle.run_raw("diff", local, tmp_path / "changed_te")
    assert result.returncode == 1 and "decoder.layers.0.input_layernorm.weight" in result.stdout, result.stdout[-2000:]
    assert "only in" not in result.stdout, result.stdout[-2000:]

"""Trestle's data library against megatron-core (the venv's): indexed datasets written by either and read by the
other, and the GPT document/sample/shuffle indices, the blend's dataset assignment, the cache file names and the
first 1,000 training samples of a fixed multi-epoch case, compared with what megatron-core builds; and --mock-data:
numpy's default_rng integers and megatron-core's MockGPTDataset splits, sample for sample."""
import collections
import json
import os
import pathlib
import subprocess

import numpy
import pytest
import torch.distributed as dist

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

SEQ_LENGTH = 64


@pytest.fixture(scope="module")
def data_tool():
    path = pathlib.Path(os.environ["TRESTLE_BIN"]).resolve().parents[1] / "tests" / "trestle_data_tool"
    assert path.is_file(), f"{path}: build the trestle_data_tool target"
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def gloo_world(tmp_path_factory):
    # megatron-core's BlendedDataset asks torch.distributed for its rank when it writes its cache.
    if not dist.is_initialized():
        store = tmp_path_factory.mktemp("store") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield


def random_documents(seed, count, vocab, longest):
    rng = numpy.random.default_rng(seed)
    docs = []
    for _ in range(count):
        sequences = [rng.integers(0, vocab, size=int(rng.integers(1, longest))).tolist()
                     for _ in range(int(rng.integers(1, 3)))]
        docs.append(sequences)
    docs.append([[]])  # an empty document, as preprocess_data.py writes for an empty text without --append-eod
    return docs


def megatron_write(prefix, docs, dtype):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        flat = [t for s in doc for t in s]
        builder.add_document(numpy.array(flat, dtype=numpy.int64), [len(s) for s in doc])
    builder.finalize(f"{prefix}.idx")


def megatron_read(prefix):
    ds = IndexedDataset(str(prefix))
    docs = []
    for d in range(len(ds.document_indices) - 1):
        docs.append([ds[i].tolist() for i in range(ds.document_indices[d], ds.document_indices[d + 1])])
    return docs


@pytest.mark.parametrize("dtype,code", [(numpy.uint16, 8), (numpy.int32, 4), (numpy.int64, 5), (numpy.uint8, 1)])
def test_indexed_dataset_both_ways(tmp_path, data_tool, dtype, code):
    vocab = 250 if dtype == numpy.uint8 else 60000
    docs = random_documents(7, 40, vocab, 300)
    # megatron-core writes, Trestle reads.
    megatron_write(tmp_path / "m", docs, dtype)
    out = json.loads(subprocess.run([data_tool, "read", tmp_path / "m"], check=True, capture_output=True, text=True).stdout)
    assert out["dtype"] == dtype.__name__
    assert out["documents"] == docs
    # Trestle writes: byte-identical files, and megatron-core reads the same documents.
    subprocess.run([data_tool, "write", tmp_path / "t", str(code)], input=json.dumps(docs), check=True, text=True)
    assert (tmp_path / "t.bin").read_bytes() == (tmp_path / "m.bin").read_bytes()
    assert (tmp_path / "t.idx").read_bytes() == (tmp_path / "m.idx").read_bytes()
    assert megatron_read(tmp_path / "t") == docs


class FixedTokenizer:
    """The tokenizer a GPTDatasetConfig needs: its identity enters the cache description."""

    def __init__(self):
        self.unique_identifiers = collections.OrderedDict([("class", "FixedTokenizer"), ("vocab", 5000)])
        self.vocab_size = 5000
        self.eod = 0


def megatron_splits(prefixes_and_weights, split, samples, cache, seed, surplus=0.005, seq_length=SEQ_LENGTH):
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=prefixes_and_weights, split=split,
                              tokenizer=FixedTokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=str(cache), mid_level_dataset_surplus=surplus)
    return BlendedMegatronDatasetBuilder(GPTDataset, samples, lambda: True, config).build()


def trestle_splits(data_tool, data_path, split, samples, cache, seed, out, surplus=0.005, seq_length=SEQ_LENGTH):
    identity = json.dumps(FixedTokenizer().unique_identifiers)
    result = subprocess.run([data_tool, "splits", "--data-path", *map(str, data_path), "--split", split,
                             "--samples", ",".join(map(str, samples)), "--seq-length", str(seq_length),
                             "--seed", str(seed), "--cache", cache, "--tokenizer", identity, "--dump", "1000",
                             "--surplus", str(surplus), "--out", out], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def raw_sample(dataset, i):
    if hasattr(dataset, "dataset_index"):  # BlendedDataset
        return raw_sample(dataset.datasets[dataset.dataset_index[i]], dataset.dataset_sample_index[i])
    return dataset._query_document_sample_shuffle_indices(i)[0]


def compare_caches(trestle_cache, megatron_cache, cls="GPTDataset"):
    ours = sorted(p.name for p in pathlib.Path(trestle_cache).iterdir())
    theirs = sorted(p.name for p in pathlib.Path(megatron_cache).iterdir())
    assert ours == theirs  # same MD5-named files: each side reuses the other's cache
    assert any(f"-{cls}-train-shuffle_index.npy" in n for n in ours)
    for name in ours:
        a, b = pathlib.Path(trestle_cache) / name, pathlib.Path(megatron_cache) / name
        if name.endswith(".npy"):
            x, y = numpy.load(a), numpy.load(b)
            assert x.dtype == y.dtype and x.shape == y.shape, name
            numpy.testing.assert_array_equal(x, y, err_msg=name)
            assert a.read_bytes() == b.read_bytes(), name
        else:
            assert a.read_text() == b.read_text(), name


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("datasets")
    # Several documents of varied length (1 to ~900 tokens), two datasets of different sizes.
    megatron_write(root / "a", random_documents(1, 120, 5000, 600), numpy.uint16)
    megatron_write(root / "b", random_documents(2, 60, 5000, 900), numpy.uint16)
    return root


@pytest.mark.parametrize("train_samples,seed", [(2500, 1234), (1600, 7)])
def test_gpt_indices_single_prefix(tmp_path, data_tool, datasets, train_samples, seed):
    # ~35k tokens -> ~540 samples per epoch: 2500 samples need 5 epochs, the last one separated (it is used for less
    # than 80% of its samples); 1600 samples need 3 epochs with the last one shuffled with the rest or apart.
    samples = [train_samples, 40, 10]
    summary = trestle_splits(data_tool, [datasets / "a"], "90,8,2", samples, tmp_path / "t", seed, tmp_path / "s.npy")
    train, valid, test = megatron_splits([[str(datasets / "a")], None], "90,8,2", samples, tmp_path / "m", seed)
    assert summary == {"train": len(train), "valid": len(valid), "test": len(test)}
    assert train.document_index.shape[0] > 2 * len(train.indices)  # 2+ epochs
    compare_caches(tmp_path / "t", tmp_path / "m")
    ours = numpy.load(tmp_path / "s.npy")
    assert ours.shape == (1000, SEQ_LENGTH + 1)
    for i in range(1000):
        numpy.testing.assert_array_equal(ours[i], raw_sample(train, i), err_msg=f"sample {i}")


@pytest.mark.parametrize("surplus", [0.005, 0.05])  # Megatron's default and --mid-level-dataset-surplus 0.05
def test_blended_assignment_and_samples(tmp_path, data_tool, datasets, surplus):
    samples = [3000, 100, 20]
    data_path = [0.3, datasets / "a", 0.7, datasets / "b"]
    summary = trestle_splits(data_tool, data_path, "90,8,2", samples, tmp_path / "t", 99, tmp_path / "s.npy", surplus)
    blend = [[str(datasets / "a"), str(datasets / "b")], [0.3, 0.7]]
    train, valid, test = megatron_splits(blend, "90,8,2", samples, tmp_path / "m", 99, surplus)
    assert summary == {"train": len(train), "valid": len(valid), "test": len(test)}
    compare_caches(tmp_path / "t", tmp_path / "m")  # includes BlendedDataset dataset_index / dataset_sample_index
    ours = numpy.load(tmp_path / "s.npy")
    for i in range(1000):
        numpy.testing.assert_array_equal(ours[i], raw_sample(train, i), err_msg=f"sample {i}")


PER_SPLIT_CASES = {
    # train alone; validation a weighted blend; no test split
    "single-weighted-none": ([["a"], None], [["a", "b"], [0.4, 0.6]], None),
    # train a blend by size; validation one prefix with a weight (built alone, as megatron-core's per-split path
    # builds any single prefix); test one prefix
    "bysize-oneweighted-single": ([["a", "b"], None], [["b"], [1.0]], [["a"], None]),
}


@pytest.mark.parametrize("case", PER_SPLIT_CASES)
def test_each_split_from_its_own_blend(tmp_path, data_tool, datasets, case):
    """--train-data-path / --valid-data-path / --test-data-path (megatron-core's blend_per_split): each split takes
    every document of its own datasets; the samples of the training and validation splits, the split sizes and the
    cache files (their names hash a description without a split string) are megatron-core's."""
    blends = [None if b is None else ([str(datasets / p) for p in b[0]], b[1]) for b in PER_SPLIT_CASES[case]]
    samples = [1500, 200, 40]
    config = GPTDatasetConfig(random_seed=11, sequence_length=SEQ_LENGTH, blend_per_split=blends,
                              tokenizer=FixedTokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=str(tmp_path / "m"))
    theirs = BlendedMegatronDatasetBuilder(GPTDataset, samples, lambda: True, config).build()
    args = []
    for name, blend in zip(("train", "valid", "test"), blends, strict=True):
        if blend is not None:
            pairs = [] if blend[1] is None else zip(map(str, blend[1]), blend[0], strict=True)
            words = blend[0] if blend[1] is None else [w for pair in pairs for w in pair]
            args += [f"--{name}-data-path", *words]
    identity = json.dumps(FixedTokenizer().unique_identifiers)
    for split in ("train", "valid"):
        result = subprocess.run([data_tool, "splits", *args, "--samples", ",".join(map(str, samples)),
                                 "--seq-length", str(SEQ_LENGTH), "--seed", "11", "--cache", tmp_path / "t",
                                 "--tokenizer", identity, "--dump", "300", "--dump-split", split,
                                 "--out", tmp_path / f"{split}.npy"], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {name: None if d is None else len(d)
                                             for name, d in zip(("train", "valid", "test"), theirs, strict=True)}
        ours, dataset = numpy.load(tmp_path / f"{split}.npy"), theirs[0 if split == "train" else 1]
        assert ours.shape[0] == min(300, len(dataset))
        for i in range(ours.shape[0]):
            numpy.testing.assert_array_equal(ours[i], raw_sample(dataset, i), err_msg=f"{split} sample {i}")
    compare_caches(tmp_path / "t", tmp_path / "m")


def test_trestle_reuses_megatron_cache(tmp_path, data_tool, datasets):
    samples = [700, 20, 5]
    megatron_splits([[str(datasets / "b")], None], "90,8,2", samples, tmp_path / "c", 5)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c").iterdir()}
    trestle_splits(data_tool, [datasets / "b"], "90,8,2", samples, tmp_path / "c", 5, tmp_path / "s.npy")
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "c").iterdir()}
    assert before == after  # every index came from megatron-core's cache; nothing rewritten or added


@pytest.mark.parametrize("seq_length", [1, 7])
def test_one_token_sequences_and_documents_as_megatron(tmp_path, data_tool, seq_length):
    """megatron-core builds samples of one token (--seq-length 1) and a split whose documents hold one token each
    (here the validation split, the last documents): both were refused ("must be above 1", "at least 2 are
    needed")."""
    docs = random_documents(3, 40, 5000, 300) + [[[]], [[5, 6], [7]], [[]], [[8]], [[9]]]
    megatron_write(tmp_path / "mixed", docs, numpy.uint16)
    samples = [600, 30, 0]
    summary = trestle_splits(data_tool, [tmp_path / "mixed"], "97,3,0", samples, tmp_path / "t", 5, tmp_path / "s.npy",
                             seq_length=seq_length)
    train, valid, test = megatron_splits([[str(tmp_path / "mixed")], None], "97,3,0", samples, tmp_path / "m", 5,
                                         seq_length=seq_length)
    assert test is None and summary == {"train": len(train), "valid": len(valid), "test": None}
    assert {int(t) for i in range(len(valid)) for t in raw_sample(valid, i)} <= {8, 9}  # its one-token documents
    compare_caches(tmp_path / "t", tmp_path / "m")
    ours = numpy.load(tmp_path / "s.npy")
    for i in range(min(1000, len(train))):
        numpy.testing.assert_array_equal(ours[i], raw_sample(train, i), err_msg=f"sample {i}")


def test_split_of_empty_documents_is_refused_naming_it(tmp_path, data_tool):
    """megatron-core's epoch count never ends on a split whose documents hold no tokens; Trestle says which split."""
    megatron_write(tmp_path / "gap", random_documents(3, 40, 5000, 300) + [[[]]] * 3, numpy.uint16)
    result = subprocess.run([data_tool, "splits", "--data-path", tmp_path / "gap", "--split", "95,5,0",
                             "--samples", "10,1,0", "--seq-length", "4", "--seed", "1", "--cache", tmp_path / "c",
                             "--tokenizer", "{}", "--dump", "1", "--out", tmp_path / "s.npy"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "gap (valid split): GPT dataset: the exposed documents hold no tokens" in result.stderr, result.stderr


def test_split_without_documents_is_refused(tmp_path, data_tool):
    megatron_write(tmp_path / "tiny", [[[1, 2, 3, 4, 5]]] * 20, numpy.uint16)
    result = subprocess.run([data_tool, "splits", "--data-path", tmp_path / "tiny", "--split", "969,30,1",
                             "--samples", "10,1,1", "--seq-length", "4", "--seed", "1", "--cache", tmp_path / "c",
                             "--tokenizer", "{}", "--dump", "1", "--out", tmp_path / "s.npy"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "tiny" in result.stderr and "test split none of its 20 documents" in result.stderr


@pytest.mark.parametrize("seed,low,high,size", [
    (0, 1, 4096, 100000),  # MockGPTLowLevelDataset's sequence lengths
    (1234, 0, 10, 1001),
    (99, -1000, 5, 4097),
    (7, 0, 2**31 - 1, 1000),
    (2**40 + 7, -2**31, 2**31, 999),  # a two-word seed; the full int32 range (raw 32-bit draws)
    (2**64 - 1, 5, 6, 3),  # the largest seed; a one-value range (no draws)
    (31337, 100, 65636, 5000),
])
def test_default_rng_integers(data_tool, seed, low, high, size):
    """numpy.random.default_rng(seed).integers(low, high, size, dtype=int32): SeedSequence, PCG64 and the buffered
    Lemire draws, value for value."""
    result = subprocess.run([data_tool, "integers", str(seed), str(low), str(high), str(size)], capture_output=True,
                            text=True, check=True)
    expected = numpy.random.default_rng(seed).integers(low, high, size=size, dtype=numpy.int32)
    numpy.testing.assert_array_equal(numpy.array(json.loads(result.stdout), dtype=numpy.int32), expected)


class MockTokenizer:
    """A GPT-2-sized tokenizer for the mock documents (its eod the last id)."""

    def __init__(self):
        self.unique_identifiers = collections.OrderedDict([("class", "MockTokenizer"), ("vocab", 50257)])
        self.vocab_size = 50257
        self.eod = 50256


MOCK_CASES = {
    # split, samples, seed, sequence length, tokenizer, whether megatron-core caches (path_to_cache given)
    "969,30,1-uncached": ("969,30,1", [2000, 200, 20], 1234, 64, FixedTokenizer, False),
    "98,2,0-cached": ("98,2,0", [300000, 3000, 30], 7, 256, MockTokenizer, True),
}


@pytest.mark.parametrize("case", MOCK_CASES)
def test_mock_data_splits(tmp_path, data_tool, case):
    """--mock-data: megatron-core's MockGPTDataset splits (its config sets mock when there is no blend, and then its
    split to 1,1,1 whatever split it was given) against Trestle's: the split sizes, the first 1,000 samples of the
    training and validation splits and, when cached, the cache files (MockGPTDataset's names and description);
    uncached, neither side writes anything."""
    split, samples, seed, seq_length, tokenizer, cached = MOCK_CASES[case]
    cache = tmp_path / "m" if cached else None
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, split=split, tokenizer=tokenizer(),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              path_to_cache=None if cache is None else str(cache))
    assert config.mock and config.split == "1,1,1"
    theirs = BlendedMegatronDatasetBuilder(MockGPTDataset, samples, lambda: True, config).build()
    assert all(type(d).__name__ == "MockGPTDataset" for d in theirs)
    identity = json.dumps(tokenizer().unique_identifiers)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for name, dataset in zip(("train", "valid"), theirs[:2], strict=True):
        result = subprocess.run([data_tool, "splits", "--mock-data", "--vocab-size", str(tokenizer().vocab_size),
                                 "--eod", str(tokenizer().eod), "--split", split,
                                 "--samples", ",".join(map(str, samples)), "--seq-length", str(seq_length),
                                 "--seed", str(seed), "--cache", str(tmp_path / "t") if cached else "",
                                 "--tokenizer", identity, "--dump", "1000", "--dump-split", name,
                                 "--out", tmp_path / f"{name}.npy"], capture_output=True, text=True, cwd=cwd)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"train": len(theirs[0]), "valid": len(theirs[1]), "test": len(theirs[2])}
        ours = numpy.load(tmp_path / f"{name}.npy")
        assert ours.shape == (min(1000, len(dataset)), seq_length + 1)
        for i in range(ours.shape[0]):
            numpy.testing.assert_array_equal(ours[i], raw_sample(dataset, i), err_msg=f"{name} sample {i}")
    assert not any(cwd.iterdir())
    if cached:
        compare_caches(tmp_path / "t", cache, cls="MockGPTDataset")
        description = json.loads(next(cache.glob("*-MockGPTDataset-train-description.txt")).read_text())
        assert description["class"] == "MockGPTDataset" and description["dataset_path"] is None
    else:
        assert not (tmp_path / "t").exists()

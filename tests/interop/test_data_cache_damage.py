"""`trestle train` against a damaged, stale or hostile GPT dataset index cache (Megatron-Core's
PREFIX/cache/GPTDataset_indices/<md5>-GPTDataset-<split>-*): each is refused with exit 1 naming the cache file, where
it once hung (a FIFO), wrote outside the cache through a symbolic link, or trained on indices that did not match the
dataset. The cache files are damaged with numpy, as megatron-core reads and writes them."""
import os
import shutil
import signal
import subprocess

import numpy as np
import pytest

from test_train_faults import CORPUS, tiny_training_setup

CACHE = "kjv_text_document/cache/GPTDataset_indices"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trestle):
    return tiny_training_setup(tmp_path_factory.mktemp("cache_damage"), trestle, seed=9)


def train(trestle_bin, setup, data, timeout=240):
    args = [trestle_bin, "train", "--nproc-per-node", "1", "--device", "cpu", "--load", setup / "start",
            "--data-path", data / "kjv_text_document", "--split", "98,2,0", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--seq-length", "16", "--train-iters", "1", "--lr", "1e-3",
            "--eval-iters", "0", "--log-interval", "1"]
    # In a session of its own, so that a run that hangs is killed with its worker rather than leaving it waiting.
    with subprocess.Popen(list(map(str, args)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def cache_file(data, affix):
    suffix = "description.txt" if affix == "description" else f"{affix}.npy"
    (path,) = (data / CACHE).glob(f"*-GPTDataset-train-{suffix}")
    return path


@pytest.fixture
def data(setup, trestle_bin, tmp_path):
    """A copy of the preprocessed data with the train split's cache built by one short run, for one test to damage
    (the cache is named after the description, which holds the dataset's path: each copy builds its own)."""
    data = shutil.copytree(setup / "data", tmp_path / "data", ignore=shutil.ignore_patterns("cache"))
    result = train(trestle_bin, setup, data)
    assert result.returncode == 0, result.stderr[-3000:]
    assert cache_file(data, "sample_index").is_file()
    return data


def assert_refused(result, path, *words):
    assert result.returncode == 1, f"exit {result.returncode}\n{result.stderr[-3000:]}"
    for text in (str(path), *words):
        assert text in result.stderr, f"expected {text!r} in:\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("affix", ["sample_index", "description"])
def test_a_fifo_for_a_cache_file_is_refused_not_waited_on(setup, trestle_bin, data, affix):
    path = cache_file(data, affix)
    path.unlink()
    subprocess.run(["mkfifo", path], check=True)
    try:
        result = train(trestle_bin, setup, data, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"train waited on the FIFO {path}")
    assert_refused(result, path, "not a regular file (a FIFO)")


def test_a_symlink_for_a_cache_file_is_refused_and_nothing_outside_is_written(setup, trestle_bin, data, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    path = cache_file(data, "sample_index")
    path.unlink()
    path.symlink_to(outside / "victim.npy")  # dangling, pointing outside the cache directory
    result = train(trestle_bin, setup, data)
    assert_refused(result, path, "a symbolic link where a cache file should be")
    assert list(outside.iterdir()) == []


def test_a_stale_cache_after_the_dataset_is_preprocessed_again_is_refused(setup, trestle, trestle_bin, data):
    """The same prefix preprocessed again with the bytes tokenizer: the cache's description (path, split, seed,
    sequence length, the model's tokenizer) is unchanged, its indices cut the old documents' lengths."""
    trestle.run("preprocess", "--input", CORPUS / "kjv.jsonl", "--output-prefix", data / "kjv", "--tokenizer-type",
                "bytes", "--append-eod", "--quiet")
    result = train(trestle_bin, setup, data)
    assert_refused(result, cache_file(data, "sample_index"), "the cached indices do not match the dataset: delete",
                   str(data / CACHE))


@pytest.mark.parametrize("kind, damage, words", [
    ("sample_index", lambda a: np.zeros_like(a), "sample 0 (entries 0 to 1) spans 0 tokens"),
    ("sample_index", "empty_first_trained_sample", "spans 0 tokens of the document index, expected the sequence "
                                                   "length 16"),
    ("shuffle_index", lambda a: np.zeros_like(a), "entry 1 is sample 0 again: expected a permutation"),
    ("document_index", lambda a: np.zeros_like(a), "is sequence 0 again: expected each of the split's documents"),
], ids=["sample_index_zeros", "zero_length_sample", "shuffle_index_zeros", "document_index_zeros"])
def test_damaged_index_values_are_refused_naming_the_file(setup, trestle_bin, data, kind, damage, words):
    path = cache_file(data, kind)
    a = np.load(path)
    if damage == "empty_first_trained_sample":
        s = int(np.load(cache_file(data, "shuffle_index"))[0])
        a = a.copy()
        a[s + 1] = a[s]
    else:
        a = damage(a)
    np.save(path, a)
    assert_refused(train(trestle_bin, setup, data), path, words, "the cached indices do not match the dataset")


# The blend's cache (--data-cache-path DIR: <md5>-BlendedDataset-<split>-*), over the dataset and a copy of it. It was
# written through links, waited on a FIFO and loaded unchecked (a zeroed sample index trained every blended sample on
# sample 0 of its dataset).
def train_blend(trestle_bin, setup, data, timeout=240):
    args = [trestle_bin, "train", "--nproc-per-node", "1", "--device", "cpu", "--load", setup / "start",
            "--data-path", "0.3", data / "kjv_text_document", "0.7", data / "copy_text_document",
            "--data-cache-path", data / "blend_cache", "--split", "98,2,0", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--seq-length", "16", "--train-iters", "1", "--lr", "1e-3",
            "--eval-iters", "0", "--log-interval", "1"]
    return subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=timeout)


def blend_file(data, affix):
    suffix = "description.txt" if affix == "description" else f"{affix}.npy"
    (path,) = (data / "blend_cache").glob(f"*-BlendedDataset-train-{suffix}")
    return path


def damage_blend(path, damage, outside):
    if damage == "fifo":
        path.unlink()
        subprocess.run(["mkfifo", path], check=True)
    elif damage == "symlink":
        path.unlink()
        path.symlink_to(outside / "victim.txt")  # dangling, pointing outside the cache directory
    elif damage == "garbage":
        path.write_text("garbage\n")
    elif damage == "zeros":
        np.save(path, np.zeros_like(np.load(path)))
    elif damage == "short":
        np.save(path, np.load(path)[:1])


@pytest.mark.parametrize("affix, damage, words", [
    ("description", "fifo", "not a regular file (a FIFO)"),
    ("description", "symlink", "a symbolic link where a cache file should be"),
    ("description", "garbage", "not this blend's description (line 1 is 'garbage'"),
    ("dataset_sample_index", "zeros", "expected 1 (each dataset's in order)"),
    ("dataset_index", "short", "expected a 1-D array of the blend's"),
])
def test_a_damaged_blend_cache_is_refused_naming_the_file(setup, trestle_bin, tmp_path, affix, damage, words):
    data = shutil.copytree(setup / "data", tmp_path / "data", ignore=shutil.ignore_patterns("cache"))
    for ext in ("bin", "idx"):
        shutil.copy(data / f"kjv_text_document.{ext}", data / f"copy_text_document.{ext}")
    built = train_blend(trestle_bin, setup, data)
    assert built.returncode == 0, built.stderr[-3000:]
    path = blend_file(data, affix)
    outside = tmp_path / "outside"
    outside.mkdir()
    damage_blend(path, damage, outside)
    try:
        result = train_blend(trestle_bin, setup, data, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"train waited on {path}")
    assert_refused(result, path, words)
    assert not (outside / "victim.txt").exists(), "the cache was written through the link"

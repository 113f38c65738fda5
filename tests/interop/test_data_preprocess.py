"""`trestle preprocess` against the `tokenizers` package and megatron-core's IndexedDatasetBuilder on the shipped
corpus, and `trestle inspect` on the result."""
import json
import pathlib

import numpy
import pytest
from tokenizers import Tokenizer

from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

CORPUS = pathlib.Path(__file__).resolve().parents[2] / "train" / "data" / "corpus"


def megatron_build(prefix, documents, vocab_size):
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(vocab_size))
    for ids in documents:
        builder.add_document(numpy.array(ids, dtype=numpy.int64), [len(ids)])
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_matches_tokenizers_and_megatron_builder(tmp_path, trestle_bin, workers):
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    out = trestle.run("preprocess", "--input", CORPUS / "kjv.jsonl", "--output-prefix", tmp_path / "kjv",
                      "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", CORPUS / "tokenizer.json",
                      "--append-eod", "--workers", workers, "--quiet")
    assert "491 documents" in out
    tokenizer = Tokenizer.from_file(str(CORPUS / "tokenizer.json"))
    eod = tokenizer.token_to_id("<|endoftext|>")
    texts = [json.loads(line)["text"] for line in open(CORPUS / "kjv.jsonl", encoding="utf-8")]
    expected = [tokenizer.encode(t).ids + [eod] for t in texts]
    ours = IndexedDataset(str(tmp_path / "kjv_text_document"))
    assert len(ours) == len(expected)
    for i, ids in enumerate(expected):
        assert ours[i].tolist() == ids, f"document {i}"
    megatron_build(tmp_path / "ref", expected, tokenizer.get_vocab_size(with_added_tokens=True))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"kjv_text_document{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()

    info = json.loads(trestle.run("inspect", tmp_path / "kjv_text_document.idx", "--json"))
    assert info["dtype"] == "uint16" and info["documents"] == 491 and info["sequences"] == 491
    assert info["tokens"] == sum(map(len, expected))
    table = trestle.run("inspect", tmp_path / "kjv_text_document")
    assert "uint16" in table and "491" in table


def test_preprocess_bytes_and_keys(tmp_path, trestle_bin):
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    docs = [{"text": "héllo", "title": ["a", "", "bc"]}, {"text": "", "title": "t"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    trestle.run("preprocess", "--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "o",
                "--json-keys", "text,title", "--tokenizer-type", "bytes", "--append-eod", "--quiet")
    text = IndexedDataset(str(tmp_path / "o_text_document"))
    assert [text[i].tolist() for i in range(len(text))] == [list("héllo".encode()) + [256]]
    assert text.document_indices.tolist() == [0, 1, 1]  # the empty text stays an empty document
    title = IndexedDataset(str(tmp_path / "o_title_document"))
    assert title.sequence_lengths.tolist() == [1, 3, 2]  # one sequence per non-empty string, EOD on the last
    assert title.document_indices.tolist() == [0, 2, 3]


def test_preprocess_errors_name_the_input(tmp_path, trestle_bin):
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": 5}\n', encoding="utf-8")
    result = trestle.run_raw("preprocess", "--input", tmp_path / "bad.jsonl", "--output-prefix", tmp_path / "o",
                             "--tokenizer-type", "bytes")
    assert result.returncode == 1
    assert "bad.jsonl:2" in result.stderr and "'text'" in result.stderr
    # Blank lines count: the bad document is on line 4.
    (tmp_path / "blank.jsonl").write_text('{"text": "ok"}\n\n  \n{"text": 5}\n', encoding="utf-8")
    result = trestle.run_raw("preprocess", "--input", tmp_path / "blank.jsonl", "--output-prefix", tmp_path / "o",
                             "--tokenizer-type", "bytes")
    assert result.returncode == 1
    assert "blank.jsonl:4:" in result.stderr, result.stderr

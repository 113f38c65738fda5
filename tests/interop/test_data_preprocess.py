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


def hostile_texts(count, seed):
    """Texts of random code points from the whole Unicode range mixed with contractions, runs of spaces of every
    kind, digits of several scripts and added-token look-alikes."""
    import random
    rng = random.Random(seed)
    pieces = ["the", " Lord", "'s", "'re", "'ll", "'D", " ", "   ", "\t", "\n\n", "\r\n", "\u00a0", "\u3000", "\u2028",
              "\u0085", "\x1c", "42", " 7", "\u00b2", "\u0660", "!!", "...", "\u200b", "\ufeff", "<|endoftext|>",
              "<|endof", "<s>", "caf\u00e9", "\u4e2d\u6587", "\U0001F600", "e\u0301", "lll", "ooo"]
    def code_point():
        while True:
            c = rng.randrange(0x110000)
            if not 0xD800 <= c <= 0xDFFF:
                return chr(c)
    return ["".join(rng.choice(pieces) if rng.random() < 0.7 else code_point() for _ in range(rng.randrange(40)))
            for _ in range(count)]


def trained_tokenizer(kind, texts):
    """A byte-level BPE trained here by the tokenizers package, in the shape of a family that ships one."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=kind == "roberta")
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1200, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if kind == "roberta":  # <s> text </s>
        tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                          ("<s>", tok.token_to_id("<s>")))
    elif kind == "bos_template":  # a BOS token and added words, as Llama-style exports carry
        tok.add_tokens(["Lord", "<|begin|>"])
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


@pytest.mark.parametrize("kind", ["gpt2", "roberta", "bos_template"])
def test_preprocess_gives_the_packages_ids_on_hostile_texts(tmp_path, trestle_bin, kind):
    """Tokenizers the package trained, texts of random code points from the whole Unicode range, two workers: every
    document is the package's own encode_batch ids plus the EOD; a text without ids makes no document, as in
    Megatron's preprocess_data.py (a template's BOS counts: an empty text is then a document)."""
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    corpus = [json.loads(line)["text"] for line in open(CORPUS / "kjv.jsonl", encoding="utf-8")][:200]
    tok = trained_tokenizer(kind, corpus + hostile_texts(300, 1))
    tok.save(str(tmp_path / "tokenizer.json"))
    texts = hostile_texts(2000, 2) + corpus[:50]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    trestle.run("preprocess", "--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "o",
                "--tokenizer-model", tmp_path, "--append-eod", "--workers", 2, "--quiet")
    eod = tok.token_to_id("<|endoftext|>")
    expected = [e.ids + [eod] for e in tok.encode_batch(texts) if e.ids]
    ours = IndexedDataset(str(tmp_path / "o_text_document"))
    assert len(ours) == len(expected)
    for i, ids in enumerate(expected):
        assert ours[i].tolist() == ids, f"document {i}"

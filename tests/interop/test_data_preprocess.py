"""`trestle preprocess` against the `tokenizers` package and megatron-core's IndexedDatasetBuilder on the shipped
corpus, and `trestle inspect` on the result."""
import json
import os
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
    # preprocess_data.py's spelling (nargs '+'): the keys as words, and a flag given again replaces the earlier one.
    trestle.run("preprocess", "--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "w", "--json-keys",
                "missing", "--json-keys", "text", "title", "--tokenizer-type", "bytes", "--append-eod", "--quiet")
    for key in ("text", "title"):
        for suffix in (".bin", ".idx"):
            written = (tmp_path / f"w_{key}_document{suffix}").read_bytes()
            assert written == (tmp_path / f"o_{key}_document{suffix}").read_bytes(), (key, suffix)
    assert not list(tmp_path.glob("w_missing*"))


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


def test_a_failed_preprocess_leaves_the_outputs_as_they_were(tmp_path, trestle_bin):
    """A run that fails (a bad line 3) used to truncate the existing .bin to 0 bytes and leave its old .idx; a first
    run left an empty .bin. Outputs are written as temporaries and renamed into place at the end."""
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"text": "hello"}\n{"text": "world"}\n', encoding="utf-8")
    bad.write_text('{"text": "a"}\n{"text": "b"}\nBROKEN\n', encoding="utf-8")
    prefix = tmp_path / "ds"
    trestle.run("preprocess", "--input", good, "--output-prefix", prefix, "--tokenizer-type", "bytes", "--quiet")
    before = {p.name: p.read_bytes() for p in tmp_path.glob("ds_*")}
    assert sorted(before) == ["ds_text_document.bin", "ds_text_document.idx"]
    result = trestle.run_raw("preprocess", "--input", bad, "--output-prefix", prefix, "--tokenizer-type", "bytes")
    assert result.returncode == 1 and "bad.jsonl:3: not JSON" in result.stderr, result.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.glob("ds_*")} == before
    result = trestle.run_raw("preprocess", "--input", bad, "--output-prefix", tmp_path / "fresh", "--tokenizer-type",
                             "bytes")
    assert result.returncode == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "ds_text_document.bin", "ds_text_document.idx",
                                                          "good.jsonl"]


def test_a_second_preprocess_under_the_same_prefix_is_refused(tmp_path, trestle_bin):
    """Two runs writing one --output-prefix both reported success, the later one's pair replacing the other's: a run
    holds <dir>/.<prefix>.lock while it writes, and another is refused naming it, writing nothing."""
    import fcntl
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "hello"}\n', encoding="utf-8")
    with open(tmp_path / ".ds.lock", "w") as held:  # (another run writing ds_*)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = trestle.run_raw("preprocess", "--input", source, "--output-prefix", tmp_path / "ds",
                                 "--tokenizer-type", "bytes")
        assert result.returncode == 1 and f"{tmp_path / 'ds'}: another job is writing it (it holds " \
            f"{tmp_path / '.ds.lock'})" in result.stderr, result.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == [".ds.lock", "in.jsonl"]
    trestle.run("preprocess", "--input", source, "--output-prefix", tmp_path / "ds", "--tokenizer-type", "bytes",
                "--quiet")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds_text_document.bin", "ds_text_document.idx", "in.jsonl"]


def test_preprocess_refuses_outputs_it_would_destroy_or_write_through(tmp_path, trestle_bin):
    """The input as its own output (mapped for reading, then truncated for writing: SIGBUS), an output FIFO (waited on
    forever) and an output link (written through, to a file outside) are each refused before anything is written."""
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    source = tmp_path / "in.jsonl"
    source.write_text('{"text": "hello"}\n', encoding="utf-8")
    trestle.run("preprocess", "--input", source, "--output-prefix", tmp_path / "same", "--tokenizer-type", "bytes",
                "--quiet")
    same = tmp_path / "same_text_document.bin"
    kept = same.read_bytes()
    result = trestle.run_raw("preprocess", "--input", same, "--output-prefix", tmp_path / "same", "--tokenizer-type",
                             "bytes")
    assert result.returncode == 1 and "the input is also an output" in result.stderr, result.stderr
    assert same.read_bytes() == kept
    os.mkfifo(tmp_path / "fifo_text_document.bin")
    result = trestle.run_raw("preprocess", "--input", source, "--output-prefix", tmp_path / "fifo", "--tokenizer-type",
                             "bytes", timeout=60)
    assert result.returncode == 1 and "fifo_text_document.bin: not a regular file (a FIFO)" in result.stderr
    outside = tmp_path / "victim.txt"
    outside.write_text("precious")
    os.symlink(outside, tmp_path / "link_text_document.bin")
    result = trestle.run_raw("preprocess", "--input", source, "--output-prefix", tmp_path / "link", "--tokenizer-type",
                             "bytes")
    assert result.returncode == 1 and "link_text_document.bin: a symbolic link" in result.stderr, result.stderr
    assert outside.read_text() == "precious"


@pytest.mark.parametrize("line, says", [
    (b'{"text":"abc"}\x00{"text":"zzz"}', "a NUL byte at column 15"),
    (b'{"text": "a\xff"}', "invalid string: ill-formed UTF-8 byte"),
    (b'{"text": 1e99999}', "'text' holds a number beyond a double's range (1e99999)"),
    (b'{"text": NaN}', "'text' holds NaN"),
    (b'{"text": ["a", "\\udfff"]}', "'text' holds a lone UTF-16 surrogate escape (\\udfff)"),
    (b'{"text": "a", "x": NaN, }', "not JSON: parse error at line 1, column 25: syntax error while parsing object key"),
    (b'[1, 2]', "not a JSON object (a array)"),
])
def test_preprocess_says_what_is_wrong_with_a_line(tmp_path, trestle_bin, line, says):
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "ok"}\n' + line + b"\n")
    result = trestle.run_raw("preprocess", "--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "o",
                             "--tokenizer-type", "bytes")
    assert result.returncode == 1 and "in.jsonl:2: " in result.stderr and says in result.stderr, result.stderr
    assert not list(tmp_path.glob("o_*"))


def test_preprocess_keys_and_extensions(tmp_path, trestle_bin):
    """A key given twice wrote one output twice and counted its tokens twice (now a usage error, exit 2, before the
    input is read); an upper-case .JSONL was read as plain text (its braces and quotes tokenized)."""
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    (tmp_path / "UP.JSONL").write_text('{"text": "a"}\n', encoding="utf-8")
    result = trestle.run_raw("preprocess", "--input", tmp_path / "UP.JSONL", "--output-prefix", tmp_path / "k",
                             "--json-keys", "text,text", "--tokenizer-type", "bytes")
    assert result.returncode == 2 and "--json-keys: 'text' given twice" in result.stderr, result.stderr
    out = trestle.run("preprocess", "--input", tmp_path / "UP.JSONL", "--output-prefix", tmp_path / "up",
                      "--tokenizer-type", "bytes")
    assert "1 documents, 1 tokens" in out, out


def test_inspect_reads_a_dataset_beside_its_index_cache(tmp_path, trestle_bin):
    """Training writes its index cache under PREFIX/cache/: `inspect PREFIX` then took the directory for a model
    directory and failed. A FIFO at PREFIX.idx is named as such (it was 'no such file')."""
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    (tmp_path / "in.jsonl").write_text('{"text": "hello"}\n', encoding="utf-8")
    prefix = tmp_path / "ds_text_document"
    trestle.run("preprocess", "--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "ds",
                "--tokenizer-type", "bytes", "--quiet")
    (prefix / "cache" / "GPTDataset_indices").mkdir(parents=True)
    assert "Megatron indexed dataset" in trestle.run("inspect", prefix)
    os.mkfifo(tmp_path / "f.idx")
    result = trestle.run_raw("inspect", tmp_path / "f", timeout=60)
    assert result.returncode == 1 and "f.idx: not a regular file (a FIFO)" in result.stderr, result.stderr


def bytes_documents(path, key="text"):
    """What Megatron's preprocess_data.py gives for a bytes tokenizer: the file read as Python reads text (universal
    newlines), each line through json.loads."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                ids = list(json.loads(line)[key].encode())
                docs.append(ids + [256] if ids else [])
    return docs


def test_preprocess_reads_lines_as_pythons_json_does(tmp_path, trestle_bin):
    """Python's json.loads, which Megatron's script reads each line with, takes NaN, Infinity, numbers beyond a
    double's range and lone surrogate escapes: such values in keys that are not tokenized were refused. Lines end at
    \\n, \\r\\n or \\r, as Python reads text files; a repeated key's last value counts."""
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    lines = ['{"text": "one", "score": NaN, "n": 1e400, "url": "\\udfff", "big": 123456789012345678901234567890}',
             '{"text": 1e999, "text": "two \\ud83d\\ude00", "m": [Infinity, -Infinity, {"text": NaN}], "\\udc00": 1}',
             '{"text": "three"}']
    (tmp_path / "in.jsonl").write_bytes(("\r".join(lines[:2]) + "\r\n" + lines[2] + "\n").encode())
    out = trestle.run("preprocess", "--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "o",
                      "--tokenizer-type", "bytes", "--append-eod", "--quiet")
    assert "3 documents" in out, out
    ours = IndexedDataset(str(tmp_path / "o_text_document"))
    assert [ours[i].tolist() for i in range(len(ours))] == bytes_documents(tmp_path / "in.jsonl")


@pytest.mark.parametrize("name", ["corpus.ndjson", "corpus.txt", "corpus"])
def test_json_lines_are_recognised_by_content(tmp_path, trestle_bin, name):
    """JSON lines under a name without .json were tokenized as plain text (braces, quotes and all); Megatron's
    script ignores the name. --input-format overrides the guess either way."""
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    source = tmp_path / name
    source.write_bytes(b'\n{"text": "one"}\r\n{"text": "two three"}\r\n{"text": ""}\r\n')
    out = trestle.run("preprocess", "--input", source, "--output-prefix", tmp_path / "j", "--tokenizer-type", "bytes",
                      "--append-eod", "--quiet")
    assert "as JSON lines" in out and "3 documents" in out, out
    ours = IndexedDataset(str(tmp_path / "j_text_document"))
    assert [ours[i].tolist() for i in range(len(ours))] == [d for d in bytes_documents(source) if d]
    assert ours.document_indices.tolist() == [0, 1, 2, 2]  # the empty text an empty document, as Megatron's
    out = trestle.run("preprocess", "--input", source, "--input-format", "text", "--output-prefix", tmp_path / "t",
                      "--tokenizer-type", "bytes", "--quiet")
    assert "as plain text" in out and "1 documents" in out, out


def test_plain_text_paragraphs_end_at_blank_lines_of_any_line_ending(tmp_path, trestle_bin):
    """Paragraphs of a CRLF file were one document ("\\n\\n" never occurs in it); a line of spaces separates too."""
    from conftest import Trestle
    trestle = Trestle(trestle_bin)
    (tmp_path / "t.txt").write_bytes(b"\r\n  first line\r\nsecond\r\n\r\nthird\r \t \rfourth\n\n\n")
    out = trestle.run("preprocess", "--input", tmp_path / "t.txt", "--output-prefix", tmp_path / "p",
                      "--tokenizer-type", "bytes", "--quiet")
    assert "as plain text" in out and "3 documents" in out, out
    ours = IndexedDataset(str(tmp_path / "p_text_document"))
    assert [bytes(ours[i].tolist()) for i in range(len(ours))] == [b"  first line\r\nsecond", b"third", b"fourth"]
    result = trestle.run_raw("preprocess", "--input", tmp_path / "t.txt", "--input-format", "jsonl",
                             "--output-prefix", tmp_path / "q", "--tokenizer-type", "bytes")
    assert result.returncode == 1 and "t.txt:2: not JSON" in result.stderr, result.stderr


def test_the_end_of_document_is_the_eos_token_transformers_gives(tmp_path, trestle_bin):
    """Megatron's preprocess_data.py appends AutoTokenizer's eos_token_id, where special_tokens_map.json's eos_token
    overrides tokenizer_config.json's. preprocess read tokenizer_config.json alone and fell back to <|endoftext|>
    silently (a map naming </s>: every document ended in the wrong token), and an eos_token outside the vocabulary
    (which transformers would add past it) fell back the same way: now the package's id, or a refusal."""
    import shutil
    import transformers
    tokenizer = Tokenizer.from_file(str(CORPUS / "tokenizer.json"))
    other = tokenizer.id_to_token(17)  # any token of the vocabulary other than <|endoftext|> (id 0)
    assert other and other != "<|endoftext|>"
    (tmp_path / "in.jsonl").write_text('{"text": "In the beginning"}\n')
    cases = {"map_over_config": ({"eos_token": "<|endoftext|>"}, {"eos_token": {"content": other}}),
             "map_only": ({}, {"eos_token": other}),
             "config_only": ({"eos_token": other}, None)}
    for name, (config, special_map) in cases.items():
        d = tmp_path / name
        d.mkdir()
        shutil.copy(CORPUS / "tokenizer.json", d / "tokenizer.json")
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        if special_map is not None:
            (d / "special_tokens_map.json").write_text(json.dumps(special_map))
        expected = transformers.AutoTokenizer.from_pretrained(str(d)).eos_token_id
        assert expected == tokenizer.token_to_id(other), name
        from conftest import Trestle
        Trestle(trestle_bin).run("preprocess", "--input", tmp_path / "in.jsonl", "--output-prefix", d / "o",
                                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", d, "--append-eod",
                                 "--quiet")
        # (the corpus tokenizer's ids are uint16: test_preprocess_matches_tokenizers_and_megatron_builder)
        assert numpy.fromfile(d / "o_text_document.bin", dtype=numpy.uint16).tolist()[-1] == expected, name
    d = tmp_path / "not_in_vocab"
    d.mkdir()
    shutil.copy(CORPUS / "tokenizer.json", d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|not-a-token|>"}))
    import subprocess
    refused = subprocess.run([str(trestle_bin), "preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                              str(d / "o"), "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(d),
                              "--append-eod"], capture_output=True, text=True)
    assert refused.returncode == 1 and "'<|not-a-token|>'" in refused.stderr and "tokenizer_config.json" in \
        refused.stderr and "not in the tokenizer's vocabulary" in refused.stderr, refused.stderr
    assert not (d / "o_text_document.bin").exists()

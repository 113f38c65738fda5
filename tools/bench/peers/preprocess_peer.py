"""The Python side of `bench preprocess`: Megatron's tools/preprocess_data.py pipeline on the same input, with the
`tokenizers` package and megatron-core's IndexedDatasetBuilder: a multiprocessing pool of `workers` processes
parses and tokenizes each JSON line (text -> ids + EOD), the main process writes the documents in order.
Prints one JSON line: {"seconds": ..., "documents": ..., "tokens": ...} (seconds from the pool's start to the
finalized .idx; interpreter start-up and imports excluded)."""
import argparse
import json
import multiprocessing
import time

import numpy
from tokenizers import Tokenizer

from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

_tokenizer = None
_eod = None


def _init(path, eod_token):
    global _tokenizer, _eod
    _tokenizer = Tokenizer.from_file(path)
    _eod = _tokenizer.token_to_id(eod_token)


def _encode(line):
    ids = _tokenizer.encode(json.loads(line)["text"]).ids
    if ids:
        ids.append(_eod)
    return ids


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--input", required=True)
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer-model", required=True)
    parser.add_argument("--eod-token", default="<|endoftext|>")
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()

    vocab = Tokenizer.from_file(args.tokenizer_model).get_vocab_size(with_added_tokens=True)
    start = time.perf_counter()
    builder = IndexedDatasetBuilder(f"{args.output_prefix}.bin", dtype=DType.optimal_dtype(vocab))
    documents = tokens = 0
    with open(args.input, encoding="utf-8") as lines, multiprocessing.Pool(
            args.workers, initializer=_init, initargs=(args.tokenizer_model, args.eod_token)) as pool:
        for ids in pool.imap(_encode, (l for l in lines if l.strip()), chunksize=32):
            builder.add_document(numpy.array(ids, dtype=numpy.int64), [len(ids)])
            documents += 1
            tokens += len(ids)
    builder.finalize(f"{args.output_prefix}.idx")
    print(json.dumps({"seconds": time.perf_counter() - start, "documents": documents, "tokens": tokens}))


if __name__ == "__main__":
    main()

"""Regenerates the shipped demo corpus (kjv.jsonl) and its tokenizer (tokenizer.json, tokenizer_config.json).

Source: the King James Version text of Debian's bible-kjv-text package (read with its `bible` program, package
bible-kjv); the package's copyright file notes the text's copyright has expired (translated 1611). One JSON line per
chapter of Genesis, Psalms, Proverbs and the New Testament: {"text": "<Book> <chapter>\n\n<verses>"}.
The tokenizer is a byte-level BPE (4096 ids, <|endoftext|> as EOD) trained on that text with the `tokenizers`
package. Run: apt-get install bible-kjv && <venv>/bin/python make_corpus.py
"""
import json
import pathlib
import re
import subprocess

BOOKS = {"Gen": 50, "Ps": 150, "Prov": 31, "Mt": 28, "Mk": 16, "Lk": 24, "Jn": 21, "Acts": 28, "Rom": 16,
         "1Cor": 16, "2Cor": 13, "Gal": 6, "Eph": 6, "Phil": 4, "Col": 4, "1Thes": 5, "2Thes": 3, "1Tim": 6,
         "2Tim": 4, "Titus": 3, "Philem": 1, "Heb": 13, "Jas": 5, "1Pet": 5, "2Pet": 3, "1Jn": 5, "2Jn": 1,
         "3Jn": 1, "Jude": 1, "Rev": 22}
HERE = pathlib.Path(__file__).resolve().parent


def chapter(book, number):
    out = subprocess.run(["bible", "-l10000", f"{book}{number}:1-999"], check=True, capture_output=True, text=True).stdout
    lines = [l.strip() for l in out.strip().splitlines() if l.strip()]
    title, verses = lines[0], [re.sub(r"^\d+\s+", "", l) for l in lines[1:]]
    return title + "\n\n" + "\n".join(verses)


def main():
    with open(HERE / "kjv.jsonl", "w", encoding="utf-8") as out:
        for book, chapters in BOOKS.items():
            for n in range(1, chapters + 1):
                out.write(json.dumps({"text": chapter(book, n)}) + "\n")

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [json.loads(l)["text"] for l in open(HERE / "kjv.jsonl", encoding="utf-8")]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(HERE / "tokenizer.json"))
    (HERE / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}, indent=2) + "\n")


if __name__ == "__main__":
    main()

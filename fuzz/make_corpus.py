"""Regenerates the seed corpora of the data-pipeline and model-description fuzz targets from real files made by the
reference packages: megatron_idx (.idx/.bin pairs from megatron-core's IndexedDatasetBuilder and `trestle preprocess`,
packed as the target reads them), safetensors_index (save_pretrained's model.safetensors.index.json of tiny
transformers models), trestle_model (the trestle_model.json `trestle convert --to megatron-dist` keeps), preprocess_jsonl
(JSON lines from the demo corpus) and hf_tokenizer (small tokenizers trained with the `tokenizers` package; the demo
corpus's own is over the fuzzers' 64 KiB input limit; two with a tokenizer_config.json after a NUL) and peft_config
(adapter_config.json files peft saves: target lists, expressions and all-linear, fused expert parameters, the
rank_pattern peft writes for DeepSeek-V3's experts).
Regression inputs are kept by hand.
Run: <venv>/bin/python fuzz/make_corpus.py TRESTLE_BIN OUT_DIR, then copy OUT_DIR/<target>/* to fuzz/corpus/<target>/.
"""
import json
import pathlib
import shutil
import struct
import subprocess
import sys

import numpy as np
import torch

OUT = pathlib.Path(sys.argv[2])
shutil.rmtree(OUT, ignore_errors=True)
for t in ["megatron_idx", "safetensors_index", "trestle_model", "preprocess_jsonl", "hf_tokenizer", "peft_config",
          "work"]:
    (OUT / t).mkdir(parents=True)
W = OUT / "work"
CORPUS = pathlib.Path(__file__).resolve().parents[1] / "train" / "data" / "corpus"
texts = [json.loads(l)["text"] for l in open(CORPUS / "kjv.jsonl", encoding="utf-8")]

def pack(prefix, name):
    idx = pathlib.Path(str(prefix) + ".idx").read_bytes()
    bin_ = pathlib.Path(str(prefix) + ".bin").read_bytes()
    data = struct.pack("<I", len(idx)) + idx + bin_
    assert len(data) < 65536, (name, len(data))
    (OUT / "megatron_idx" / name).write_bytes(data)

# (a) megatron-core's IndexedDatasetBuilder: several dtypes, several sequences per document, multimodal modes.
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
def build(name, dtype, docs, multimodal=False):
    prefix = W / name
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype, multimodal=multimodal)
    for doc in docs:
        lengths = [len(s) for s in doc]
        flat = [t for s in doc for t in s]
        if multimodal:
            b.add_document(torch.tensor(flat), lengths, modes=[i % 2 for i in range(len(lengths))])
        else:
            b.add_document(torch.tensor(flat), lengths)
    b.finalize(str(prefix) + ".idx")
    pack(prefix, name)
rng = np.random.default_rng(0)
def docs(n, vocab, seqs=1):
    return [[list(rng.integers(0, vocab, rng.integers(1, 40))) for _ in range(seqs)] for _ in range(n)]
build("mcore_uint16", np.uint16, docs(20, 4096))
build("mcore_int32", np.int32, docs(8, 100000, seqs=3))
build("mcore_int64", np.int64, docs(5, 1 << 40))
build("mcore_uint8", np.uint8, docs(6, 256, seqs=2))
build("mcore_float64", np.float64, docs(4, 1000))
build("mcore_float32", np.float32, docs(4, 1000))
build("mcore_multimodal", np.int32, docs(5, 1000, seqs=2), multimodal=True)
build("mcore_empty_document", np.uint16, [[[1, 2, 3]], [[]], [[4]]])

# (d) small real tokenizers trained with the `tokenizers` package on the demo corpus (the shipped one is 267 KB, over
# the fuzzers' 64 KiB input limit), saved as tokenizer.json.
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
sample = texts[:40]
def save(tok, name):
    path = W / name
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    data = (path / "tokenizer.json").read_bytes()
    assert len(data) < 65536, (name, len(data))
    (OUT / "hf_tokenizer" / name).write_bytes(data)
    return path
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
bpe_dir = save(bpe, "byte_level_bpe")
wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
wp.normalizer = normalizers.BertNormalizer(lowercase=True)
wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
wp.train_from_iterator(sample, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]", "</s>"]))
wp.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
save(wp, "wordpiece_bert")
uni = Tokenizer(models.Unigram())
uni.normalizer = normalizers.NFKC()
uni.pre_tokenizer = pre_tokenizers.Metaspace()
uni.decoder = decoders.Metaspace()
uni.train_from_iterator(sample, trainers.UnigramTrainer(vocab_size=150, special_tokens=["<unk>", "</s>"], unk_token="<unk>"))
save(uni, "unigram_metaspace")
wl = Tokenizer(models.WordLevel(unk_token="<unk>"))
wl.pre_tokenizer = pre_tokenizers.Whitespace()
wl.train_from_iterator(sample[:5], trainers.WordLevelTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"]))
save(wl, "wordlevel_whitespace")
# Byte-level BPEs with added tokens normalized and not and a BOS template; with a prefix space and RoBERTa's
# post-processor.
bpe.add_tokens(["Lord", "<|begin|>"])
bpe.add_special_tokens(["<s>"])
bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))])
save(bpe, "byte_level_bpe_template")
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
bpe.post_processor = processors.RobertaProcessing(("<|endoftext|>", 0), ("<s>", bpe.token_to_id("<s>")))
save(bpe, "byte_level_bpe_prefix_roberta")
# The target's second file, after a NUL: tokenizer_config.json as transformers saves it (eos_token a string), and with
# eos_token as the AddedToken object older transformers versions wrote.
from transformers import PreTrainedTokenizerFast
PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"), eos_token="<|endoftext|>").save_pretrained(
    W / "bpe_saved")
tokenizer_config = json.loads((W / "bpe_saved" / "tokenizer_config.json").read_text())
def with_config(name, config):
    (OUT / "hf_tokenizer" / name).write_bytes((bpe_dir / "tokenizer.json").read_bytes() + b"\0" +
                                              json.dumps(config, indent=2).encode())
with_config("byte_level_bpe_with_config", tokenizer_config)
with_config("byte_level_bpe_with_added_token_eos", dict(tokenizer_config, eos_token={
    "__type": "AddedToken", "content": "<|endoftext|>", "lstrip": False, "normalized": False, "rstrip": False,
    "single_word": False}))

# (e) JSON lines as `trestle preprocess` and Megatron's preprocess_data.py read them.
def jsonl(name, rows):
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (OUT / "preprocess_jsonl" / name).write_bytes(data)
    return OUT / "preprocess_jsonl" / name
kjv = jsonl("kjv_head", [{"text": t[:300]} for t in texts[:8]])
jsonl("text_and_title", [{"text": t[:200], "title": t.split("\n")[0]} for t in texts[10:14]])
jsonl("sentence_lists", [{"text": t[:400].split("\n")} for t in texts[20:23]])
(OUT / "preprocess_jsonl" / "unicode_blank_lines").write_bytes(
    ('{"text": "caf\\u00e9 \\ud83d\\ude00 na\u00efve"}\n\n   \n{"text": ""}\r\n{"text": []}\n').encode())

# (a, continued) datasets written by `trestle preprocess` from those lines.
trestle = sys.argv[1]
shutil.copy(kjv, W / "kjv.jsonl")
subprocess.run([trestle, "preprocess", "--input", str(W / "kjv.jsonl"), "--output-prefix", str(W / "bpe"), "--tokenizer-model",
                str(bpe_dir), "--append-eod", "--quiet"], check=True)
pack(W / "bpe_text_document", "trestle_preprocess_bpe")
lists = W / "lists.jsonl"
shutil.copy(OUT / "preprocess_jsonl" / "sentence_lists", lists)
subprocess.run([trestle, "preprocess", "--input", str(lists), "--output-prefix", str(W / "bytes"),
                "--tokenizer-type", "bytes", "--quiet"], check=True)
pack(W / "bytes_text_document", "trestle_preprocess_bytes_sentences")

# (b) model.safetensors.index.json of tiny models saved with save_pretrained in shards.
import transformers
torch.manual_seed(0)
def index_of(name, config):
    model = transformers.AutoModelForCausalLM.from_config(config)
    d = W / ("hf_" + name)
    model.save_pretrained(d, max_shard_size="40KB")
    data = (d / "model.safetensors.index.json").read_bytes()
    (OUT / "safetensors_index" / name).write_bytes(data)
    return d
tiny = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64)
llama = index_of("llama", transformers.LlamaConfig(**tiny))
index_of("mixtral", transformers.MixtralConfig(**tiny, num_local_experts=4, num_experts_per_tok=2))
index_of("qwen2_tied", transformers.Qwen2Config(**tiny, tie_word_embeddings=True))
gemma2 = transformers.Gemma2Config(**tiny, head_dim=8, sliding_window=16)
index_of("gemma2", gemma2)

# (c) trestle_model.json as `trestle convert --to megatron-dist` keeps it.
def kept(name, src, *flags):
    dst = W / ("mdist_" + name)
    subprocess.run([trestle, "convert", "--from", "hf", str(src), "--to", "megatron-dist", str(dst), *flags],
                   check=True, capture_output=True)
    found = list(dst.rglob("trestle_model.json"))
    assert found, name
    (OUT / "trestle_model" / name).write_bytes(found[0].read_bytes())
kept("llama_tp2", llama, "--tp", "2")
for name, config in [("mixtral_ep2", transformers.MixtralConfig(**tiny, num_local_experts=4, num_experts_per_tok=2)),
                     ("qwen3_moe", transformers.Qwen3MoeConfig(**tiny, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
                     ("gemma2", gemma2),
                     ("llama3_rope", transformers.LlamaConfig(**tiny, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}))]:
    d = W / ("src_" + name)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(d)
    kept(name, d, *(["--ep", "2"] if "ep2" in name else []))
# (d) adapter_config.json as peft saves it.
import peft
def peft_config(name, model, **lora):
    d = W / ("peft_" + name)
    peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **lora)).save_pretrained(d)
    (OUT / "peft_config" / name).write_bytes((d / "adapter_config.json").read_bytes())
def from_config(config):
    return transformers.AutoModelForCausalLM.from_config(config)
peft_config("llama_list", from_config(transformers.LlamaConfig(**tiny)), target_modules=["q_proj", "v_proj"])
peft_config("llama_all_linear", from_config(transformers.LlamaConfig(**tiny)), target_modules="all-linear")
peft_config("llama_regex", from_config(transformers.LlamaConfig(**tiny)), target_modules=r".*layers\.\d+\.self_attn\.(q|k)_proj",
            rank_pattern={"k_proj": 8}, alpha_pattern={"k_proj": 16}, lora_dropout=0.1)
peft_config("qwen3_moe_parameters", from_config(transformers.Qwen3MoeConfig(**tiny, num_experts=4, num_experts_per_tok=2,
                                                                            moe_intermediate_size=32)),
            target_modules=["q_proj", "o_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
ds = W / "src_deepseek_v3"
transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(
    **dict(tiny, num_key_value_heads=4), moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
    first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    num_experts_per_tok=2, n_group=1, topk_group=1)).save_pretrained(ds)
peft_config("deepseek_v3_rank_pattern", transformers.AutoModelForCausalLM.from_pretrained(ds),
            target_modules=["q_a_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj"])
for t in ["megatron_idx", "safetensors_index", "trestle_model", "preprocess_jsonl", "hf_tokenizer", "peft_config"]:
    print(t, sorted((p.name, p.stat().st_size) for p in (OUT / t).iterdir()))

"""`trestle bench convert` at a small size: the Llama model against its Python peer, the Nemotron-H-shaped hybrid, the
Gemma-4-shaped model, the Qwen3-VL- and Gemma-3-with-vision-shaped vision-language models, and
the DeepSeek-V3- and GLM-4.5-shaped MoEs (`--arch deepseek`: multi-latent attention, a dense layer, many small
experts; `--arch glm4_moe`: grouped-query attention with biases, q/k norms and partial RoPE, the same MoE layers) at
tp2/pp2/ep2. Every run converts,
round-trips byte-identically (the benchmark checks), and reports its times, the disk floor, and peak RSS against the
bound of twice the largest tensor plus 256 MiB, in the table and the JSON. `--to megatron-dist` does the same through
Megatron-Core's torch_dist, with the share of fio's write rate each direction sustains.
"""
import json
import shutil
import sys

import pytest


def run_bench(trestle, tmp_path, name, size, *extra):
    report = tmp_path / f"{name}.json"
    args = ["bench", "convert", "--size", size, "--repeat", "1", "--dir", tmp_path / name, "--json-out", report,
            "--python", sys.executable, *extra]
    if shutil.which("fio") is None:
        args.append("--no-fio")
    out = trestle.run(*args, timeout=600)
    return out, json.loads(report.read_text())


def test_llama_against_the_python_peer(trestle, tmp_path):
    out, report = run_bench(trestle, tmp_path, "llama", "96MB")
    assert report["arch"] == "llama" and "python" in report
    assert report["trestle"]["to_megatron"] and report["python"]["to_hf"]
    assert "byte-identical to the source: yes" in out and "python (safetensors+torch)" in out
    assert report["peak_rss_bound"] == 2 * report["largest_tensor_bytes"] + (256 << 20)


def test_deepseek_shaped_moe(trestle, tmp_path):
    out, report = run_bench(trestle, tmp_path, "deepseek", "300MB", "--arch", "deepseek", "--ep", "2")
    assert report["arch"] == "deepseek" and report["ep"] == 2 and "DeepSeek-V3-shaped" in report["model"]
    assert "python" not in report and "converts Llama checkpoints only" in out
    assert report["trestle"]["to_megatron"] and report["trestle"]["to_hf"]
    assert 150e6 < report["model_bytes"] < 450e6
    assert "byte-identical to the source: yes" in out and "bound 2 x largest tensor" in out
    rss = max(report["trestle"]["peak_rss_to_megatron"], report["trestle"]["peak_rss_to_hf"])
    assert rss <= report["peak_rss_bound"], (rss, report["peak_rss_bound"])


def test_qwen3_next_shaped(trestle, tmp_path):
    """Qwen3-Next's layer shape (Gated DeltaNet at the real widths, gated full attention in the last layer, 32 small
    experts and a gated shared one) at tp2/pp2/ep2: the round trip is byte-identical and the streaming bound holds."""
    out, report = run_bench(trestle, tmp_path, "next", "200MB", "--arch", "qwen3_next", "--ep", "2")
    assert report["arch"] == "qwen3_next" and report["ep"] == 2 and "Qwen3-Next-shaped" in report["model"]
    assert 150e6 < report["model_bytes"] < 400e6
    assert "byte-identical to the source: yes" in out and "bound 2 x largest tensor" in out
    rss = max(report["trestle"]["peak_rss_to_megatron"], report["trestle"]["peak_rss_to_hf"])
    assert rss <= report["peak_rss_bound"], (rss, report["peak_rss_bound"])


def test_glm_shaped_moe(trestle, tmp_path):
    """GLM-4.5's full-width layer shape (grouped-query attention with biases, q/k norms and RoPE over half of each
    128-dim head; a dense layer, then 64 small experts and a shared one) at tp2/pp2/ep2: the streaming bound holds."""
    out, report = run_bench(trestle, tmp_path, "glm", "200MB", "--arch", "glm4_moe", "--ep", "2")
    assert report["arch"] == "glm4_moe" and report["ep"] == 2 and "GLM-4.5-shaped" in report["model"]
    assert "python" not in report and "converts Llama checkpoints only" in out
    assert 100e6 < report["model_bytes"] < 300e6
    assert "byte-identical to the source: yes" in out and "bound 2 x largest tensor" in out
    rss = max(report["trestle"]["peak_rss_to_megatron"], report["trestle"]["peak_rss_to_hf"])
    assert rss <= report["peak_rss_bound"], (rss, report["peak_rss_bound"])


def test_torch_dist_at_tp1_with_warm_sources(trestle, tmp_path):
    """hf -> torch_dist (tp 1) and back, the write path alone (sources read into the page cache first): byte-identical,
    and each direction's share of fio's write rate in the table and the JSON."""
    out, report = run_bench(trestle, tmp_path, "dist", "64MB", "--to", "megatron-dist", "--tp", "1", "--pp", "1",
                            "--warm-sources")
    assert report["to"] == "megatron-dist" and report["warm_sources"] is True
    assert "python" not in report and "converts Llama checkpoints only" in out
    assert "hf <-> megatron-dist tp1/pp1/ep1" in out and "sources warm" in out
    assert "byte-identical to the source: yes" in out
    assert report["trestle"]["to_megatron"] and report["trestle"]["to_hf"]
    if "fio" in report:
        assert "of fio write" in out
        shares = report["fio"]["share_of_write_rate"]
        assert len(shares) == 2 and all(share > 0 for share in shares), shares
    rss = max(report["trestle"]["peak_rss_to_megatron"], report["trestle"]["peak_rss_to_hf"])
    assert rss <= report["peak_rss_bound"], (rss, report["peak_rss_bound"])


def test_nemotron_h_shaped(trestle, tmp_path):
    """Nemotron-H's layer shapes (Mamba-2 at its widths, squared-ReLU MLP layers, an attention layer every 7th) at
    tp2/pp2: the round trip is byte-identical and the streaming bound holds."""
    out, report = run_bench(trestle, tmp_path, "nemotron", "700MB", "--arch", "nemotron_h")
    assert report["arch"] == "nemotron_h" and "layers M-M-M*:" in report["model"]  # (6 layers: 3 per stage)
    assert "python" not in report and "converts Llama checkpoints only" in out
    assert 500e6 < report["model_bytes"] < 900e6
    assert "byte-identical to the source: yes" in out and "bound 2 x largest tensor" in out
    rss = max(report["trestle"]["peak_rss_to_megatron"], report["trestle"]["peak_rss_to_hf"])
    assert rss <= report["peak_rss_bound"], (rss, report["peak_rss_bound"])


def test_gemma4_shaped(trestle, tmp_path):
    """Gemma 4's layer shapes at the E4B's widths (per-layer inputs, keys as values in the full-attention layers, a
    KV-sharing layer with its double-wide MLP) at tp2/pp2: the round trip is byte-identical and the streaming bound
    holds; torch_dist, which cannot hold the model, is refused."""
    out, report = run_bench(trestle, tmp_path, "gemma4", "1GB", "--arch", "gemma4")
    assert report["arch"] == "gemma4" and "Gemma-4-shaped" in report["model"] and "4 layers" in report["model"]
    assert "byte-identical to the source: yes" in out and "bound 2 x largest tensor" in out
    rss = max(report["trestle"]["peak_rss_to_megatron"], report["trestle"]["peak_rss_to_hf"])
    assert rss <= report["peak_rss_bound"], (rss, report["peak_rss_bound"])
    result = trestle.run_raw("bench", "convert", "--arch", "gemma4", "--to", "megatron-dist", "--dir", tmp_path / "x")
    assert result.returncode != 0 and "Trestle checkpoints only" in result.stderr, result.stderr


VISION_LANGUAGE = {"qwen3_vl": ("1GB", "Qwen3-VL-shaped"), "gemma3_vl": ("600MB", "Gemma-3-with-vision-shaped")}


@pytest.mark.parametrize("arch", VISION_LANGUAGE)
def test_vision_language_shaped(trestle, tmp_path, arch):
    """Vision-language models at the 4B's widths at tp2/pp2 (Qwen3-VL: the language model's layers beside the vision
    tower's blocks, merger and deepstack mergers; Gemma 3: its language layers beside a SigLIP tower and the multi-modal
    projector, stored transposed), to a Trestle checkpoint and to torch_dist: the round trips are byte-identical and
    the streaming bound holds."""
    size, name = VISION_LANGUAGE[arch]
    for to in ("trestle", "megatron-dist"):
        out, report = run_bench(trestle, tmp_path, f"{arch}_{to}", size, "--arch", arch, "--to", to)
        assert report["arch"] == arch and name in report["model"], report["model"]
        assert "byte-identical to the source: yes" in out and "bound 2 x largest tensor" in out
        rss = max(report["trestle"]["peak_rss_to_megatron"], report["trestle"]["peak_rss_to_hf"])
        assert rss <= report["peak_rss_bound"], (rss, report["peak_rss_bound"])

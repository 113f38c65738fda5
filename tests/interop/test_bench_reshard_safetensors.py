"""`trestle bench reshard` and `trestle bench safetensors` at a small size: every contender runs and reports a rate
in the table and the JSON (bench safetensors beside its Python peer, safetensors' save_file / load_file; bench
reshard checks its result bit-equal to the source with `trestle diff`)."""
import json
import shutil
import sys

import pytest


def run_bench(trestle, tmp_path, name, *extra):
    report = tmp_path / f"{name}.json"
    args = ["bench", name, "--size", "16MB", "--repeat", 2, "--dir", tmp_path / name, "--json-out", report, *extra]
    if shutil.which("fio") is None:
        args.append("--no-fio")
    out = trestle.run(*args, timeout=300)
    return out, json.loads(report.read_text())


def check_samples(samples, rounds):
    assert len(samples["gb_per_s"]) == len(samples["seconds"]) == rounds, samples
    assert all(s > 0 for s in samples["seconds"]), samples
    assert samples["best"] == pytest.approx(max(samples["gb_per_s"])), samples


def test_bench_reshard_reports_its_rate_and_a_result_equal_to_the_source(trestle, tmp_path):
    out, report = run_bench(trestle, tmp_path, "reshard")
    assert report["benchmark"] == "reshard" and report["from"] == {"tp": 2, "pp": 2}, report
    assert report["to"] == {"tp": 4, "pp": 1}, report
    assert report["written_bytes"] >= report["source_bytes"] > 0, report
    check_samples(report["trestle"]["reshard"], 2)
    assert report["trestle"]["peak_rss"] > 0, report
    assert "tp2/pp2 -> tp4/pp1" in out and "result bit-equal to the source in canonical space (trestle diff): yes" in out


def test_bench_safetensors_reports_trestle_beside_the_python_peer(trestle, tmp_path):
    out, report = run_bench(trestle, tmp_path, "safetensors", "--python", sys.executable)
    assert report["benchmark"] == "safetensors" and report["dtype"] == "bf16", report
    results = report["results"]
    for phase, contenders in {"write": ["trestle", "python"], "read_cold": ["trestle_direct", "python"],
                              "read_warm": ["trestle_view", "python"]}.items():
        for contender in contenders:
            check_samples(results[phase][contender], 2)
    # both sides wrote and read the same state dict
    assert report["python_peer"]["bytes"] >= report["requested_bytes"] * 0.9, report
    for row in ["write", "read, cold (direct)", "read, warm (view)"]:
        assert row in out, out
    assert "Trestle/Python" in out

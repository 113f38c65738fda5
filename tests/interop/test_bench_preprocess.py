"""`trestle bench preprocess`: Trestle's preprocess beside tokenizers + megatron-core's IndexedDatasetBuilder on the
shipped corpus, in the same run: both sides' token counts and rates, their ratio and whether the two datasets are
identical, in the table and the JSON report (--json, or --json-out as the other benchmarks name it); a report that
cannot be written is refused by name before any benchmark runs."""
import json
import sys

import pytest


def test_both_sides_tokenize_the_corpus_identically_and_the_report_says_so(trestle, tmp_path):
    report = tmp_path / "preprocess.json"
    out = trestle.run("bench", "preprocess", "--repeat", 1, "--workers", 2, "--python", sys.executable,
                      "--json-out", report, timeout=300)
    assert "outputs identical: yes" in out, out
    data = json.loads(report.read_text())
    assert data["bench"] == "preprocess" and data["identical"] is True and data["workers"] == 2, data
    ours, theirs = data["trestle"], data["python"]
    assert ours["tokens"] == theirs["tokens"] > 0, data
    for side in (ours, theirs):
        assert side["seconds"] > 0 and abs(side["tokens_per_s"] - side["tokens"] / side["seconds"]) < 1e-6 * side[
            "tokens_per_s"], side
    assert abs(data["ratio"] - ours["tokens_per_s"] / theirs["tokens_per_s"]) < 1e-9 * data["ratio"], data
    assert f"{ours['tokens']}" in out and f"{data['documents']} documents" in out, out


@pytest.mark.parametrize("bench", ["preprocess", "train", "kernels", "save"])
def test_a_report_that_cannot_be_written_is_refused_before_the_run(trestle, tmp_path, bench):
    # Checked first, so that a long run does not end unable to keep its figures.
    report = tmp_path / "missing" / "report.json"
    result = trestle.run_raw("bench", bench, "--json-out", report, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"{report}: cannot write the JSON report: {report.parent} is not a folder" in result.stderr, result.stderr
    assert "[bench]" not in result.stderr, "the benchmark ran"
    folder = trestle.run_raw("bench", bench, "--json-out", tmp_path, timeout=60)
    assert folder.returncode == 2 and "cannot write the JSON report: it is a folder" in folder.stderr, folder.stderr

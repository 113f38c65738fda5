"""`trestle bench preprocess`: Trestle's preprocess beside tokenizers + megatron-core's IndexedDatasetBuilder on the
shipped corpus, in the same run: both sides' token counts and rates, their ratio and whether the two datasets are
identical, in the table and the JSON report (--json, or --json-out as the other benchmarks name it); a report that
cannot be written fails the run by name."""
import json
import sys


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


def test_a_report_that_cannot_be_written_fails_the_run(trestle, tmp_path):
    report = tmp_path / "missing" / "preprocess.json"
    result = trestle.run_raw("bench", "preprocess", "--repeat", 1, "--workers", 1, "--python", sys.executable,
                             "--json", report, timeout=300)
    assert result.returncode == 1, result.stderr
    assert f"bench preprocess: {report}: cannot write the JSON report" in result.stderr, result.stderr

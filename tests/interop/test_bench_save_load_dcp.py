"""`trestle bench save` and `trestle bench load` at a small size against their PyTorch peers
(torch.distributed.checkpoint and torch.save / torch.load, run by tools/bench/peers/torch_checkpoint_peer.py) and
fio, and from Python the bindings' trestle.save_async beside dcp.async_save: every contender runs and reports a rate, the table names the ratios, and the JSON keeps every figure.
"""
import json
import shutil
import sys


def run_bench(trestle, tmp_path, name):
    report = tmp_path / f"{name}.json"
    args = ["bench", name, "--size", "64MiB", "--repeat", "1", "--dir", tmp_path / name, "--json-out", report,
            "--python", sys.executable]
    if shutil.which("fio") is None:
        args.append("--no-fio")
    out = trestle.run(*args, timeout=300)
    return out, json.loads(report.read_text())


def test_bench_save_reports_trestle_async_dcp_and_torch_save(trestle, tmp_path):
    out, report = run_bench(trestle, tmp_path, "save")
    assert "Trestle/DCP" in out and "caller blocked by save_async" in out
    # from Python: the bindings' save_async beside DCP's async_save and save
    assert "from Python" in out and "trestle.save_async" in out and "dcp.async_save" in out
    results = report["results"]
    for key in ["trestle_save", "trestle_async_save_to_finalize", "trestle_async_caller_blocked", "memcpy_of_state",
                "dcp_save", "torch_save", "python_trestle_save_async_to_wait", "python_trestle_save_async_caller_blocked",
                "dcp_async_save_to_result", "dcp_async_save_caller_blocked"]:
        assert results[key]["best"] > 0, key
    if shutil.which("fio"):
        assert results["fio_write"]["best"] > 0
    assert report["staging_pool"]["bytes"] >= report["state_dict_bytes"]


def test_bench_load_reports_trestle_reshard_dcp_and_torch_load(trestle, tmp_path):
    out, report = run_bench(trestle, tmp_path, "load")
    assert "saved tp2 -> loaded tp4" in out
    results = report["results"]
    for key in ["trestle_load_tp2_to_tp4", "dcp_load_tp2_to_tp4", "dcp_load_tp2_to_one_process", "torch_load"]:
        assert results[key]["best"] > 0, key
    assert report["loaded_bytes"] >= report["state_dict_bytes"]

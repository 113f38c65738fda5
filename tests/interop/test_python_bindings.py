"""The `trestle` Python package (tools/python: the C++ engine through pybind11): a training loop saves model and AdamW
state with save_async every few steps while it keeps training, and each checkpoint loads back bit-exactly into fresh
tensors; a checkpoint `trestle convert` wrote at tp2/pp2 loads into whole tensors equal to the Hugging Face source;
what the package writes verifies with the CLI and reads with the format spec's pure-Python reader; bad requests raise
errors that name the tensor."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[2] / "docs" / "examples"))
from models import load_hf_tensors, save_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def trestle_py():
    path = os.environ.get("TRESTLE_PYTHON_PATH")
    if not path or not os.path.isdir(path):
        pytest.fail("set TRESTLE_PYTHON_PATH to <build>/python (ctest does this)")
    sys.path.insert(0, path)
    import trestle
    return trestle


def flat_state(model, optimizer):
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, (p, s) in enumerate(zip(model.parameters(), optimizer.state.values(), strict=True)):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            state[f"optimizer.{i}.{key}"] = s[key]
    return state


def test_save_async_during_training_loads_back_exactly(trestle_py, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).to(torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved, handles = {}, []
    for step in range(1, 7):
        x = torch.randn(32, 64)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 2 == 0:
            state = flat_state(model, optimizer)
            saved[step] = {k: v.detach().clone() for k, v in state.items()}
            handles.append(trestle_py.save_async(state, tmp_path / "ckpt", iteration=step, training={"step": step}))
            # training goes on and changes the tensors while the save is written
    handles[-1].wait()
    assert all(h.done() for h in handles)
    for step, expected in saved.items():
        fresh = {k: torch.empty_like(v) for k, v in expected.items()}
        trestle_py.load(tmp_path / "ckpt", fresh, iteration=step)
        for k in expected:
            assert torch.equal(fresh[k], expected[k]), (step, k)
        assert trestle_py.inspect(tmp_path / "ckpt", iteration=step)["training"]["step"] == step
    cli = os.environ["TRESTLE_BIN"]
    assert subprocess.run([cli, "verify", tmp_path / "ckpt"], capture_output=True).returncode == 0
    import read_trestle
    _, tensors = read_trestle.read_checkpoint(str(tmp_path / "ckpt"))
    assert (tensors["model.0.weight"] == saved[6]["model.0.weight"].numpy()).all()


def test_loads_a_converted_checkpoint_of_any_layout(trestle_py, trestle, tmp_path):
    save_tiny_model(str(tmp_path / "hf"), "LlamaConfig",
                    dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2), seed=2, dtype=torch.bfloat16)
    trestle.run("convert", "--from", "hf", tmp_path / "hf", "--to", "trestle", tmp_path / "ckpt", "--tp", 2, "--pp", 2,
                "--quiet")
    manifest = trestle_py.inspect(tmp_path / "ckpt")
    assert manifest["layout"]["tp"] == 2 and manifest["world_size"] == 4
    wanted = {"embedding.word_embeddings.weight": torch.empty(300, 32, dtype=torch.float32),
              "decoder.layers.3.mlp.linear_fc2.weight": torch.empty(32, 48, dtype=torch.bfloat16)}
    trestle_py.load(tmp_path / "ckpt", wanted)
    hf = load_hf_tensors(str(tmp_path / "hf"))
    assert torch.equal(wanted["embedding.word_embeddings.weight"], hf["model.embed_tokens.weight"].float())
    assert torch.equal(wanted["decoder.layers.3.mlp.linear_fc2.weight"], hf["model.layers.3.mlp.down_proj.weight"])


def test_bad_requests_raise_errors_naming_the_tensor(trestle_py, tmp_path):
    trestle_py.save({"w": torch.ones(4, 4)}, tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="no tensor missing"):
        trestle_py.load(tmp_path / "ckpt", {"missing": torch.empty(1)})
    with pytest.raises(RuntimeError, match=r"w: the tensor has shape .* the checkpoint"):
        trestle_py.load(tmp_path / "ckpt", {"w": torch.empty(2, 8)})
    with pytest.raises(TypeError, match=r"state_dict\['x'\] is list, not a torch.Tensor"):
        trestle_py.save({"x": [1, 2]}, tmp_path / "other")
    with pytest.raises(RuntimeError, match="iteration 0"):  # committed iterations are never replaced silently
        trestle_py.save({"w": torch.zeros(4, 4)}, tmp_path / "ckpt")
    trestle_py.save({"w": torch.zeros(4, 4)}, tmp_path / "ckpt", overwrite=True)
    out = {"w": torch.empty(4, 4)}
    assert torch.equal(trestle_py.load(tmp_path / "ckpt", out)["w"], torch.zeros(4, 4))
    # Floating-point values convert to the tensor's floating-point dtype; into integers they would be truncated.
    trestle_py.save({"x": torch.tensor([-1.9, 0.5, 7e4])}, tmp_path / "floats")
    half = trestle_py.load(tmp_path / "floats", {"x": torch.empty(3, dtype=torch.bfloat16)})["x"]
    assert torch.equal(half, torch.tensor([-1.9, 0.5, 7e4]).bfloat16())
    for dtype in (torch.uint8, torch.int64, torch.bool):
        with pytest.raises(RuntimeError, match=r"x: the tensor is .*, the checkpoint's Float; only floating-point"):
            trestle_py.load(tmp_path / "floats", {"x": torch.empty(3, dtype=dtype)})
    with pytest.raises(RuntimeError, match="x: the tensor is on the meta device"):
        trestle_py.load(tmp_path / "floats", {"x": torch.empty(3, device="meta")})


def test_arguments_of_the_wrong_kind_are_refused_before_anything_is_written(trestle_py, tmp_path, monkeypatch):
    """A path of None or bytes became a directory named "None" or "b'...'", a fractional iteration was truncated, a
    negative one read as iter_-000001, `training` that is no dict failed inside the engine after staging, and a
    progress that is not callable failed after the whole conversion was written."""
    monkeypatch.chdir(tmp_path)
    state = {"w": torch.ones(2, 3)}
    for path in (None, 5):
        with pytest.raises(TypeError, match="path: expected a path"):
            trestle_py.save(state, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    trestle_py.save(state, os.fsencode(tmp_path / "bytes"))  # bytes: the file system's encoding of a path
    assert (tmp_path / "bytes" / "latest_checkpointed_iteration.txt").exists()
    for iteration, error in ((2.7, TypeError), (True, TypeError), (-1, ValueError)):
        with pytest.raises(error, match="iteration"):
            trestle_py.save(state, tmp_path / "i", iteration=iteration)
        with pytest.raises(error, match="iteration"):
            trestle_py.load(tmp_path / "bytes", {"w": torch.empty(2, 3)}, iteration=iteration)
    with pytest.raises(TypeError, match="training: expected a dict"):
        trestle_py.save(state, tmp_path / "t", training=[1, 2])
    assert not (tmp_path / "t").exists()
    with pytest.raises(TypeError, match="progress: expected None, True or a callable"):
        trestle_py.reshard(tmp_path / "bytes", tmp_path / "r", tp=1, progress=5)
    assert not (tmp_path / "r").exists()
    # Each argument of the wrong kind named (pybind's cast said only "Unable to cast Python instance"), a tensor's name
    # that is not a str too.
    with pytest.raises(TypeError, match=r"state_dict key 3: expected a str"):
        trestle_py.save({3: torch.ones(2)}, tmp_path / "k")
    assert not (tmp_path / "k").exists()
    for kwargs, words in ((dict(tp="2"), "tp: expected an int, not str '2'"),
                          (dict(pp=2.0), "pp: expected an int, not float 2.0"),
                          (dict(ep=True), "ep: expected an int, not bool"),
                          (dict(codec=None), "codec: expected a str"),
                          (dict(dry_run="yes"), "dry_run: expected True or False"),
                          (dict(dist_optimizer=[1]), "dist_optimizer: expected a dict"),
                          (dict(dist_optimizer={1: 2}), "dist_optimizer: setting 1: expected a str name")):
        with pytest.raises(TypeError, match=words):
            trestle_py.reshard(tmp_path / "bytes", tmp_path / "r", **kwargs)
    for kwargs, words in ((dict(tp="2"), "tp: expected an int"), (dict(to_format=1), "to_format: expected a str"),
                          (dict(max_shard_size="5GB"), "max_shard_size: expected an int"),
                          (dict(model_only=1), "model_only: expected True or False")):
        with pytest.raises(TypeError, match=words):
            trestle_py.convert(tmp_path / "bytes", tmp_path / "r", from_format="trestle", **{"to_format": "hf", **kwargs})
    assert not (tmp_path / "r").exists()


def test_a_save_handle_is_done_once_a_later_save_committed_it(trestle_py, tmp_path):
    first = trestle_py.save_async({"w": torch.ones(8)}, tmp_path / "ckpt", iteration=1)
    second = trestle_py.save_async({"w": torch.zeros(8)}, tmp_path / "ckpt", iteration=2)
    assert first.done()  # the second save committed it before it started (it said not done, and waited for the second)
    assert trestle_py.inspect(tmp_path / "ckpt", iteration=1)["iteration"] == 1
    first.wait()
    second.wait()
    assert second.done()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_convert_and_reshard_from_python_with_progress_callbacks(trestle_py, trestle, tmp_path):
    """trestle.convert / trestle.reshard do what the CLI does (same files), reporting progress to a callback."""
    save_tiny_model(str(tmp_path / "hf"), "Qwen2Config",
                    dict(vocab_size=301, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2), seed=5, dtype=torch.float32)
    calls = []
    plan = trestle_py.convert(tmp_path / "hf", tmp_path / "py", from_format="hf", to_format="trestle", tp=2, pp=3,
                              progress=lambda *a: calls.append(a))
    assert "wrote" in plan and calls, plan
    label, done, total, final = calls[-1]
    assert final and done == total > 0 and isinstance(label, str), calls[-1]
    for name in {c[0] for c in calls}:  # each operation's bytes only grow, and it ends once, whole
        dones = [c[1] for c in calls if c[0] == name]
        assert dones == sorted(dones) and [c[3] for c in calls if c[0] == name][-1], (name, calls)
    trestle.run("convert", "--from", "hf", tmp_path / "hf", "--to", "trestle", tmp_path / "cli", "--tp", 2, "--pp", 3,
                "--quiet")
    trestle.run("diff", tmp_path / "py", tmp_path / "cli")
    assert trestle_py.inspect(tmp_path / "py")["layout"]["tp"] == 2

    # reshard to tp1/pp1 and to torch_dist, then back to Hugging Face: the source's tensors
    trestle_py.reshard(tmp_path / "py", tmp_path / "tp1", tp=1, pp=1)
    assert trestle_py.inspect(tmp_path / "tp1")["layout"]["tp"] == 1
    trestle_py.reshard(tmp_path / "py", tmp_path / "dist", to_format="megatron-dist", tp=1, pp=1, progress=False)
    trestle_py.convert(tmp_path / "dist", tmp_path / "hf-back", from_format="megatron-dist", to_format="hf")
    back, source = load_hf_tensors(str(tmp_path / "hf-back")), load_hf_tensors(str(tmp_path / "hf"))
    assert sorted(back) == sorted(source)
    assert all(torch.equal(back[k], source[k]) for k in source)

    # errors: a bad argument before anything runs, an engine error naming the file, a callback's own exception
    with pytest.raises(ValueError, match="dtype 'fp7'"):
        trestle_py.convert(tmp_path / "hf", tmp_path / "x", from_format="hf", to_format="hf", dtype="fp7")
    with pytest.raises(ValueError, match="is a reshard"):
        trestle_py.convert(tmp_path / "py", tmp_path / "x", from_format="trestle", to_format="trestle")
    with pytest.raises(RuntimeError, match="missing"):
        trestle_py.reshard(tmp_path / "missing", tmp_path / "x", tp=1)

    # A callback's exception cancels the conversion at its next piece: it is raised, the callback is not called again
    # and no destination is left (nor its staging).
    stops = []

    def stop(*_):
        stops.append(1)
        raise KeyError("stop here")
    with pytest.raises(KeyError, match="stop here"):
        trestle_py.convert(tmp_path / "hf", tmp_path / "y", from_format="hf", to_format="trestle", tp=2,
                           progress=stop)
    assert stops == [1] and not (tmp_path / "y").exists()
    assert not [p.name for p in tmp_path.iterdir() if ".partial." in p.name]
    # ... in each kind of operation: to Hugging Face, a reshard, to torch_dist
    for call in (lambda **k: trestle_py.convert(tmp_path / "py", tmp_path / "y", from_format="trestle",
                                                to_format="hf", **k),
                 lambda **k: trestle_py.reshard(tmp_path / "py", tmp_path / "y", tp=1, pp=1, **k),
                 lambda **k: trestle_py.reshard(tmp_path / "py", tmp_path / "y", to_format="megatron-dist", tp=1,
                                                pp=1, **k)):
        stops.clear()
        with pytest.raises(KeyError, match="stop here"):
            call(progress=stop)
        assert stops == [1] and not (tmp_path / "y").exists()
    assert not [p.name for p in tmp_path.iterdir() if ".partial." in p.name]


def test_ctrl_c_cancels_a_conversion_from_python(trestle_py, tmp_path):
    """SIGINT (Ctrl-C) during trestle.convert without a callback: KeyboardInterrupt comes within moments, not once the
    whole conversion is written, and no destination is left. The model is large enough (~500 MB) that the conversion
    takes several tenths of a second; the signal comes once its staging directory is there."""
    import signal
    import threading
    import time
    save_tiny_model(str(tmp_path / "hf"), "LlamaConfig",
                    dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=8), seed=1, dtype=torch.float32)
    interrupted = []

    def interrupt_once_writing():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if [p for p in tmp_path.iterdir() if ".partial." in p.name]:
                interrupted.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.001)
    thread = threading.Thread(target=interrupt_once_writing)
    thread.start()
    with pytest.raises(KeyboardInterrupt):
        trestle_py.convert(tmp_path / "hf", tmp_path / "out", from_format="hf", to_format="trestle", tp=2,
                           progress=None)
    raised = time.monotonic()
    thread.join()
    assert interrupted and raised - interrupted[0] < 5, (interrupted, raised)
    assert not (tmp_path / "out").exists()
    assert not [p.name for p in tmp_path.iterdir() if ".partial." in p.name]
    # and the next conversion into the same place runs whole
    trestle_py.convert(tmp_path / "hf", tmp_path / "out", from_format="hf", to_format="trestle", tp=2)
    assert trestle_py.inspect(tmp_path / "out")["layout"]["tp"] == 2


def test_a_save_in_flight_at_exit_is_committed(trestle_py, tmp_path):
    script = ("import sys, torch; sys.path.insert(0, sys.argv[2]); import trestle\n"
              "trestle.save_async({'w': torch.arange(12.0).reshape(3, 4)}, sys.argv[1], iteration=3)\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ckpt"), os.environ["TRESTLE_PYTHON_PATH"]],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    out = trestle_py.load(tmp_path / "ckpt", {"w": torch.empty(3, 4)})
    assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4))

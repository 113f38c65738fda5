"""Trestle checkpoints from Python: the C++ engine under a small API.

    trestle.save(state_dict, path)                  # a Trestle checkpoint of a flat {name: tensor} dict
    handle = trestle.save_async(state_dict, path)   # returns once the tensors are staged; handle.wait() commits
    trestle.load(path, state_dict)                  # fills preallocated tensors, from any saved layout
    trestle.inspect(path)                           # the manifest as a dict
    trestle.convert(src, dst, from_format="hf", to_format="trestle", tp=2, progress=callback)
    trestle.reshard(src, dst, tp=4, pp=1)           # as `trestle convert` / `trestle reshard` on the command line
    trestle.dcp.Writer(path) / trestle.dcp.Reader(path)   # torch.distributed.checkpoint storage plugin

In a torch.distributed job every rank calls save/save_async/load with its own state dict: a DTensor contributes its
local shard (the box its placements give it), a plain tensor is the whole tensor (replicas written once). A checkpoint
saved by 2 ranks loads into 4 (or 1) the same way: each rank's tensors are filled from whatever files hold their boxes.
`process_group` picks the ranks (default: the whole job when torch.distributed is initialised, else this process).

Saves go through one process-wide saver whose pinned staging pool is reused; at most one save is in flight (a new
save first commits the previous one). Errors raise RuntimeError with the engine's message (file, tensor, reason)."""
import atexit
import json
import os
import sys

import torch

from . import _trestle

__all__ = ["save", "save_async", "load", "inspect", "convert", "reshard", "SaveHandle", "dcp"]

_saver = None


def _the_saver():
    global _saver
    if _saver is None:
        _saver = _trestle.Saver()
    return _saver


@atexit.register
def _commit_at_exit():
    """A save still in flight when Python exits is committed first, while its ranks can still talk (this handler
    runs before torch.distributed's, which were registered earlier)."""
    if _saver is not None and _saver.in_flight:
        try:
            _saver.wait()
        except Exception as e:  # reported: an exit must not hide a failed save
            print(f"trestle: the save in flight at exit failed: {e}", file=sys.stderr)


def _ranks(process_group):
    """(rank, size, all_gather) of the ranks that save or load together; all_gather None for one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is not initialised")
        return 0, 1, None
    rank, size = dist.get_rank(process_group), dist.get_world_size(process_group)
    if size == 1:
        return 0, 1, None

    def all_gather(data):
        out = [None] * size
        dist.all_gather_object(out, data, group=process_group)
        return out

    return rank, size, all_gather


def _pieces(state_dict):
    """(name, local tensor, global shape, global offset) for every entry: a DTensor's local shard, else the whole."""
    pieces = []
    for name, value in state_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"state_dict key {name!r}: expected a str (the tensor's name), not {type(name).__name__}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is {type(value).__name__}, not a torch.Tensor")
        if _is_dtensor(value):
            local, offset = _dtensor_shard(name, value)
            pieces.append((name, local, list(value.shape), offset))
        else:
            pieces.append((name, value.detach(), list(value.shape), [0] * value.dim()))
    return pieces


def _is_dtensor(value):
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(value, DTensor)


def _dtensor_shard(name, value):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in value.placements:
        if not isinstance(p, (Shard, Replicate)) or (isinstance(p, Shard) and type(p) is not Shard):
            raise ValueError(f"{name!r}: DTensor placement {p} is not Shard or Replicate (redistribute it first)")
    local = value.to_local().detach()
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if list(shape) != list(local.shape):
        raise ValueError(f"{name!r}: DTensor's local shard is {list(local.shape)}, its placements give {list(shape)}")
    return local, list(offset)


def _path(value, what="path"):
    """A path argument as the engine takes it: str or os.PathLike (bytes decoded as the file system does); anything
    else (None, a number) is a TypeError rather than a directory named after it."""
    if isinstance(value, (str, bytes, os.PathLike)):
        path = os.fsdecode(os.fspath(value))
        if path:
            return path
        raise ValueError(f"{what}: an empty path")
    raise TypeError(f"{what}: expected a path (str or os.PathLike), not {type(value).__name__}")


def _int(what, value, optional=False):
    """A size argument: an int (None where optional), never a str, float or bool taken for one."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}: expected an int, not {type(value).__name__} {value!r}")
    return value


def _iteration(value, optional):
    """An iteration argument: a whole number 0 or more (None where optional), never silently truncated."""
    value = _int("iteration", value, optional)
    if value is not None and value < 0:
        raise ValueError(f"iteration {value}: a checkpoint's iteration is 0 or more")
    return value


def _str(what, value, optional=False):
    """A name argument (a format, dtype, codec): a str (None where optional)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{what}: expected a str, not {type(value).__name__} {value!r}")
    return value


def _flag(what, value):
    """A yes/no argument: a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{what}: expected True or False, not {type(value).__name__} {value!r}")
    return value


def _settings(what, value):
    """A dict of settings by name (dist_optimizer), or None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"{what}: expected a dict of settings or None, not {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise TypeError(f"{what}: setting {key!r}: expected a str name, not {type(key).__name__}")
    return value


_saves_started = 0  # save_async calls so far: a later save commits the one before it first


class SaveHandle:
    """A save in flight: wait() blocks until its files are written and the iteration is committed."""

    def __init__(self, saver, number):
        self._saver = saver
        self._number = number
        self._done = False

    def wait(self):
        if not self.done():
            self._saver.wait()
        self._done = True

    def done(self):
        """Whether the save has been committed (by wait() or by a later save, which commits it before it starts)."""
        return self._done or self._number < _saves_started or not self._saver.in_flight


def save_async(state_dict, path, *, iteration=0, codec="raw", overwrite=False, training=None, process_group=None):
    """Stages every tensor of `state_dict` (CPU or CUDA; DTensors as their local shards) and returns a SaveHandle; the
    tensors may change right away. Every rank of `process_group` calls it with the same path and iteration; wait()
    (on every rank) commits. `training` is JSON-able state recorded in the manifest."""
    global _saves_started
    iteration = _iteration(iteration, optional=False)
    path = _path(path)
    if training is not None and not isinstance(training, dict):
        raise TypeError(f"training: expected a dict of JSON-able state, not {type(training).__name__}")
    saver = _the_saver()
    rank, size, all_gather = _ranks(process_group)
    # Each rank checks its own input, then the ranks agree on the outcome before the collective save: a rank whose
    # input is bad would otherwise fail alone and leave the others waiting in the save's gather until its timeout.
    error = None
    try:
        pieces = _pieces(state_dict)
        _trestle.check_pieces(pieces)
    except (TypeError, ValueError, RuntimeError) as e:
        error = e
    if all_gather is not None:
        failed = [(r, m) for r, m in enumerate(all_gather(None if error is None else f"{type(error).__name__}: {error}"))
                  if m is not None]
        if error is None and failed:
            raise RuntimeError("trestle.save: " + "; ".join(f"rank {r} could not save: {m}" for r, m in failed))
    if error is not None:
        raise error
    saver.save_async(pieces, path, iteration, codec, bool(overwrite), json.dumps(training or {}), rank, size,
                     all_gather)
    _saves_started += 1
    return SaveHandle(saver, _saves_started)


def save(state_dict, path, **kwargs):
    """save_async, then wait for the commit."""
    save_async(state_dict, path, **kwargs).wait()


def load(path, state_dict, *, iteration=None):
    """Fills each tensor of `state_dict` (whole, or a DTensor's local shard) with its part of the checkpoint's tensor of
    the same name, whatever layout saved it. Floating-point values are converted to the tensor's floating-point dtype;
    integer and boolean tensors must have the checkpoint's dtype. Returns state_dict."""
    _trestle.load(_path(path), _pieces(state_dict), _iteration(iteration, optional=True))
    return state_dict


def inspect(path, *, iteration=None):
    """The checkpoint's manifest (docs/format.md) as a dict."""
    return json.loads(_trestle.manifest(_path(path), _iteration(iteration, optional=True)))


def convert(src, dst, *, from_format, to_format, tp=1, pp=1, vpp=1, ep=1, first_stage_layers=0, last_stage_layers=0,
            make_vocab_size_divisible_by=128, norms="te", dtype="keep", codec="raw", max_shard_size=5_000_000_000,
            hf_expert_layout="source", iteration=None, hf_config=None, model_only=False, dist_optimizer=None,
            base=None, merge_lora=False, dry_run=False, progress=None):
    """`trestle convert --from FROM SRC --to TO DST ...` (see `trestle convert --help`): formats hf, trestle,
    megatron-dist, megatron-legacy (read only), hf-peft (a PEFT LoRA adapter: to_format="hf-peft" exports a trestle
    adapter checkpoint; from_format="hf-peft" with base=BASE imports one for the base Trestle checkpoint;
    merge_lora=True with to_format="hf" writes the base merged with the adapters); the layout arguments describe the
    destination. `dist_optimizer`: a
    dict of the loading run's settings (dp, overlap_grad_reduce, ddp_bucket_size, grad_reduce_in_bf16,
    transformer_impl, lr (required), min_lr, weight_decay, adam_beta1, adam_beta2, adam_eps) writes a megatron-dist
    destination's optimizer state as the distributed optimizer's dp_reshardable buckets (`--optimizer-format
    dp_reshardable`). `progress`: None (quiet), True (lines on stderr) or a callable progress(label, done_bytes,
    total_bytes, final), called about every 100 ms from the engine's thread. Returns the plan and the summary of what
    was written (only the plan for dry_run)."""
    if isinstance(max_shard_size, float) and max_shard_size.is_integer():
        max_shard_size = int(max_shard_size)  # 5e9
    args = dict(from_format=_str("from_format", from_format), to_format=_str("to_format", to_format),
                tp=_int("tp", tp), pp=_int("pp", pp), vpp=_int("vpp", vpp), ep=_int("ep", ep),
                first_stage_layers=_int("first_stage_layers", first_stage_layers),
                last_stage_layers=_int("last_stage_layers", last_stage_layers),
                make_vocab_size_divisible_by=_int("make_vocab_size_divisible_by", make_vocab_size_divisible_by),
                norms=_str("norms", norms), dtype=_str("dtype", dtype), codec=_str("codec", codec),
                max_shard_size=_int("max_shard_size", max_shard_size),
                hf_expert_layout=_str("hf_expert_layout", hf_expert_layout),
                iteration=_iteration(iteration, optional=True),
                hf_config=None if hf_config is None else _path(hf_config, "hf_config"),
                model_only=_flag("model_only", model_only), dist_optimizer=_settings("dist_optimizer", dist_optimizer),
                base=None if base is None else _path(base, "base"), merge_lora=_flag("merge_lora", merge_lora),
                dry_run=_flag("dry_run", dry_run))
    return _trestle.convert(_path(src, "src"), _path(dst, "dst"), args, _progress(progress))


def reshard(src, dst, *, tp=None, pp=None, vpp=None, ep=None, dp=None, first_stage_layers=None,
            last_stage_layers=None, to_format=None, iteration=None, hf_config=None, model_only=False, codec="raw",
            dist_optimizer=None, dry_run=False, progress=None):
    """`trestle reshard SRC DST ...`: a Trestle or torch_dist checkpoint, model and optimizer state, in another layout
    (sizes left None keep the source's), written as `to_format` (trestle or megatron-dist; default: the source's).
    `dist_optimizer` as for convert, without dp (the written layout's). `progress` as for convert. Returns the plan and
    the summary."""
    args = dict(tp=_int("tp", tp, True), pp=_int("pp", pp, True), vpp=_int("vpp", vpp, True),
                ep=_int("ep", ep, True), dp=_int("dp", dp, True),
                first_stage_layers=_int("first_stage_layers", first_stage_layers, True),
                last_stage_layers=_int("last_stage_layers", last_stage_layers, True),
                to_format=_str("to_format", to_format, True), iteration=_iteration(iteration, optional=True),
                hf_config=None if hf_config is None else _path(hf_config, "hf_config"),
                model_only=_flag("model_only", model_only), codec=_str("codec", codec),
                dist_optimizer=_settings("dist_optimizer", dist_optimizer), dry_run=_flag("dry_run", dry_run))
    return _trestle.reshard(_path(src, "src"), _path(dst, "dst"), args, _progress(progress))


def _progress(progress):
    """None, a bool, or a callable progress(label, done_bytes, total_bytes, final): checked before any work starts."""
    if progress is None or isinstance(progress, bool) or callable(progress):
        return progress
    raise TypeError(f"progress: expected None, True or a callable, not {type(progress).__name__}")


from . import dcp  # noqa: E402  (the storage plugin needs the names above)

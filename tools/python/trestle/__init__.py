"""Trestle checkpoints from Python: the C++ engine under a small API.

    trestle.save(state_dict, path)                  # a Trestle checkpoint of a flat {name: tensor} dict
    handle = trestle.save_async(state_dict, path)   # returns once the tensors are staged; handle.wait() commits
    trestle.load(path, state_dict)                  # fills preallocated tensors, from any saved layout
    trestle.inspect(path)                           # the manifest as a dict

Saves go through one process-wide saver whose pinned staging pool is reused; at most one save is in flight (a new
save first commits the previous one). Errors raise RuntimeError with the engine's message (file, tensor, reason)."""
import json

from . import _trestle

__all__ = ["save", "save_async", "load", "inspect", "SaveHandle"]

_saver = None


def _the_saver():
    global _saver
    if _saver is None:
        _saver = _trestle.Saver()
    return _saver


class SaveHandle:
    """A save in flight: wait() blocks until its files are written and the iteration is committed."""

    def __init__(self, saver):
        self._saver = saver
        self._done = False

    def wait(self):
        if not self._done:
            self._saver.wait()
            self._done = True

    def done(self):
        """Whether the save has been committed (by wait() or by a later save)."""
        return self._done or not self._saver.in_flight


def save_async(state_dict, path, *, iteration=0, codec="raw", overwrite=False, training=None):
    """Stages every tensor of `state_dict` (CPU or CUDA) and returns a SaveHandle; the tensors may change right away."""
    saver = _the_saver()
    saver.save_async(dict(state_dict), str(path), int(iteration), codec, bool(overwrite), json.dumps(training or {}))
    return SaveHandle(saver)


def save(state_dict, path, **kwargs):
    """save_async, then wait for the commit."""
    save_async(state_dict, path, **kwargs).wait()


def load(path, state_dict, *, iteration=None):
    """Fills each tensor of `state_dict` with the checkpoint's tensor of the same name (whole, any saved layout)."""
    _trestle.load(str(path), dict(state_dict), iteration)
    return state_dict


def inspect(path, *, iteration=None):
    """The checkpoint's manifest (docs/format.md) as a dict."""
    return json.loads(_trestle.manifest(str(path), iteration))

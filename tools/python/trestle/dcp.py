"""torch.distributed.checkpoint storage plugin backed by Trestle's engine.

    import torch.distributed.checkpoint as dcp, trestle
    dcp.save(state_dict, storage_writer=trestle.dcp.Writer(path))
    dcp.load(state_dict, storage_reader=trestle.dcp.Reader(path))

What Writer writes is an ordinary DCP checkpoint (one `__{rank}_0.distcp` per rank, each item a torch.save archive at a
4 KiB-aligned offset, and a pickled `.metadata`), so torch's stock FileSystemReader loads it, and Reader loads what the
stock FileSystemWriter (or Megatron-Core's torch_dist) wrote. The bytes move in C++: each rank's item file goes out
through Trestle's FileWriter (O_DIRECT, io_uring), reads take only the part of each chunk a rank needs (O_DIRECT, the
record's zip CRC-32 checked), several at once, with the GIL released. Tensor dtypes are those Trestle stores (bool,
integers, floating point, fp8); anything else is refused naming the tensor, as are items torch wrote through its DCP
storage extensions (e.g. FileSystemWriter(_extensions=[ZStandard()])).

Reader never unpickles arbitrary objects: `.metadata` is first parsed and checked by the engine, then unpickled with
only DCP's own classes, torch.Size, dtypes and paths allowed."""
import dataclasses
import io
import os
import pickle
import uuid
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import _trestle

__all__ = ["Writer", "Reader"]

_METADATA = ".metadata"


def _done(value):
    future = Future()
    future.set_result(value)
    return future


class Writer(StorageWriter):
    """Writes a DCP checkpoint into directory `path` (created). An existing checkpoint there is replaced when
    `overwrite` (the default, as torch's FileSystemWriter), else refused."""

    def __init__(self, path, *, overwrite=True):
        super().__init__()
        self.path = Path(path)
        self.overwrite = overwrite
        self.save_id = uuid.uuid4().hex
        self.rank = None
        self.use_collectives = True

    def reset(self, checkpoint_id=None):
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        self.is_coordinator = is_coordinator
        # dcp.save(..., use_collectives=False): each rank plans alone and writes its own files and metadata.
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _rank_local(self):
        return not self.use_collectives and self.rank is not None

    def prepare_local_plan(self, plan):
        self.path.mkdir(parents=True, exist_ok=True)
        # As FileSystemWriter: without collectives the ranks' own metadata, rank 0's telling that a checkpoint is there.
        existing = f"__0{_METADATA}" if self._rank_local() else _METADATA
        if (self.path / existing).exists() and not self.overwrite:
            raise RuntimeError(f"{self.path}: a checkpoint is already there (Writer(..., overwrite=True) replaces it)")
        if self._rank_local():
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans):
        # Rank i writes __{i}_0.distcp, the name torch's FileSystemWriter gives its first file (a plan a rank named
        # alone keeps its name).
        return [plan if plan.storage_data is not None else
                dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_")) for i, plan in enumerate(plans)]

    def write_data(self, plan, planner):
        rank = int(plan.storage_data.prefix[2:-1])
        items = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                items.append(("bytes", item.index.fqn, bytes(data.getbuffer())))
            else:
                chunk = item.tensor_data.chunk
                items.append(("tensor", item.index.fqn, data.detach(), list(item.tensor_data.size),
                              list(chunk.offsets)))
        written = _trestle.write_dcp_file(str(self.path), rank, items)
        return _done([
            WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
            for item, (name, offset, length) in zip(plan.items, written)
        ])

    def finish(self, metadata, results):
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        metadata.storage_meta = self.storage_meta()
        name = f"__{self.rank}{_METADATA}" if self._rank_local() else _METADATA
        tmp = self.path / (name + ".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / name)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def storage_meta(self):
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self):
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return isinstance(checkpoint_id, (str, os.PathLike))


class _MetadataUnpickler(pickle.Unpickler):
    """Only the classes a DCP .metadata holds."""

    _MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.checkpoint.")

    def find_class(self, module, name):
        allowed = (
            module.startswith(self._MODULES)
            or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "collections" and name == "OrderedDict")
            or (module == "pathlib" and name in ("Path", "PosixPath", "PurePosixPath"))  # storage_meta.checkpoint_id
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not a class a DCP .metadata holds")
        return super().find_class(module, name)


class Reader(StorageReader):
    """Reads the DCP checkpoint in directory `path`, `threads` chunk reads at once."""

    def __init__(self, path, *, threads=4):
        super().__init__()
        self.path = Path(path)
        self.threads = threads
        self.load_id = uuid.uuid4().hex
        self._engine = None
        self._metadata_name = _METADATA

    def reset(self, checkpoint_id=None):
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self._engine = None
        self._metadata_name = _METADATA

    def _the_engine(self, metadata_name=None):
        if metadata_name is not None and metadata_name != self._metadata_name:
            self._engine, self._metadata_name = None, metadata_name
        if self._engine is None:  # parses and checks the metadata
            self._engine = _trestle.DcpReader(str(self.path), self._metadata_name)
        return self._engine

    def read_metadata(self, *args, **kwargs):
        # dcp.load asks for `.metadata`, then (a save without collectives) for the rank's own `__{rank}.metadata`.
        rank = kwargs.get("rank")
        name = _METADATA if rank is None else f"__{rank}{_METADATA}"
        self._the_engine(name)
        path = self.path / name
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except Exception as e:
                raise RuntimeError(f"{path}: not a DCP metadata file: {e}") from e
        if not isinstance(metadata, Metadata):
            raise RuntimeError(f"{path}: holds a {type(metadata).__name__}, not a DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        self.metadata = metadata

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        engine = self._the_engine()
        requests, targets = [], []
        for req in plan.items:
            fqn = req.storage_index.fqn
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(engine.read_bytes(fqn)))
                continue
            target = planner.resolve_tensor(req).detach()
            if list(target.shape) != list(req.lengths):
                raise RuntimeError(f"{self.path}: '{fqn}': the planner gave a {list(target.shape)} tensor for a "
                                   f"{list(req.lengths)} read")
            start = [a + b for a, b in zip(req.storage_index.offset, req.storage_offsets)]
            requests.append((fqn, start, target))
            targets.append((req, target))
        engine.read(requests, self.threads)
        for req, target in targets:
            planner.commit_tensor(req, target)
        return _done(None)

    @property
    def checkpoint_id(self):
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return isinstance(checkpoint_id, (str, os.PathLike))

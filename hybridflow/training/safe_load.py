"""Loading a Megatron-Core distributed checkpoint (torch_dist format) without running code that a
crafted checkpoint carries.

Stock megatron-core 0.16.1 over torch 2.13 unpickles three things when it loads a checkpoint:

- ``.metadata`` (torch.distributed.checkpoint's ``Metadata``): ``FileSystemReader.read_metadata``
  calls plain ``pickle.load``; megatron's ``TorchDistLoadShardedStrategy.load``,
  ``load_tensors_metadata`` and ``load_sharded_metadata`` all read it through
  ``_get_filesystem_reader``. Here a restricted unpickler admits only the classes that Metadata
  is made of.
- each ShardedObject in ``*.distcp`` (every linear layer's ``_extra_state``):
  ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)``. Here it is
  ``weights_only=True``.
- ``common.pt``: ``TorchCommonLoadStrategy.load_common`` calls ``torch.load`` with torch's
  default, weights_only=True since torch 2.6 unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set. Here
  it is passed explicitly.

(The tensors in ``*.distcp`` are read with ``torch.load(weights_only=True)`` already, and
``metadata.json`` is JSON.) Megatron is not patched: ``load_strategy()`` returns a strategy object
that ``dist_checkpointing.load`` takes as an argument.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.common import (COMMON_STATE_FNAME,
                                                                TorchCommonLoadStrategy)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner, TorchDistLoadShardedStrategy, _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys, _restore_dict_types, _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict)
from torch.distributed import checkpoint
from torch.distributed.checkpoint import BytesStorageMetadata, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from hybridflow.errors import ConfigError

_DCP = "torch.distributed.checkpoint"
_ALLOWED: dict[str, frozenset[str]] = {
    f"{_DCP}.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    f"{_DCP}.filesystem": frozenset({"_StorageInfo"}),
    # megatron stores every rank's save plan in the metadata (``all_local_plans``).
    f"{_DCP}.planner": frozenset({
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"}),
    # An empty class that older megatron checkpoints pickled.
    "megatron.core.dist_checkpointing.strategies.torch": frozenset({"MCoreSavePlan"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),  # "torch.strided" -> torch.strided
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}
"""module -> the names a checkpoint's ``.metadata`` may refer to (torch dtypes besides)."""


def _refused(field: str, path: str, what: str) -> ConfigError:
    return ConfigError(field, f"{path} holds a pickled {what}, which a checkpoint has no reason "
                              "to hold; refusing to load it (unpickling it could run code). "
                              "Use a checkpoint from a source you trust")


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals of ``_ALLOWED`` and torch dtypes."""

    def __init__(self, file, path: str, field: str):
        super().__init__(file)
        self.path, self.field = path, field

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _refused(self.field, self.path, f"object of class {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _refused(self.field, self.path, "persistent reference")


def read_metadata_file(path: str | os.PathLike, field: str = "model") -> Metadata:
    """The ``Metadata`` pickled in ``path`` (a checkpoint's ``.metadata``), unpickled admitting
    only the classes Metadata is made of. Anything else, or an unreadable file, is a ConfigError
    on ``field``."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path, field).load()
    except ConfigError:
        raise
    except OSError as e:
        raise ConfigError(field, f"cannot read {path} ({e.strerror or e}); the checkpoint is "
                                 "incomplete or unreadable") from None
    except Exception as e:  # noqa: BLE001 - truncated or garbled pickle: any error unpickling
        raise ConfigError(field, f"{path} is not a readable checkpoint metadata file "
                                 f"({type(e).__name__}: {e}); the checkpoint is damaged") from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(field, f"{path} holds a {type(metadata).__name__}, not "
                                 "torch.distributed.checkpoint Metadata; the checkpoint is damaged")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader whose ``read_metadata`` uses the restricted unpickler (and, like
    megatron's CachedMetadataFileSystemReader, reads the global metadata once)."""

    def __init__(self, path: str | os.PathLike, field: str = "model"):
        super().__init__(path)
        self.field = field
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is None and self._metadata is not None:
            return self._metadata
        metadata = read_metadata_file(self._get_metadata_path(rank), self.field)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        if rank is None:
            self._metadata = metadata
        return metadata


class _SafeLoadPlanner(MCoreLoadPlanner):
    """MCoreLoadPlanner whose ShardedObjects are unpickled with ``weights_only=True``."""

    def __init__(self, *args: Any, path: str, field: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.path, self.field = path, field

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(self.field, f"{self.path}: object {fqn!r} is not plain data "
                                          f"({first[:200]}); refusing to load it (unpickling it "
                                          "could run code). Use a checkpoint from a source you "
                                          "trust") from None
        # As DefaultLoadPlanner.load_bytes does with what it unpickles.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafeLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron's torch_dist load strategy reading through ``SafeFileSystemReader`` and
    ``_SafeLoadPlanner``; errors are ConfigErrors on ``field``."""

    def __init__(self, field: str = "model"):
        super().__init__()
        self.field = field

    def load(self, sharded_state_dict, checkpoint_dir: Path):
        # TorchDistLoadShardedStrategy.load of megatron-core 0.16.1 with our reader and planner
        # (it builds both inline); tests/unit/test_run_safety.py fails if upstream's changes.
        flexible_shape_sharded_tensors = [
            sh_ten for sh_ten in nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and not sh_ten.allow_shape_mismatch]
        allow_shape_mismatch_sharded_tensors = {
            sh_ten.key: sh_ten for sh_ten in nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and sh_ten.allow_shape_mismatch}
        orig_sharded_state_dict = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = (
            _replace_state_dict_keys_with_sharded_keys(sharded_state_dict))
        pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
        fsr = SafeFileSystemReader(checkpoint_dir, self.field)
        # Read here, not first inside torch: torch takes any error reading it for a missing file
        # and retries a per-rank file, which would bury the refusal.
        fsr.read_metadata()
        checkpoint.load_state_dict(
            pyt_state_dict, fsr,
            planner=_SafeLoadPlanner(
                shapes_validation_sharded_tensors=flexible_shape_sharded_tensors,
                allow_shape_mismatch_sharded_tensors=allow_shape_mismatch_sharded_tensors,
                path=str(checkpoint_dir), field=self.field))
        self.cached_global_metadata = fsr.read_metadata()
        mcore_state_dict = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        mcore_state_dict = _replace_sharded_keys_with_state_dict_keys(
            mcore_state_dict, flat_mapping, rename_mapping)
        _restore_dict_types(mcore_state_dict, orig_sharded_state_dict)
        return mcore_state_dict

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Metadata | None = None):
        if metadata is None:
            metadata = SafeFileSystemReader(checkpoint_dir, self.field).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Path):
        metadata = SafeFileSystemReader(checkpoint_dir, self.field).read_metadata()
        sharded_metadata = {}
        for key, storage_metadata in metadata.state_dict_metadata.items():
            if isinstance(storage_metadata, BytesStorageMetadata):
                sh_obj = ShardedObject.empty_from_unique_key(key)
                sharded_metadata[sh_obj.unique_key] = sh_obj
        sharded_metadata.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return sharded_metadata


class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron's common.pt loader with ``weights_only=True`` spelled out."""

    def __init__(self, field: str = "model"):
        super().__init__()
        self.field = field

    def load_common(self, checkpoint_dir: str | Path):
        path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
        if not os.path.exists(path):
            raise ConfigError(self.field, f"{path} not found; the checkpoint is incomplete")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(self.field, f"{path} is not plain data ({first[:200]}); refusing "
                                          "to load it (unpickling it could run code). Use a "
                                          "checkpoint from a source you trust") from None


def load_strategy(field: str = "model") -> SafeLoadStrategy:
    """A megatron LoadShardedStrategy for torch_dist checkpoints that unpickles nothing but
    checkpoint metadata and plain data; pass it as ``dist_checkpointing.load(...,
    sharded_strategy=load_strategy())``."""
    return SafeLoadStrategy(field)


def _unwrap(e: CheckpointException) -> BaseException:
    """The first rank's error inside torch's CheckpointException (each rank's is wrapped)."""
    return next(iter(e.failures.values()))[0] if e.failures else e


def safe_load(sharded_state_dict: dict, ckpt_dir: str | os.PathLike,
              field: str = "model") -> dict:
    """``dist_checkpointing.load(sharded_state_dict, ckpt_dir)`` with nothing in the checkpoint
    unpickled unrestricted (see the module docstring). Collective, as that is. A checkpoint that
    holds anything else is a ConfigError on ``field``; other errors are megatron's and torch's."""
    try:
        return dist_checkpointing.load(sharded_state_dict, str(ckpt_dir),
                                       sharded_strategy=load_strategy(field),
                                       common_strategy=SafeCommonLoadStrategy(field))
    except CheckpointException as e:
        cause = _unwrap(e)
        if isinstance(cause, ConfigError):
            raise ConfigError(cause.field, cause.message) from None
        raise


def safe_load_tensors_metadata(ckpt_dir: str | os.PathLike, field: str = "model") -> dict:
    """``dist_checkpointing.load_tensors_metadata(ckpt_dir)`` (key -> ShardedTensor without data,
    carrying the global shape and dtype) through the restricted unpickler."""
    return dist_checkpointing.load_tensors_metadata(str(ckpt_dir),
                                                    sharded_strategy=load_strategy(field))

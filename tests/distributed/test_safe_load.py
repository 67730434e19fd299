"""A checkpoint saved by ``save_megatron_checkpoint`` loads bitwise through the safe path, and
the same checkpoint with a crafted ``.metadata`` is refused with a ConfigError before its pickle
runs anything -- which stock megatron loading would run."""

import os
import pickle
import shutil
from pathlib import Path

import torch

from hybridflow.parallel.spawn import spawn


class _Payload:
    """Unpickles as ``os.system(command)``."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _craft(ckpt: Path, dest: Path, marker: Path) -> Path:
    """A copy of ``ckpt`` whose .metadata also carries a payload that touches ``marker``."""
    shutil.copytree(ckpt, dest)
    with open(dest / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own checkpoint, just written
    metadata.all_local_plans.append(_Payload(f"touch {marker}"))
    (dest / ".metadata").write_bytes(pickle.dumps(metadata))
    return dest


def run(rank, world, tmp: str):
    from hybridflow.errors import ConfigError
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.models.tiny import tiny_llama_config
    from hybridflow.training.megatron_ckpt import (_build_engine, checkpoint_dtype,
                                                   load_megatron_checkpoint,
                                                   save_megatron_checkpoint)

    tmp = Path(tmp)
    cfg = tiny_llama_config(num_layers=2)
    saved = _build_engine(cfg, 1, 1, "fp32")
    saved.load_full_weights(init_full_weights(llama_param_metas(cfg), seed=0))
    save_megatron_checkpoint(saved, tmp / "ckpt")
    loaded = _build_engine(cfg, 1, 1, "fp32")
    loaded.load_full_weights(init_full_weights(llama_param_metas(cfg), seed=1))
    load_megatron_checkpoint(loaded, tmp / "ckpt")
    want, got = saved.full_weights(), loaded.full_weights()
    bitwise = sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)

    marker = tmp / "pwned"
    evil = _craft(tmp / "ckpt", tmp / "evil", marker)
    errors = []
    for load in (lambda: load_megatron_checkpoint(loaded, evil, field="resume"),
                 lambda: checkpoint_dtype(evil)):
        try:
            load()
            errors.append(None)
        except ConfigError as e:
            errors.append((e.field, e.message))
    refused_ran = marker.exists()

    # The payload is live: megatron's own loader runs it.
    from megatron.core import dist_checkpointing
    dist_checkpointing.load_tensors_metadata(str(evil))
    return bitwise, errors, refused_ran, marker.exists()


def test_real_checkpoint_loads_bitwise_and_crafted_metadata_is_refused(tmp_path):
    bitwise, errors, refused_ran, stock_ran = spawn(run, 1, str(tmp_path))[0]
    assert bitwise
    (field, message), (dtype_field, dtype_message) = errors
    assert field == "resume" and dtype_field == "--ckpt"
    for text in (message, dtype_message):
        assert str(tmp_path / "evil" / ".metadata") in text
        assert "class posix.system" in text and "no reason to hold" in text
    assert not refused_ran, "the refused checkpoint's payload ran"
    assert stock_ran, "the payload should run under stock loading; the test proves nothing"

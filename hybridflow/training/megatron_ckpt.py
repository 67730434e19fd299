"""Megatron-Core distributed checkpoints (``dist_checkpointing``, torch_dist format) of a
TrainEngine, and the HF <-> Megatron conversions that ``tools/convert_checkpoint.py`` runs.

A checkpoint is the ``sharded_state_dict()`` of the engine's GPTModel chunks: every tensor is
stored under a global key with its global shape (layers stacked along a global layer axis, each
at its global index), so a checkpoint saved at one (tp, pp, vpp, dp, last_stage_layers) loads at
any other. Beside it, ``hybridflow_model.json`` holds our ModelConfig, so that nothing else is
needed to rebuild the model, and ``tokenizer/`` the tokenizer when there was one. Checkpoints are
written into a temporary directory and renamed into place: the destination never holds a
half-written checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hybridflow import checkpoint
from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.models.hf import (_safetensors_header, _weight_map, load_hf_config,
                                  replace_dir_atomically)
from hybridflow.models.params import DTYPES
from hybridflow.parallel.layout import TrainLayout
from hybridflow.parallel.spawn import spawn
from hybridflow.training.config import EngineConfig
from hybridflow.training.engine import TrainEngine
from hybridflow.training.host_optimizer import HostAdam
from hybridflow.training.loading import (_raise_everywhere, check_hf_checkpoint,
                                         check_same_model, export_engine_to_hf,
                                         load_hf_into_engine)
from hybridflow.training.lora import LoraConfig
from hybridflow.training.model import check_model_fits_layout

MODEL_FILE = "hybridflow_model.json"
"""Our ModelConfig (and the layout it was saved at, for information) beside the checkpoint."""
TOKENIZER_DIR = "tokenizer"
"""The tokenizer of the HF checkpoint it came from, when there was one."""
_FORMAT = 1
# A dtype we do not train in (fp16) loads as fp32.
_DTYPE_NAMES = {t: name for name, t in DTYPES.items()}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _sharded_state_dict(engine) -> dict:
    # One entry per virtual-pipeline chunk; the tensors inside carry global keys and offsets, so
    # the nesting does not tie the checkpoint to a vpp.
    return {f"chunk{i}": c.module.sharded_state_dict() for i, c in enumerate(engine.chunks)}


def _save_strategy():
    # deferred: Megatron
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    # thread_count=1: one writer process and one file per saving rank (the default forks two).
    return TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)


def save_megatron_checkpoint(engine, ckpt_dir: str | os.PathLike,
                             tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Save the engine's weights as a Megatron-Core distributed checkpoint, with our ModelConfig
    (and the tokenizer of ``tokenizer_dir`` if it has one). Collective over all ranks."""
    from megatron.core import dist_checkpointing  # deferred: Megatron

    dest = Path(ckpt_dir)
    box = [None]
    if dist.get_rank() == 0:
        dest.parent.mkdir(parents=True, exist_ok=True)
        box[0] = tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    error = None
    try:
        dist_checkpointing.save(_sharded_state_dict(engine), str(tmp),
                                sharded_strategy=_save_strategy())
        if dist.get_rank() == 0:
            _write_model_file(engine, tmp)
            if tokenizer_dir is not None and _has_tokenizer(Path(tokenizer_dir)):
                import transformers  # deferred: transformers
                tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
                tok.save_pretrained(str(tmp / TOKENIZER_DIR))
    except Exception as e:  # noqa: BLE001 - re-raised on every rank below
        error = e
    try:
        _raise_everywhere(error)  # every rank has written before rank 0 renames
        if dist.get_rank() == 0:
            try:
                replace_dir_atomically(tmp, dest)
            except Exception as e:  # noqa: BLE001
                error = e
        _raise_everywhere(error)  # nobody reads dest before it is there
    finally:
        if dist.get_rank() == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _write_model_file(engine, ckpt_dir: Path) -> None:
    layout = engine.layout
    info = {"format": _FORMAT, "model": dataclasses.asdict(engine.model_config),
            "saved_at": {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp,
                         "last_stage_layers": layout.last_stage_layers}}
    if engine.adapters is not None:
        info["lora"] = dataclasses.asdict(engine.adapters.config)
    (ckpt_dir / MODEL_FILE).write_text(json.dumps(info, indent=2) + "\n")


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).exists() for f in _TOKENIZER_FILES)


def read_checkpoint_model(ckpt_dir: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored beside a checkpoint written by ``save_megatron_checkpoint``."""
    path = Path(ckpt_dir) / MODEL_FILE
    if not path.exists():
        raise ConfigError("--hf-config-from", f"{path} not found: this checkpoint was not written "
                                              "by hybridflow; give the HF config it was made from")
    try:
        info = json.loads(path.read_text())
        return ModelConfig(**info["model"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError("--ckpt", f"{path} is unreadable ({e!r}); expected {{'model': "
                                    "{ModelConfig fields}}") from None


def checkpoint_dtype(ckpt_dir: str | os.PathLike) -> str:
    """The engine dtype ("fp32"/"bf16") to load a distributed checkpoint with: its embedding's."""
    # deferred: it imports Megatron
    from hybridflow.training.safe_load import safe_load_tensors_metadata

    check_is_megatron_checkpoint(ckpt_dir)
    meta = safe_load_tensors_metadata(ckpt_dir, field="--ckpt")
    key = "embedding.word_embeddings.weight"
    if key not in meta:
        raise ConfigError("--ckpt", f"{ckpt_dir}: tensor {key} is not in the checkpoint; is it a "
                                    "GPT model?")
    return _DTYPE_NAMES.get(meta[key].dtype, "fp32")


def check_is_megatron_checkpoint(ckpt_dir: str | os.PathLike) -> None:
    """Raise a ConfigError unless ``ckpt_dir`` holds a Megatron-Core distributed checkpoint."""
    from megatron.core import dist_checkpointing  # deferred: Megatron

    if not Path(ckpt_dir).is_dir():
        raise ConfigError("--ckpt", f"{ckpt_dir} is not a directory; point to a Megatron "
                                    "checkpoint")
    if not dist_checkpointing.check_is_distributed_checkpoint(str(ckpt_dir)):
        raise ConfigError("--ckpt", f"{ckpt_dir} is not a Megatron-Core distributed checkpoint "
                                    "(no metadata.json)")


def load_megatron_checkpoint(engine, ckpt_dir: str | os.PathLike, *,
                             field: str = "--ckpt") -> None:
    """Load a distributed checkpoint (saved at any layout) into ``engine``. Collective. When the
    checkpoint carries our ModelConfig it must equal the engine's. Nothing in it is unpickled
    beyond checkpoint metadata and plain data (``safe_load``); errors name ``field``."""
    # deferred: Megatron
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from hybridflow.training.safe_load import _unwrap, safe_load

    check_is_megatron_checkpoint(ckpt_dir)
    if (Path(ckpt_dir) / MODEL_FILE).exists():
        check_same_model(engine.model_config, read_checkpoint_model(ckpt_dir), str(ckpt_dir))
    try:
        loaded = safe_load(_sharded_state_dict(engine), ckpt_dir, field=field)
    except (CheckpointingException, CheckpointException) as e:
        # torch's CheckpointException (a BaseException, raised on every rank: planning is
        # collective) wraps each rank's error with its traceback; the first error is the story.
        cause = _unwrap(e) if isinstance(e, CheckpointException) else e
        text = str(cause)
        raise ConfigError(field, f"{ckpt_dir} does not fit this model ({type(cause).__name__}: "
                                 f"{text[:300]}{'...' if len(text) > 300 else ''}); is the "
                                 "model config the one it was saved with?") from None
    for i, chunk in enumerate(engine.chunks):
        chunk.module.load_state_dict(loaded[f"chunk{i}"], strict=True)
    if engine.optimizer is not None:
        engine.optimizer.reload_model_params()


# ----------------------------------------------------------------------------------------------
# conversions, each in its own gloo processes (one per rank of a tp x pp layout)


def _log(msg: str) -> None:
    print(f"[convert] {msg}", flush=True)


def read_checkpoint_lora(ckpt_dir: str | os.PathLike):
    """The LoRA config a checkpoint's adapters were trained with (``training.lora.LoraConfig``),
    or None when it has none."""
    path = Path(ckpt_dir) / MODEL_FILE
    lora = json.loads(path.read_text()).get("lora") if path.exists() else None
    return None if lora is None else LoraConfig(**lora)


def _build_engine(cfg: ModelConfig, tp: int, pp: int, dtype: str, lora=None):
    return TrainEngine(cfg, TrainLayout(tp=tp, pp=pp, dp=1), EngineConfig(dtype=dtype),
                       build_optimizer=False, lora=lora)


def _hf_to_megatron_worker(rank: int, world: int, hf_dir: str, out_dir: str, cfg: ModelConfig,
                           tp: int, pp: int, dtype: str, verbose: bool) -> None:
    log = _log if verbose and rank == 0 else (lambda msg: None)
    engine = _build_engine(cfg, tp, pp, dtype)
    start = time.monotonic()
    load_hf_into_engine(engine, hf_dir)
    log(f"each rank read its shards of {hf_dir} in {time.monotonic() - start:.1f}s")
    start = time.monotonic()
    save_megatron_checkpoint(engine, out_dir, tokenizer_dir=hf_dir)
    log(f"saved the distributed checkpoint in {time.monotonic() - start:.1f}s")


def _megatron_to_hf_worker(rank: int, world: int, ckpt_dir: str, out_dir: str, cfg: ModelConfig,
                           tp: int, pp: int, dtype: str, tokenizer_dir: str | None,
                           verbose: bool) -> None:
    log = _log if verbose and rank == 0 else (lambda msg: None)
    engine = _build_engine(cfg, tp, pp, dtype, read_checkpoint_lora(ckpt_dir))
    start = time.monotonic()
    load_megatron_checkpoint(engine, ckpt_dir)
    log(f"loaded the distributed checkpoint in {time.monotonic() - start:.1f}s")
    start = time.monotonic()
    export_engine_to_hf(engine, out_dir, tokenizer_dir=tokenizer_dir)
    log(f"wrote the HF checkpoint in {time.monotonic() - start:.1f}s")


_CONFIG_ERROR_LINE = re.compile(r"^hybridflow\.errors\.ConfigError: (.*?): (.*)$", re.M)


def _spawn(fn: Callable, world: int, *args) -> None:
    """spawn, with a worker's ConfigError raised here as one (not as a traceback)."""
    try:
        spawn(fn, world, *args)
    except RuntimeError as e:
        found = _CONFIG_ERROR_LINE.findall(str(e))
        if found:
            raise ConfigError(*found[-1]) from None
        raise


def _check_out_dir(out_dir: Path, source: Path, overwrite: bool) -> None:
    if out_dir.resolve() == source.resolve():
        raise ConfigError("--out", f"{out_dir} is the input directory; write the output elsewhere")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise ConfigError("--out", f"{out_dir} exists; remove it or pass --overwrite to replace it")


def _check_layout(cfg: ModelConfig, tp: int, pp: int, dtype: str) -> None:
    try:  # the tool's flags are --tp and --pp
        check_model_fits_layout(cfg, TrainLayout(tp=tp, pp=pp, dp=1), EngineConfig(dtype=dtype))
    except ConfigError as e:
        flag = "--" + e.field.rpartition(".")[2]
        raise ConfigError(flag if flag in ("--tp", "--pp") else e.field, e.message) from None


def hf_to_megatron_checkpoint(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, tp: int = 1,
                              pp: int = 1, dtype: str = "auto", overwrite: bool = False,
                              verbose: bool = True) -> Path:
    """HF checkpoint -> Megatron distributed checkpoint, saved from a (tp, pp) layout that
    ``tp*pp`` local gloo processes form (each reads only its shards). ``dtype`` "auto" keeps
    bf16 checkpoints in bf16 and stores anything else as fp32. Bad input is one ConfigError,
    raised before any process starts."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    log = _log if verbose else (lambda msg: None)
    cfg = check_hf_checkpoint(hf_dir)
    if dtype == "auto":
        dtype = _hf_dtype(hf_dir)
    _check_layout(cfg, tp, pp, dtype)
    _check_out_dir(out_dir, hf_dir, overwrite)
    log(f"{hf_dir}: {cfg.arch}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads}/{cfg.num_kv_heads} heads; converting at tp={tp}, pp={pp} in {dtype} "
        f"({tp * pp} process{'es' if tp * pp > 1 else ''})")
    _spawn(_hf_to_megatron_worker, tp * pp, str(hf_dir), str(out_dir), cfg, tp, pp, dtype, verbose)
    log(f"done: {out_dir}")
    return out_dir


def _hf_dtype(hf_dir: Path) -> str:
    path = _weight_map(hf_dir)["model.embed_tokens.weight"]
    return "bf16" if _safetensors_header(path)["model.embed_tokens.weight"]["dtype"] == "BF16" \
        else "fp32"


def _actor_checkpoint(path: Path) -> Path:
    """The Megatron checkpoint that ``--ckpt`` names: ``path`` itself when it is one; the
    ``actor/`` of an RL checkpoint (``<run>/checkpoints/step_N``); a run directory's (or its
    ``checkpoints/`` folder's) newest complete checkpoint's actor. An RL checkpoint's manifest is
    checked first (files missing or truncated); nothing is loaded here."""
    from megatron.core import dist_checkpointing  # deferred: Megatron

    if not path.is_dir() or dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        return path  # a Megatron checkpoint, or an error check_is_megatron_checkpoint names
    step_dir = checkpoint.find_checkpoint(path)
    if step_dir is None:
        run_dir = path.parent if path.name == checkpoint.CHECKPOINTS else path
        if (run_dir / checkpoint.CHECKPOINTS).is_dir():
            raise ConfigError("--ckpt", f"{path} holds no complete checkpoint (a killed "
                                        "write leaves none); give a Megatron checkpoint or "
                                        f"a <run>/{checkpoint.CHECKPOINTS}/step_N directory")
        return path  # not an RL run either: check_is_megatron_checkpoint says what it is not
    try:
        checkpoint.read_checkpoint(step_dir, field="--ckpt")
    except ConfigError as e:  # its advice is about resuming; here: export another checkpoint
        raise ConfigError("--ckpt", e.message.split("; ")[0] + "; export another checkpoint "
                                    "(its step_N directory)") from None
    actor = step_dir / "actor"
    if not dist_checkpointing.check_is_distributed_checkpoint(str(actor)):
        raise ConfigError("--ckpt", f"{step_dir} has no actor checkpoint ({actor}); give a "
                                    "Megatron checkpoint or an RL checkpoint's step_N directory")
    return actor


def megatron_to_hf_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike,
                              hf_config_from: str | os.PathLike | None = None, tp: int = 1,
                              pp: int = 1, overwrite: bool = False, verbose: bool = True) -> Path:
    """Megatron distributed checkpoint -> HF checkpoint, loaded at (tp, pp) in ``tp*pp`` local
    gloo processes and written by rank 0 in the checkpoint's dtype. ``ckpt_dir`` may also be an
    RL run's checkpoint (``<run>/checkpoints/step_N``: its actor) or run directory (its newest
    complete checkpoint's actor). The model comes from ``hybridflow_model.json``, or from
    ``hf_config_from`` (an HF directory whose config.json, and tokenizer, to use; it must agree
    with the stored config when both exist). An RL checkpoint holds no tokenizer: without
    ``hf_config_from`` the export has none."""
    given, out_dir = Path(ckpt_dir), Path(out_dir)
    log = _log if verbose else (lambda msg: None)
    ckpt_dir = _actor_checkpoint(given)
    if ckpt_dir != given:
        log(f"{given}: exporting the actor of {ckpt_dir.parent}")
        step, out = ckpt_dir.parent.resolve(), out_dir.resolve()
        if out == step or out in step.parents or step in out.parents:  # --overwrite: lost
            raise ConfigError("--out", f"{out_dir} holds or is inside the checkpoint "
                                       f"{ckpt_dir.parent}; write the output elsewhere")
    check_is_megatron_checkpoint(ckpt_dir)
    tokenizer_dir = ckpt_dir / TOKENIZER_DIR
    if hf_config_from is not None:
        hf_config_from = Path(hf_config_from)
        if not hf_config_from.is_dir():
            raise ConfigError("--hf-config-from", f"{hf_config_from} is not a directory; give "
                                                  "an HF checkpoint directory (its config.json is "
                                                  "used)")
        cfg = load_hf_config(hf_config_from)
        if (ckpt_dir / MODEL_FILE).exists():
            check_same_model(read_checkpoint_model(ckpt_dir), cfg, str(hf_config_from))
        tokenizer_dir = hf_config_from
    else:
        cfg = read_checkpoint_model(ckpt_dir)
    tokenizer = str(tokenizer_dir) if _has_tokenizer(tokenizer_dir) else None
    dtype = checkpoint_dtype(ckpt_dir)
    _check_layout(cfg, tp, pp, dtype)
    _check_out_dir(out_dir, ckpt_dir, overwrite)
    log(f"{ckpt_dir}: {cfg.arch}, {cfg.num_layers} layers, {dtype}; loading at tp={tp}, pp={pp} "
        f"({tp * pp} process{'es' if tp * pp > 1 else ''})"
        + ("" if tokenizer else "; no tokenizer to copy" + (
            "" if hf_config_from is not None else " (--hf-config-from MODEL_DIR adds one)")))
    _spawn(_megatron_to_hf_worker, tp * pp, str(ckpt_dir), str(out_dir), cfg, tp, pp, dtype,
           tokenizer, verbose)
    log(f"done: {out_dir}")
    return out_dir


# ----------------------------------------------------------------------------------------------
# an engine's whole training state (RL checkpoints: hybridflow.checkpoint)

def _optimizer_metadata() -> dict:
    # The distributed optimizer's state in its canonical per-parameter form reloads at any
    # tp/pp/dp, but megatron-core 0.16 gathers it through CUDA tensors; on CPU it is saved per
    # data-parallel buffer, reloadable at another dp only. (Megatron's default,
    # fully_sharded_model_space, does not load in 0.16: "flattened_range is not supported".)
    kind = "fully_reshardable" if torch.cuda.is_available() else "dp_reshardable"
    return {"distrib_optim_sharding_type": kind}


def _train_state_dict(engine, loading: bool) -> dict:
    model = _sharded_state_dict(engine)
    state = dict(model)  # the model at the same keys as save_megatron_checkpoint's: exportable
    if engine.optimizer is not None:
        state["optimizer"] = engine.optimizer.sharded_state_dict(
            model, is_loading=loading, metadata=_optimizer_metadata())
    return state


def save_train_state(engine, ckpt_dir: str | os.PathLike) -> None:
    """Weights and optimizer state of ``engine`` as a distributed checkpoint in ``ckpt_dir`` (made
    here; the caller makes the whole checkpoint appear atomically), with our ModelConfig beside
    them, so that ``tools/convert_checkpoint.py megatron-to-hf`` exports it. Collective. A write
    the file system refuses is a ``checkpoint.CheckpointWriteError`` naming ``ckpt_dir``."""
    from megatron.core import dist_checkpointing  # deferred: Megatron

    dest = Path(ckpt_dir)
    with checkpoint.writing(dest):
        if dist.get_rank() == 0:
            dest.mkdir(parents=True, exist_ok=False)
        dist.barrier()
        dist_checkpointing.save(_train_state_dict(engine, loading=False), str(dest),
                                sharded_strategy=_save_strategy())
        if dist.get_rank() == 0:
            _write_model_file(engine, dest)
    dist.barrier()


def load_train_state(engine, ckpt_dir: str | os.PathLike) -> None:
    """Load what ``save_train_state`` wrote (at any layout) into ``engine``. Collective. A
    checkpoint that does not fit is a ConfigError on ``resume``; nothing in it is unpickled
    beyond checkpoint metadata."""
    from hybridflow.training.safe_load import safe_load  # deferred: it imports Megatron

    loaded = safe_load(_train_state_dict(engine, loading=True), str(ckpt_dir), field="resume")
    for i, chunk in enumerate(engine.chunks):
        chunk.module.load_state_dict(loaded[f"chunk{i}"], strict=True)
    if engine.optimizer is not None:
        with torch.no_grad():  # the distributed optimizer copies into views of the parameters
            engine.optimizer.load_state_dict(loaded["optimizer"])
        if not isinstance(engine.optimizer, HostAdam):  # one step count of its own
            _unshare_adam_steps(engine.optimizer)


def _unshare_adam_steps(optimizer) -> None:
    """megatron-core 0.16's DistributedOptimizer.load_state_dict (without Apex/TE) gives every
    parameter's torch-Adam state the same ``step`` tensor, which torch increments in place once
    per parameter: the bias correction after a resume would count N steps for one."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in part.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

"""HF checkpoints in and out of a TrainEngine, one TP/PP shard per rank.

``load_hf_into_engine`` reads, on each rank, only the bytes of the HF tensors that its Megatron
shards are made of: a TP shard of every Llama/Qwen2 parameter is a contiguous block of each of
its HF sources along the parameter's TP dim (rows for column-parallel weights, columns for
row-parallel ones), because

* ``linear_qkv`` rank r holds whole query groups ``[r*ng/tp, (r+1)*ng/tp)``, so its q, k and v rows
  are row block r of q_proj, k_proj and v_proj, grouped again with the rank's head counts;
* ``linear_fc1`` rank r holds ``[gate_r; up_r]``: row block r of gate_proj and of up_proj.

``export_engine_to_hf`` is the way back: gather, map to HF names, write on global rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.errors import ArgumentError, ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.models.hf import (_safetensors_header, _weight_map, hf_param_names,
                                  hf_param_shapes, hf_sources, load_hf_config,
                                  megatron_name_for_hf, megatron_to_hf, merge_hf_to_megatron,
                                  save_hf_checkpoint)
from hybridflow.models.params import ParamMeta
from hybridflow.training.lora import PEFT_DIR, write_peft_adapter
from hybridflow.training.model import VALUE_HEAD

_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT = "output_layer.weight"


def check_same_model(expected: ModelConfig, found: ModelConfig, where: str,
                     ignore: tuple[str, ...] = ()) -> None:
    """Raise a ConfigError naming the first field (not in ``ignore``) where the model ``found`` in
    a checkpoint (``where``) differs from the ``expected`` one (the engine's)."""
    diffs = [f.name for f in dataclasses.fields(ModelConfig)
             if f.name not in ignore and getattr(expected, f.name) != getattr(found, f.name)]
    if diffs:
        name = diffs[0]
        also = f" (also differ: {', '.join(diffs[1:])})" if len(diffs) > 1 else ""
        raise ConfigError("model", f"model.{name}: the checkpoint {where} has "
                                   f"{name}={getattr(found, name)!r} but the engine was built "
                                   f"with {getattr(expected, name)!r}{also}; build the engine "
                                   "from the checkpoint's config (load_hf_config)")


FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
"""safetensors' names of the dtypes a checkpoint's weights may have (converted on load)."""


def check_hf_checkpoint(hf_dir: str | os.PathLike, cfg: ModelConfig | None = None) -> ModelConfig:
    """Check an HF directory from its headers alone (no tensor data is read): config.json maps to
    a ModelConfig (equal to ``cfg`` when given), every tensor of the model is present with the
    shape the config gives, and no file is truncated. Returns the checkpoint's ModelConfig.
    Every rank of a load runs it, so a bad checkpoint fails the same way everywhere."""
    return _checked_weight_map(Path(hf_dir), cfg)[0]


def _checked_weight_map(hf_dir: Path, cfg: ModelConfig | None, ignore: tuple[str, ...] = ()
                        ) -> tuple[ModelConfig, dict[str, Path]]:
    if not hf_dir.is_dir():
        raise ConfigError("model", f"{hf_dir}: is not a directory; point to an HF checkpoint "
                                   "directory")
    found = load_hf_config(hf_dir)
    if cfg is not None:
        check_same_model(cfg, found, str(hf_dir), ignore)
    weight_map = _weight_map(hf_dir)  # without an index this already checks every file's header
    expected = hf_param_shapes(found)
    headers: dict[Path, dict] = {}
    for name in hf_param_names(found):
        if name not in weight_map:
            raise ConfigError("model", f"{hf_dir}: tensor {name}: missing from the checkpoint, "
                                       f"which its config.json describes as a {found.arch} of "
                                       f"{found.num_layers} layers; re-save the checkpoint or fix "
                                       "config.json")
        path = weight_map[name]
        if path not in headers:
            if not path.exists():
                raise ConfigError("model", f"{path}: missing (the index lists it for tensor "
                                           f"{name})")
            headers[path] = _safetensors_header(path)
        if name not in headers[path]:
            raise ConfigError("model", f"{path}: tensor {name} is listed in the index but not in "
                                       "the file")
        dtype = headers[path][name]["dtype"]
        if dtype not in FLOAT_DTYPES:
            raise ConfigError("model", f"{path}: tensor {name} is stored as {dtype}, not as a "
                                       f"floating-point type ({', '.join(FLOAT_DTYPES)}); re-save "
                                       "the checkpoint with its weights")
        shape = tuple(headers[path][name]["shape"])
        want, why = expected[name]
        if shape != want:
            raise ConfigError("model", f"{path}: tensor {name} has shape {list(shape)}, expected "
                                       f"{list(want)} for {why}")
    extra = sorted(n for n in weight_map if n not in expected and not _unused_by_design(n, found))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConfigError("model", f"{hf_dir}: tensor {extra[0]}{more} is in the checkpoint but "
                                   f"not in the model its config.json describes ({found.arch}, "
                                   f"{found.num_layers} layers); config.json does not belong to "
                                   "these weights")
    return found, weight_map


def _unused_by_design(name: str, cfg: ModelConfig) -> bool:
    """An HF tensor that ``cfg``'s model has no parameter for on purpose (RoPE inv_freq, a tied
    model's lm_head); False for one it cannot place at all."""
    try:
        return megatron_name_for_hf(name, cfg) is None
    except ConfigError:
        return False


class _SliceReader:
    """Reads blocks of HF tensors out of safetensors files, opening each file once."""

    def __init__(self, weight_map: dict[str, Path], stack: contextlib.ExitStack):
        self.weight_map = weight_map
        self.stack = stack
        self.files: dict[Path, Any] = {}

    def read(self, name: str, dim: int | None, parts: int, index: int) -> torch.Tensor:
        """Block ``index`` of ``parts`` equal blocks of tensor ``name`` along ``dim`` (the whole
        tensor when dim is None)."""
        from safetensors import SafetensorError, safe_open  # deferred: safetensors

        path = self.weight_map[name]
        try:
            if path not in self.files:
                self.files[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
            view = self.files[path].get_slice(name)
            if dim is None or parts == 1:
                return view[:]
            size = view.get_shape()[dim] // parts
            block = slice(index * size, (index + 1) * size)
            return view[block] if dim == 0 else view[:, block]
        except SafetensorError as e:
            raise ConfigError("model", f"{path}: cannot read tensor {name}: {e}") from None


def _read_shard(reader: _SliceReader, mg_name: str, meta: ParamMeta, cfg: ModelConfig, tp: int,
                tp_rank: int) -> torch.Tensor:
    """TP shard ``tp_rank`` of the Megatron parameter ``mg_name`` (described by ``meta``), built
    from blocks of its HF sources: equal to ``shard(merge_hf_to_megatron(...), meta, tp, tp_rank)``
    without reading the rest of the tensors."""
    dim = meta.tp_dim if tp > 1 else None
    parts = {name: reader.read(name, dim, tp, tp_rank) for name in hf_sources(mg_name, cfg)}
    if dim is not None:
        # The block of rank r regroups q/k/v with that rank's share of the heads (whole groups).
        cfg = dataclasses.replace(cfg, num_heads=cfg.num_heads // tp,
                                  num_kv_heads=cfg.num_kv_heads // tp)
    return merge_hf_to_megatron(mg_name, parts, cfg)


def load_hf_into_engine(engine, hf_dir: str | os.PathLike) -> None:
    """Load an HF Llama/Qwen2 checkpoint (safetensors) into ``engine``; every rank of the engine
    calls it and reads only what its shards need. The checkpoint's config must equal the engine's
    ModelConfig; any problem with the checkpoint is one ConfigError naming the file and tensor,
    raised on every rank."""
    cfg: ModelConfig = engine.model_config
    # A critic or reward model (head="value") starts from an LM checkpoint: the engine unties its
    # embeddings, and its value head, which no HF LM carries, keeps its fresh initialisation.
    value_head = VALUE_HEAD if getattr(engine, "head", "lm") == "value" else None
    ignore = ("tie_embeddings",) if value_head else ()
    _, weight_map = _checked_weight_map(Path(hf_dir), cfg, ignore)
    tp = engine.layout.tp
    with contextlib.ExitStack() as stack:
        reader = _SliceReader(weight_map, stack)
        for name, param in engine.named_local_params():
            if name == value_head:
                continue
            # The last stage's copy of tied embeddings is a shard of the embedding.
            source = _EMBEDDING if name == _OUTPUT and cfg.tie_embeddings else name
            piece = _read_shard(reader, source, engine.metas[source], cfg, tp, engine.tp_rank)
            if piece.shape != param.shape:  # a mapping bug, not a checkpoint problem
                raise RuntimeError(f"{name}: built a shard of shape {tuple(piece.shape)}, the "
                                   f"model holds {tuple(param.shape)} at {engine.layout}")
            with torch.no_grad():
                param.copy_(piece)
    if engine.optimizer is not None:
        engine.optimizer.reload_model_params()  # the optimizer's main (fp32) copies


def _raise_everywhere(error: BaseException | None) -> None:
    """Collective: if any rank failed, raise on every rank, so that none waits in a later
    collective for a rank that has gone. A ConfigError is re-raised as itself everywhere."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    report = None
    if error is not None:
        field = error.field if isinstance(error, ConfigError) else None
        message = (str(error).removeprefix(f"{field}: ") if field
                   else f"{type(error).__name__}: {error}")
        report = (dist.get_rank(), field, message)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if error is not None:
        raise error
    failed = next((r for r in reports if r is not None), None)
    if failed is not None:
        rank, field, message = failed
        if field is not None:
            raise ConfigError(field, message)
        raise RuntimeError(f"rank {rank} failed: {message}")


def export_engine_to_hf(engine, out_dir: str | os.PathLike,
                        tokenizer_dir: str | os.PathLike | None = None) -> Path:
    """Write the engine's weights as an HF checkpoint (with the tokenizer of ``tokenizer_dir``
    when given). Collective over all ranks; global rank 0 writes, atomically (a temporary
    directory renamed into place), in the engine's dtype. With LoRA adapters the weights are
    merged, and the adapters alone are in its ``lora/`` in PEFT's format."""
    if getattr(engine, "head", "lm") != "lm":
        raise ArgumentError("head", f"an engine with head={engine.head!r} has no HF causal-LM "
                                    "form; export the actor (head='lm')")
    full = engine.full_weights(merged=True)
    write_extra = None
    if engine.adapters is not None:
        adapters = engine.full_adapters()

        def write_extra(tmp: Path) -> None:
            write_peft_adapter(tmp / PEFT_DIR, adapters, engine.model_config,
                               engine.adapters.config)
    error = None
    if dist.get_rank() == 0:
        try:
            tokenizer = None
            if tokenizer_dir is not None:
                import transformers  # deferred: transformers
                tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
            save_hf_checkpoint(out_dir, megatron_to_hf(full, engine.model_config),
                               engine.model_config, tokenizer=tokenizer, write_extra=write_extra)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
    _raise_everywhere(error)  # also the barrier: nobody reads out_dir before it is there
    return Path(out_dir)

"""Hugging Face <-> hybridflow: configs, Megatron-Core names/layouts, and safetensors checkpoints.

Three parts, each usable alone:

* configs: ``model_config_from_hf`` / ``hf_config_from_model_config``;
* names and layouts, the HF view of the parameter table (``models/params.py``): an HF state dict
  (full tensors) <-> Megatron-Core ``GPTModel`` local-spec names (full, unsharded; TP/PP sharding
  is the caller's), one tensor at a time for streaming (``hf_sources`` + ``merge_hf_to_megatron``,
  ``split_megatron_to_hf``) or whole dicts (``hf_to_megatron``, ``megatron_to_hf``);
* checkpoint I/O on HF directories: ``load_hf_state_dict`` / ``save_hf_checkpoint``.

Where Megatron-Core's GPTModel and HF Llama/Qwen2 differ, and what the training side must set:

* RoPE: HF rotates halves (``rotate_half``), Megatron's default ``rotary_interleaved=False`` does
  the same; ``rotary_base`` = ``rope_theta``, ``rotary_percent`` = 1.0. Scaled RoPE (llama3, yarn,
  linear, dynamic, longrope) is not mapped yet: ``model_config_from_hf`` refuses it.
* ``kv_channels`` = ``head_dim``, which need not be hidden/heads; ``num_query_groups`` =
  ``num_key_value_heads``; ``normalization="RMSNorm"``, ``layernorm_epsilon`` = ``rms_norm_eps``;
  ``gated_linear_unit=True`` with SiLU; ``add_bias_linear=False``; ``add_qkv_bias`` = Qwen2's
  q/k/v biases (HF Llama's ``attention_bias`` also biases o_proj, which Megatron cannot express).
* Fused weights (``linear_qkv`` grouped per query group, ``linear_fc1`` = ``[gate; up]``): see
  ``models/params.py``.
* Megatron pads the vocabulary (``make_vocab_size_divisible_by`` x TP) and numbers layers per
  pipeline stage from 0; the names here are for the unpadded vocabulary and global layer indices.
* ``share_embeddings_and_output_weights`` = ``tie_word_embeddings``; with PP > 1 the last stage
  still holds an ``output_layer.weight``, whose source is then ``model.embed_tokens.weight``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from hybridflow.errors import ArgumentError, ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import (hf_shapes, megatron_param_names, merge, model_params,
                                      resolve, split, tied)

# ----------------------------------------------------------------------------------------------
# configs

_ARCHS = {  # model_type -> (our arch, HF class name)
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
}


def _rope(hf_cfg: Any) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from a transformers 4.x (rope_theta + rope_scaling) or 5.x
    (rope_parameters) config; scaling is None for plain RoPE."""
    params = getattr(hf_cfg, "rope_parameters", None)
    if params is None:  # transformers 4.x
        scaling = getattr(hf_cfg, "rope_scaling", None)
        return float(getattr(hf_cfg, "rope_theta", 10000.0)), scaling or None
    params = dict(params)
    theta = float(params.pop("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    return theta, (None if kind == "default" else params)


def model_config_from_hf(hf_cfg: Any) -> ModelConfig:
    """Our ModelConfig from a transformers LlamaConfig or Qwen2Config (or any config of those
    model types). Raises ConfigError for architectures and features we do not map."""
    model_type = getattr(hf_cfg, "model_type", None)
    archs = getattr(hf_cfg, "architectures", None) or []
    if model_type not in _ARCHS:
        raise ConfigError("model", "config.json:architectures: unsupported model "
                                   f"{archs or model_type!r} (model_type={model_type!r}); "
                                   f"supported: {', '.join((cls for _, cls in _ARCHS.values()))}")
    arch = _ARCHS[model_type][0]
    theta, scaling = _rope(hf_cfg)
    if scaling is not None:
        raise ConfigError("model", f"config.json:rope_scaling: scaled RoPE {scaling!r} is not "
                                   "supported yet (Megatron GPTModel is built with plain RoPE "
                                   "here); use a model without rope_scaling")
    act = getattr(hf_cfg, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError("model", f"config.json:hidden_act: {act!r} is not supported; only silu "
                                   "(SwiGLU)")
    if getattr(hf_cfg, "attention_bias", False):
        raise ConfigError("model", "config.json:attention_bias: Llama attention_bias (biases on "
                                   "q, k, v and o_proj) is not supported")
    if getattr(hf_cfg, "mlp_bias", False):
        raise ConfigError("model", "config.json:mlp_bias: MLP biases are not supported")
    if getattr(hf_cfg, "use_sliding_window", False):
        raise ConfigError("model", "config.json:use_sliding_window: sliding-window attention is "
                                   "not supported")
    heads = hf_cfg.num_attention_heads
    return ModelConfig(
        arch=arch,
        vocab_size=hf_cfg.vocab_size,
        hidden_size=hf_cfg.hidden_size,
        ffn_hidden_size=hf_cfg.intermediate_size,
        num_layers=hf_cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads,
        rope_theta=theta,
        rms_norm_eps=float(hf_cfg.rms_norm_eps),
        tie_embeddings=bool(getattr(hf_cfg, "tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",
        max_position_embeddings=hf_cfg.max_position_embeddings,
    )


def hf_config_from_model_config(cfg: ModelConfig, **extra: Any) -> Any:
    """A transformers LlamaConfig / Qwen2Config for ``cfg``; ``extra`` (e.g. eos_token_id) is
    passed through to the config."""
    import transformers  # deferred: transformers

    if cfg.arch == "qwen2" and cfg.qkv_bias is False:
        raise ConfigError("model.qkv_bias", "Qwen2 always has q/k/v biases; set qkv_bias=True")
    if cfg.arch == "llama" and cfg.qkv_bias:
        raise ConfigError("model.qkv_bias", "HF Llama cannot hold q/k/v biases alone; use arch=qwen2")
    cls_name = _ARCHS[cfg.arch][1]
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,  # Qwen2Config has no such field but its attention reads it
        hidden_act="silu",
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        architectures=[cls_name],
    )
    kwargs.update(extra)
    return config_cls(**kwargs)


# ----------------------------------------------------------------------------------------------
# names and layouts: the HF view of the parameter table (models/params.py)

# HF tensors that carry no weights: old checkpoints saved RoPE's inverse frequencies.
_HF_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def hf_param_names(cfg: ModelConfig) -> list[str]:
    """All HF parameter names of the full model (no lm_head when tied), in model order."""
    return list(hf_param_shapes(cfg))


def hf_param_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF name -> (shape, which config fields give it), for the full model, in model order."""
    return {name: shape for p, layer, _ in model_params(cfg)
            for name, shape in hf_shapes(p, layer, cfg).items()}


def hf_sources(mg_name: str, cfg: ModelConfig) -> list[str]:
    """The HF tensors needed to build the Megatron parameter ``mg_name`` (for a streaming loader);
    for the last stage's copy of a tied output layer, the embedding's."""
    p, layer = resolve(mg_name, cfg)
    return list(hf_shapes(p, layer, cfg))


def megatron_name_for_hf(hf_name: str, cfg: ModelConfig) -> str | None:
    """The Megatron parameter the HF tensor ``hf_name`` feeds; None for tensors that carry no
    weights (RoPE inv_freq) and for lm_head.weight of a tied model."""
    if _HF_IGNORED.search(hf_name):
        return None
    p, layer = resolve(hf_name, cfg, "hf")
    return None if tied(p, cfg) else p.megatron.format(i=layer)


def merge_hf_to_megatron(mg_name: str, tensors: dict[str, torch.Tensor], cfg: ModelConfig
                         ) -> torch.Tensor:
    """Build the full Megatron parameter ``mg_name`` from the HF tensors named by
    ``hf_sources(mg_name, cfg)`` (``tensors`` may hold more)."""
    p, _ = resolve(mg_name, cfg)
    names = hf_sources(mg_name, cfg)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ConfigError(missing[0], f"needed for {mg_name} but not in the HF state dict")
    return merge(p, [tensors[n] for n in names], cfg)


def split_megatron_to_hf(mg_name: str, tensor: torch.Tensor, cfg: ModelConfig
                         ) -> dict[str, torch.Tensor]:
    """The HF tensors held by the full Megatron parameter ``mg_name`` (views, no copies)."""
    p, _ = resolve(mg_name, cfg)
    return dict(zip(hf_sources(mg_name, cfg), split(p, tensor, cfg)))


def hf_to_megatron(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full HF state dict -> full Megatron GPTModel state dict (local-spec names)."""
    for name in hf_sd:  # reject stray tensors by name, before any work
        megatron_name_for_hf(name, cfg)
    if cfg.tie_embeddings and "lm_head.weight" in hf_sd:
        lm, emb = hf_sd["lm_head.weight"], hf_sd.get("model.embed_tokens.weight")
        if emb is not None and lm.data_ptr() != emb.data_ptr() and not torch.equal(lm, emb):
            raise ConfigError("model", "lm_head.weight: differs from model.embed_tokens.weight "
                                       "but the config ties them (tie_word_embeddings=true)")
    return {mg: merge_hf_to_megatron(mg, hf_sd, cfg) for mg in megatron_param_names(cfg)}


def megatron_to_hf(mg_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full Megatron state dict -> full HF state dict; ``*._extra_state`` entries (TE/fp8
    metadata) are skipped, and so is output_layer.weight of a tied model."""
    out = {}
    for name, tensor in mg_sd.items():
        if name.endswith("._extra_state") or tied(resolve(name, cfg)[0], cfg):
            continue
        out.update(split_megatron_to_hf(name, tensor, cfg))
    missing = [n for n in hf_param_names(cfg) if n not in out]
    if missing:
        mg = megatron_name_for_hf(missing[0], cfg)
        raise ConfigError(mg, "missing from the Megatron state dict")
    return out


# ----------------------------------------------------------------------------------------------
# checkpoint I/O

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# A fast tokenizer's file, or a slow one's (sentencepiece, BPE vocab, WordPiece vocab).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of a safetensors file, checked against the file's size, so that a
    truncated or corrupt file is reported with the tensor it breaks."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConfigError("model", f"{path}: is not a safetensors file ({size} bytes; "
                                       "truncated?)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ConfigError("model", f"{path}: header of {n} bytes runs past the end of the "
                                       f"file ({size} bytes): truncated or not a safetensors file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError("model", f"{path}: corrupt safetensors header ({e}); re-save the "
                                       "checkpoint")
    if not isinstance(header, dict):
        raise ConfigError("model", f"{path}: corrupt safetensors header (a JSON "
                                   f"{type(header).__name__}, not an object); re-save the "
                                   "checkpoint")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, info in header.items():
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not isinstance(shape, list)
                or not all(isinstance(x, int) for x in offsets + shape)):
            raise ConfigError("model", f"{path}: corrupt safetensors header: tensor {name} "
                                       "lacks integer shape and data_offsets; re-save the "
                                       "checkpoint")
        start, end = offsets
        if end > data_bytes:
            raise ConfigError("model", f"{path}: tensor {name} needs data bytes [{start}, {end}) "
                                       f"but the file holds only {data_bytes}: the file is "
                                       "truncated; copy or save it again")
    return header


def _weight_map(ckpt_dir: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file that holds it."""
    index = ckpt_dir / _INDEX
    if index.exists():
        try:
            entries = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError("model", f"{index}: not valid JSON ({e}); re-save the checkpoint "
                                       "or delete the index of a single-file one") from None
        except (KeyError, TypeError):
            raise ConfigError("model", f"{index}: has no weight_map (tensor name -> file); "
                                       "re-save the checkpoint") from None
        if not isinstance(entries, dict):
            raise ConfigError("model", f"{index}: weight_map must map tensor names to files")
        return {name: ckpt_dir / file for name, file in entries.items()}
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError("model", f"{ckpt_dir}: holds no *.safetensors files (and no {_INDEX}); "
                                   "point to an HF checkpoint directory")
    return {name: f for f in files for name in _safetensors_header(f)}


def load_hf_config(ckpt_dir: str | os.PathLike) -> ModelConfig:
    """ModelConfig from ``ckpt_dir/config.json``."""
    import transformers  # deferred: transformers

    path = Path(ckpt_dir) / "config.json"
    if not path.exists():
        raise ConfigError("model", f"{path}: not found; an HF checkpoint directory needs a "
                                   "config.json")
    try:  # transformers' own message for these names neither the line nor the fix
        raw = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError("model", f"{path}: not valid JSON ({e}); fix it or copy the model's "
                                   "config.json again") from None
    if not isinstance(raw, dict):
        raise ConfigError("model", f"{path}: must be a JSON object of the model's settings, got "
                                   f"a JSON {type(raw).__name__}")
    try:
        hf_cfg = transformers.AutoConfig.from_pretrained(str(path.parent))
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError("model", f"{path}:architectures: transformers cannot read "
                                   f"it: {e}") from None
    try:
        return model_config_from_hf(hf_cfg)
    except ConfigError as e:  # say which config.json
        if e.field == "model":  # model_config_from_hf's own: "config.json:<key>: ..."
            raise ConfigError("model", f"{path.parent}/{e.message}") from None
        raise ConfigError("model", f"{path}: {e}") from None  # a value ModelConfig refuses


def load_tokenizer(ckpt_dir: str | os.PathLike, field: str = "model") -> Any:
    """The transformers tokenizer of an HF checkpoint directory; one that cannot be loaded is a
    ConfigError naming the directory (``field`` is the config key that named it)."""
    import transformers  # deferred: transformers

    if not any((Path(ckpt_dir) / f).exists() for f in _TOKENIZER_FILES):
        raise ConfigError(field, f"{ckpt_dir}: has no tokenizer (none of "
                                 f"{', '.join(_TOKENIZER_FILES)}); copy the model's tokenizer "
                                 "files into it")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(ckpt_dir))
    except Exception as e:  # noqa: BLE001 - transformers raises many types for missing files
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(" :")
        raise ConfigError(field, f"{ckpt_dir}: cannot load its tokenizer ({reason}); copy the "
                                 "model's tokenizer files into it again") from None


def load_hf_state_dict(ckpt_dir: str | os.PathLike, names: list[str] | None = None,
                       cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """Tensors of an HF safetensors checkpoint (single file or sharded with an index); only
    ``names`` are read when given. Shapes are checked against ``cfg`` (default: the directory's
    config.json). Any problem is one ConfigError naming the file and the tensor."""
    from safetensors import SafetensorError, safe_open  # deferred: safetensors

    ckpt_dir = Path(ckpt_dir)
    if cfg is None and (ckpt_dir / "config.json").exists():
        cfg = load_hf_config(ckpt_dir)
    weight_map = _weight_map(ckpt_dir)
    wanted = list(weight_map) if names is None else list(names)
    if cfg is not None and names is None:
        missing = [n for n in hf_param_names(cfg) if n not in weight_map]
        if missing:
            raise ConfigError("model", f"{ckpt_dir}: tensor {missing[0]}: missing from the "
                                       f"checkpoint ({len(missing)} missing in all)")
    expected = hf_param_shapes(cfg) if cfg is not None else {}
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        if name not in weight_map:
            raise ConfigError("model", f"{ckpt_dir}: tensor {name}: not found in the checkpoint")
        by_file.setdefault(weight_map[name], []).append(name)

    out = {}
    for path, file_names in by_file.items():
        if not path.exists():
            raise ConfigError("model", f"{path}: missing (the index lists it for tensor "
                                       f"{file_names[0]})")
        header = _safetensors_header(path)
        for name in file_names:
            if name not in header:
                raise ConfigError("model", f"{path}: tensor {name} is listed in the index but "
                                           "not in the file")
            shape = tuple(header[name]["shape"])
            if name in expected and shape != expected[name][0]:
                want, why = expected[name]
                raise ConfigError("model", f"{path}: tensor {name} has shape {list(shape)}, "
                                           f"expected {list(want)} for {why}")
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in file_names:
                    out[name] = f.get_tensor(name)
        except SafetensorError as e:
            raise ConfigError("model", f"{path}: cannot read tensors "
                                       f"{file_names[:3]}...: {e}") from None
    return out


def _check_hf_sd(hf_sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors of hf_sd to save (lm_head dropped when tied), checked against cfg."""
    expected = hf_param_shapes(cfg)
    for name in hf_sd:
        megatron_name_for_hf(name, cfg)  # raises for names that do not belong
    missing = [n for n in expected if n not in hf_sd]
    if missing:
        raise ConfigError("model", f"tensor {missing[0]}: missing from the state dict to save "
                                   f"({len(missing)} missing in all)")
    for name, (shape, why) in expected.items():
        if tuple(hf_sd[name].shape) != shape:
            raise ConfigError("model", f"tensor {name}: has shape {list(hf_sd[name].shape)}, "
                                       f"expected {list(shape)} for {why}")
    return {n: hf_sd[n] for n in expected}


def _fsync_tree(root: Path) -> None:
    """Flush the files to disk and give them ordinary permissions (mkdtemp makes the directory
    0700 and safetensors writes 0600, which other users of a shared cache could not read)."""
    os.chmod(root, 0o755)
    for p in root.rglob("*"):
        if p.is_file():
            os.chmod(p, 0o644)
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def replace_dir_atomically(tmp: Path, dest: Path) -> None:
    """Move the finished directory ``tmp`` to ``dest`` (same filesystem), replacing what was there;
    ``dest`` never holds a half-written checkpoint."""
    _fsync_tree(tmp)
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old)
    else:
        os.rename(tmp, dest)


def save_hf_checkpoint(ckpt_dir: str | os.PathLike, hf_sd: dict[str, torch.Tensor], cfg: ModelConfig,
                       tokenizer: Any = None, max_shard_bytes: int = 4 << 30,
                       extra_files: dict[str, str] | None = None,
                       write_extra: Callable[[Path], None] | None = None) -> Path:
    """Write an HF checkpoint (safetensors, config.json, the tokenizer if given, ``extra_files``
    name -> text, whatever ``write_extra(directory)`` adds) that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads. Written into a temporary
    directory beside ``ckpt_dir`` and renamed into place."""
    from safetensors.torch import save_file  # deferred: safetensors

    dest = Path(ckpt_dir)
    tensors = _check_hf_sd(hf_sd, cfg)
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ArgumentError("hf_sd", f"mixed dtypes {sorted(map(str, dtypes))}; cast to one first")
    ids = {}
    if tokenizer is not None:
        ids = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    # torch_dtype: the keyword both transformers 4.x and 5.x take (5.x records it as "dtype")
    hf_cfg = hf_config_from_model_config(cfg, torch_dtype=dtypes.pop(), **ids)

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            # clone tied/shared or non-contiguous views: safetensors refuses shared storage
            shards[-1][name] = t.detach().to("cpu").contiguous().clone()
            size += nbytes
        if len(shards) == 1:
            save_file(shards[0], str(tmp / _SINGLE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for k, shard in enumerate(shards, 1):
                file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / file), metadata={"format": "pt"})
                weight_map.update({name: file for name in shard})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (tmp / _INDEX).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        hf_cfg.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        for file, text in (extra_files or {}).items():
            (tmp / file).write_text(text)
        if write_extra is not None:
            write_extra(tmp)
        replace_dir_atomically(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest

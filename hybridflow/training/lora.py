"""LoRA adapters on Megatron-Core's linear layers (Hu et al. 2021, arXiv 2106.09685).

An adapted linear computes ``W x + (alpha / rank) * B A dropout(x)`` with ``A`` [rank, in] and
``B`` [out, rank]; ``B`` starts at zero, so an adapted model starts as its base. The base weights
are frozen: Megatron's DDP gives them no grad buffer and its optimizer no state, so only the
adapters cost gradient and optimizer memory.

Tensor parallelism splits the adapters along the base weight's split, so nothing is gathered:

* column-parallel (``linear_qkv``, ``linear_fc1``: W's rows split): ``B`` is split like W's rows
  (``[gate_r; up_r]`` for fc1, whole query groups for qkv), ``A`` is replicated. ``h = A x`` is
  then the same on every TP rank, and its gradient is the sum of the ranks' ``B_r^T dy_r``: ``h``
  goes through Megatron's copy-to-TP-region (identity forward, all-reduce backward).
* row-parallel (``linear_proj``, ``linear_fc2``: W's columns split): ``A`` is split like W's
  columns, ``B`` is replicated. ``h = sum_r A_r x_r`` is Megatron's reduce-from-TP-region
  (all-reduce forward, identity backward), and ``B h`` is added after the layer's own all-reduce.

The adapters are parameters of the linear modules themselves (``...linear_qkv.lora_A``), so the
model chunks, Megatron's DDP, its optimizer and its distributed checkpoints see them; their
``ParamMeta`` rows (``lora_metas``) carry the TP splits, so ``shard``/``unshard`` work on them like
on any weight. ``Adapters.disabled()`` turns them off (the reference policy is the base model:
no second copy of the weights), and ``Adapters.merged`` gives ``W + (alpha / rank) B A`` per
training shard, which is what the 3D-HybridEngine sends to generation.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.errors import ConfigError, check_float, check_int
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import ParamMeta, llama_param_metas, resolve, shard, split

TARGETS = {"linear_qkv": "column", "linear_proj": "row", "linear_fc1": "column",
           "linear_fc2": "row"}
"""Megatron linear layers LoRA can adapt -> how TP splits them."""

PEFT_TARGETS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
"""The HF (PEFT) modules each Megatron linear is made of, in the merge order of its rows."""


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters on the actor's linear layers (off while rank is 0)."""

    rank: int = 0
    """Adapter rank r; 0 trains the full model."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training."""
    target_modules: list[str] = field(default_factory=lambda: list(TARGETS))
    """Megatron linears to adapt: linear_qkv (q, k, v), linear_proj (o), linear_fc1 (gate, up),
    linear_fc2 (down)."""

    def __post_init__(self) -> None:
        check_int("rank", self.rank, low=0)
        check_float("alpha", self.alpha, low=0, low_open=True)
        check_float("dropout", self.dropout, low=0, high=1, high_open=True)
        targets = list(self.target_modules) if isinstance(self.target_modules, (list, tuple)) \
            else None
        if not targets or any(t not in TARGETS for t in targets) or len(set(targets)) != len(
                targets):
            raise ConfigError("target_modules", f"{self.target_modules!r}: a non-empty list of "
                              f"distinct names from {', '.join(TARGETS)}")
        self.target_modules = targets

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _adapted(name: str, lora: LoraConfig) -> str | None:
    """The target a base weight name belongs to (e.g. "linear_qkv"), or None."""
    for target in lora.target_modules:
        if name.endswith(f".{target}.weight"):
            return target
    return None


def lora_metas(cfg: ModelConfig, lora: LoraConfig) -> list[ParamMeta]:
    """``lora_A`` and ``lora_B`` of every adapted weight (full shapes, TP splits), in model order.
    Their names are the weight's with ``weight`` replaced by ``lora_A`` / ``lora_B``."""
    out = []
    for m in llama_param_metas(cfg):
        target = _adapted(m.name, lora)
        if target is None:
            continue
        prefix, (rows, cols) = m.name.removesuffix("weight"), m.shape
        column = TARGETS[target] == "column"
        out.append(ParamMeta(name=prefix + "lora_A", shape=(lora.rank, cols),
                             tp_dim=None if column else 1, layer=m.layer, position=m.position))
        out.append(ParamMeta(name=prefix + "lora_B", shape=(rows, lora.rank),
                             tp_dim=0 if column else None, tp_chunks=m.tp_chunks if column else 1,
                             layer=m.layer, position=m.position))
    return out


def lora_param_counts(cfg: ModelConfig, lora: LoraConfig) -> tuple[int, int]:
    """(parameters of the adapted base weights, parameters of their adapters) of the full model."""
    adapted = sum(m.numel for m in llama_param_metas(cfg) if _adapted(m.name, lora))
    return adapted, sum(m.numel for m in lora_metas(cfg, lora))


def base_weight(adapter_name: str) -> str:
    """``...linear_qkv.lora_A`` -> ``...linear_qkv.weight``."""
    return adapter_name.rsplit(".", 1)[0] + ".weight"


def initial_adapters(metas: list[ParamMeta], seed: int) -> dict[str, torch.Tensor]:
    """Full initial adapters, the same in every process and at every layout: ``A`` uniform in
    +-1/sqrt(in) (PEFT's default, kaiming-uniform with a=sqrt(5)), ``B`` zero."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in metas:
        if m.name.endswith("lora_A"):
            bound = 1.0 / math.sqrt(m.shape[1])
            out[m.name] = (torch.rand(m.shape, generator=g) * 2 - 1) * bound
        else:
            out[m.name] = torch.zeros(m.shape)
    return out


class Adapters:
    """The LoRA adapters of one rank's model chunks: attaches them, switches them off, merges
    them into the base weights."""

    def __init__(self, lora: LoraConfig, metas: list[ParamMeta]):
        self.config, self.metas = lora, {m.name: m for m in metas}
        self.enabled = True
        self.modules: dict[str, torch.nn.Module] = {}  # base weight name -> its linear

    def attach(self, module: torch.nn.Module, weight_name: str, init: dict[str, torch.Tensor],
               tp: int, tp_rank: int) -> None:
        """Give ``module`` (a Megatron linear whose weight is ``weight_name``, global) its
        adapters, this rank's shards of ``init``."""
        prefix = weight_name.removesuffix("weight")
        weight = module.weight
        for part in ("lora_A", "lora_B"):
            full = init[prefix + part].to(weight.dtype)
            module.register_parameter(part, torch.nn.Parameter(
                shard(full, self.metas[prefix + part], tp, tp_rank).to(weight.device)))
        column = TARGETS[_adapted(weight_name, self.config)] == "column"
        # See the module docstring: A x is whole on every rank (column) or a partial sum (row).
        group = module.tp_group if tp > 1 else None
        module.register_forward_hook(functools.partial(self._hook, column=column, group=group))
        _checkpoint_adapters(module, column, fc1=weight_name.endswith("linear_fc1.weight"))
        self.modules[weight_name] = module

    def _input(self, module, x: torch.Tensor) -> torch.Tensor:
        """The adapter's input: ``x``, through dropout while training."""
        if module.training and self.config.dropout:
            return F.dropout(x, self.config.dropout)
        return x

    def _hook(self, module, args, output, column: bool, group):
        """Megatron linear's (output, bias) plus the adapter's ``scaling * B region(A x)``."""
        if not self.enabled:
            return output
        out, bias = output
        return _LoraAdd.apply(out, self._input(module, args[0]), module.lora_A, module.lora_B,
                              self.config.scaling, column, group), bias

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The base model: the adapters add nothing inside this block."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def merged(self, shards: dict[str, torch.Tensor], in_place: bool = False
               ) -> dict[str, torch.Tensor]:
        """``shards`` (this rank's training shards by name) with each adapted weight replaced by
        its shard of ``W + (alpha / rank) B A``: a column-parallel shard takes its rows of B, a
        row-parallel one its columns of A, so no rank needs another's. A new tensor, or with
        ``in_place`` the shard itself overwritten (the base is then gone until restored)."""
        return merge_adapters(shards, dict(self.named_parameters()), self.config.scaling,
                              in_place)

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(global name, local shard) of every adapter this rank holds."""
        for name, module in self.modules.items():
            prefix = name.removesuffix("weight")
            yield prefix + "lora_A", module.lora_A
            yield prefix + "lora_B", module.lora_B


class _LoraAdd(torch.autograd.Function):
    """``out + scaling * B region(A x)`` as one autograd node of six GEMMs (two forward, four
    backward; the scaling and the add folded into ``addmm``), where autograd's graph of the
    same sum (two linears, a TP region, a multiply and an add, forward and backward) launched
    about ten kernels and five nodes per adapted linear: the frozen base's update, whose device
    time is two thirds of full fine-tuning's, was then host-bound and slower than it. The TP
    region: ``group`` None (tp = 1) or the layer's TP group; ``column`` (A replicated: h is
    whole on every rank, its gradient the sum over the ranks) or row-parallel (A split: h is
    the sum of the ranks' partial products)."""

    @staticmethod
    def forward(ctx, out, x, a, b, scaling: float, column: bool, group):
        x2 = x.reshape(-1, x.shape[-1])
        h = x2 @ a.t()  # [tokens, r]
        if group is not None and not column:
            dist.all_reduce(h, group=group)
        ctx.save_for_backward(x2, a, b, h)
        ctx.scaling, ctx.column, ctx.group, ctx.x_shape = scaling, column, group, x.shape
        return torch.addmm(out.reshape(-1, out.shape[-1]), h, b.t(),
                           alpha=scaling).view(out.shape)

    @staticmethod
    def backward(ctx, grad):
        x2, a, b, h = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_b = (g2.t() @ h).mul_(ctx.scaling) if ctx.needs_input_grad[3] else None
        gh = (g2 @ b).mul_(ctx.scaling)
        if ctx.group is not None and ctx.column:
            dist.all_reduce(gh, group=ctx.group)
        grad_a = gh.t() @ x2 if ctx.needs_input_grad[2] else None
        grad_x = (gh @ a).view(ctx.x_shape) if ctx.needs_input_grad[1] else None
        return grad, grad_x, grad_a, grad_b, None, None, None


@torch.no_grad()
def merge_adapters(weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
                   scaling: float, in_place: bool = False) -> dict[str, torch.Tensor]:
    """``weights`` with each weight that ``adapters`` adapt replaced by ``W + scaling * B A``
    (computed in fp32, stored in W's dtype). Full tensors or one rank's shards alike.
    ``in_place``: written into the weights' own memory (the same numbers), one fp32 transient
    of one weight at a time."""
    out = dict(weights)
    for name, a in adapters.items():
        if name.endswith("lora_A"):
            w = weights[base_weight(name)]
            # One fp32 transient: scaling * (B A) + W, the same sum as W + scaling * (B A).
            merged = (adapters[name.removesuffix("A") + "B"].float() @ a.float()).mul_(
                scaling).add_(w)
            out[base_weight(name)] = w.copy_(merged) if in_place else merged.to(w.dtype)
    return out


def _checkpoint_adapters(module: torch.nn.Module, column: bool, fc1: bool) -> None:
    """Megatron's linears checkpoint their state dict with only ``weight``/``bias`` split over TP
    (anything else as replicated): give the adapters their own splits, and fc1's B the [gate; up]
    handling Megatron's MLP gives fc1's weight, so a checkpoint loads at any TP."""
    # deferred: Megatron
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
    own = module.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        out = own(prefix, sharded_offsets, metadata)
        adapters = make_sharded_tensors_for_checkpoint(
            {"lora_A": module.lora_A, "lora_B": module.lora_B}, prefix,
            {"lora_B": 0} if column else {"lora_A": 1}, sharded_offsets,
            tp_group=module.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if fc1:
            key = f"{prefix}lora_B"
            adapters[key] = apply_swiglu_sharded_factory(adapters[key], sharded_offsets)
        return out | adapters
    module.sharded_state_dict = sharded_state_dict


PEFT_DIR = "lora"
"""Where an HF export of a LoRA checkpoint keeps its PEFT adapter (inside the export)."""


def peft_state_dict(adapters: dict[str, torch.Tensor], cfg: ModelConfig
                    ) -> dict[str, torch.Tensor]:
    """Full adapters (Megatron names) -> PEFT's LoRA tensors for the HF model: a fused Megatron
    linear's A is every HF module's A (q, k and v see the same input), its B splits by rows
    as the weight does."""
    out = {}
    for name, a in adapters.items():
        if not name.endswith("lora_A"):
            continue
        row, layer = resolve(base_weight(name), cfg)
        bs = split(row, adapters[name.removesuffix("A") + "B"], cfg)
        for hf_name, b in zip(row.hf, bs):
            prefix = "base_model.model." + hf_name.format(i=layer).removesuffix("weight")
            out[prefix + "lora_A.weight"] = a.contiguous().clone()
            out[prefix + "lora_B.weight"] = b.contiguous().clone()
    return out


def write_peft_adapter(out_dir: Path, adapters: dict[str, torch.Tensor], cfg: ModelConfig,
                       lora: LoraConfig) -> None:
    """``adapter_config.json`` and ``adapter_model.safetensors`` in ``out_dir``:
    ``peft.PeftModel.from_pretrained(base_model, out_dir)`` loads them."""
    from safetensors.torch import save_file  # deferred: safetensors
    out_dir.mkdir(parents=True, exist_ok=True)
    modules = sorted({m for t in lora.target_modules for m in PEFT_TARGETS[t]})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
              "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": modules,
              "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "inference_mode": True, "base_model_name_or_path": None}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(peft_state_dict(adapters, cfg), str(out_dir / "adapter_model.safetensors"),
              metadata={"format": "pt"})

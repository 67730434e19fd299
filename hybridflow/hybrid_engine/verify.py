"""Fingerprints of a weight sync: what the receiver holds is checked against what the senders sent.

A parameter's fingerprint samples it: ``SAMPLE`` positions of its *full* tensor, a fixed function
of the full shape alone (every process agrees which, without talking), one in each of ``SAMPLE``
equal runs of its flat index, at a hashed place inside the run, so that any contiguous region of
two runs holds a sample and the samples spread over the columns. Each sampled element's raw bits
(as an unsigned integer, folded to 32 bits) are multiplied by a weight that is a hash of its
global flat position, below ``2**20``, and the products are added up as int64:

    fingerprint = sum_k  weight(p_k) * bits(x[p_k])

Integer arithmetic makes it exact and independent of the order of the additions (each product is
below ``2**52``, ``SAMPLE`` of them below ``2**63``), so partial sums from different processes add
up to the same number, bit for bit, and any changed bit of a sampled element changes it. The
weights make it position-sensitive: two shards swapped, a fused ``linear_qkv`` whose q/k/v blocks
are permuted, a tensor left zero or holding the previous version's values sum to something else.

A shard's fingerprint is the sum over the samples that fall inside it (``locate``): a TP shard at
any TP size (``tp_chunks`` split on their own, as ``models.params.shard`` cuts them), and a
generation shard held stacked (``[s, *training shard]``, ``plan_reshard(blocks=True)``). Every
sampled position lies in exactly one training shard, so the fingerprint of a generation shard is
the sum of the partial fingerprints its training shards' owners compute on the sending side: what
``SyncCheck`` (in the switch) and a push between separate pools can both use. The shape, dtype
and byte length are compared as they are.

The cost is O(samples), not O(elements): one indexed read per tensor, one vectorised weighting and
one ``index_add`` per side, and one all-reduce of an int64 vector of one entry per generation
tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from hybridflow.errors import RunError
from hybridflow.hybrid_engine.plan import ReshardPlan
from hybridflow.models.params import ParamMeta, num_layers_of, owner_stage

VERIFY_MODES = ("every", "first", "off")
"""``weight_sync.verify``: check every sync, the first of each process only, or none."""


def verified(mode: str, sync: int) -> bool:
    """Whether sync number ``sync`` (1-based, of this process: a switch or a push) is checked
    under ``weight_sync.verify`` ``mode``."""
    return mode == "every" or (mode == "first" and sync == 1)


SAMPLE = 256
"""Sampled elements per parameter (all of them when it has fewer)."""

_HASH = 2654435761  # Knuth's multiplicative hash
_WEIGHT_BITS = 20


class WeightSyncError(RunError):
    """A generation tensor arrived different from what the training shards sent."""

    def __init__(self, tensor: str, gen_tp_rank: int, gen_pp_rank: int, version: int,
                 detail: str):
        self.tensor, self.gen_tp_rank, self.gen_pp_rank = tensor, gen_tp_rank, gen_pp_rank
        self.version, self.detail = version, detail
        super().__init__(f"weight sync {version}: {tensor} (generation shard tp {gen_tp_rank}, "
                         f"pp {gen_pp_rank}) {detail}; the generation weights are not the "
                         f"trained ones, so the run stops before sampling with them (report it "
                         f"with the layouts; weight_sync.verify=off skips this check)")

    def __reduce__(self):
        return type(self), (self.tensor, self.gen_tp_rank, self.gen_pp_rank, self.version,
                            self.detail)


@dataclass(frozen=True)
class Sample:
    """The sampled positions of a full tensor: coordinates ``[k, ndim]`` and weights ``[k]``
    (int64)."""

    coords: torch.Tensor
    weights: torch.Tensor


def sample(shape: Sequence[int], size: int = SAMPLE) -> Sample:
    """The positions the fingerprint of a tensor of full ``shape`` reads (see the module
    docstring): a function of ``shape`` and ``size`` alone."""
    numel = math.prod(shape)
    n = min(size, numel)
    k = torch.arange(n, dtype=torch.int64)
    start = k * numel // n
    run = (k + 1) * numel // n - start  # n <= numel: every run has an element
    flat = start + (k * _HASH) % run
    # odd, so never 0; (flat mod a prime) keeps the product below 2**52, no overflow
    weights = (((flat % 1000003) * _HASH) >> 12) % (1 << _WEIGHT_BITS) | 1
    coords = torch.stack(torch.unravel_index(flat, tuple(shape)), dim=1)
    return Sample(coords, weights)


def locate(meta: ParamMeta, smp: Sample, tp: int = 1, rank: int = 0, blocks: int = 1
           ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The samples of ``meta`` inside TP shard ``rank`` of ``tp`` (the whole tensor for a
    replicated one): their index into that shard (one index tensor per dim, for advanced
    indexing) and their weights. ``blocks > 1``: the shard is held as ``blocks`` training shards
    (TP size ``tp * blocks``) stacked, ``[blocks, *training shard]``."""
    if blocks > 1:
        parts = [locate(meta, smp, tp * blocks, rank * blocks + j) for j in range(blocks)]
        block = torch.cat([torch.full_like(p[1], j) for j, p in enumerate(parts)])
        index = (block, *(torch.cat(dims) for dims in zip(*(p[0] for p in parts))))
        return index, torch.cat([p[1] for p in parts])
    coords = smp.coords
    if meta.tp_dim is None or tp == 1:
        return tuple(coords.unbind(1)), smp.weights
    d = meta.tp_dim
    chunk = meta.shape[d] // meta.tp_chunks  # tp_chunks split on their own ([gate; up])
    per = chunk // tp
    x = coords[:, d]
    inside = (x % chunk) // per == rank
    local = coords[inside].clone()
    local[:, d] = (x[inside] // chunk) * per + x[inside] % per
    return tuple(local.unbind(1)), smp.weights[inside]


class Probe:
    """Partial fingerprints of named tensors into numbered slots: each entry reads the samples
    ``locate`` gave of one tensor (as flat offsets into it, ``torch.take``) and adds them to its
    slot. Built once (the layouts are fixed), run at every sync."""

    def __init__(self, slots: int):
        self.slots = slots
        self.names: list[str] = []
        self._flat: list[torch.Tensor] = []
        self._weights: list[torch.Tensor] = []
        self._slot: list[torch.Tensor] = []
        self._cache: dict[torch.device, tuple] = {}

    def add(self, name: str, slot: int, located: tuple[tuple[torch.Tensor, ...], torch.Tensor],
            shape: Sequence[int]) -> None:
        """Read the samples ``located`` of tensor ``name``, of ``shape``, into ``slot``."""
        index, weights = located
        flat = torch.zeros_like(weights)
        for i, stride in zip(index, _strides(shape)):
            flat += i * stride
        self.names.append(name)
        self._flat.append(flat)
        self._weights.append(weights)
        self._slot.append(torch.full_like(weights, slot))

    def __call__(self, tensors: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor:
        """int64 ``[slots]`` on ``device``: each slot's sum of its entries' weighted sampled bits
        (``tensors`` holds every entry's name, each of the shape it was added with)."""
        out = torch.zeros(self.slots, dtype=torch.int64, device=device)
        if not self.names:
            return out
        if device not in self._cache:
            self._cache[device] = ([f.to(device) for f in self._flat],
                                   torch.cat(self._weights).to(device),
                                   torch.cat(self._slot).to(device))
        flats, weights, slot = self._cache[device]
        values = torch.cat([torch.take(tensors[name].detach(), flat)
                            for name, flat in zip(self.names, flats)])
        return out.index_add_(0, slot, bits(values) * weights)


def _strides(shape: Sequence[int]) -> list[int]:
    """Element strides of a contiguous tensor of ``shape``."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return out[::-1]


def bits(values: torch.Tensor) -> torch.Tensor:
    """The raw bits of each element of a contiguous 1-D tensor as a non-negative int64 below
    ``2**32`` (8-byte elements folded: high xor low half)."""
    size = values.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    raw = values.contiguous().view(as_int).to(torch.int64)
    if size == 8:
        raw = (raw ^ (raw >> 32))
    return raw & 0xFFFFFFFF


def fingerprint(tensor: torch.Tensor, meta: ParamMeta, tp: int = 1, rank: int = 0,
                blocks: int = 1, size: int = SAMPLE) -> int:
    """The fingerprint of ``tensor``, TP shard ``rank`` of ``tp`` of ``meta`` (stacked as
    ``blocks`` training shards if > 1): the sum over the samples of the full tensor inside it."""
    index, weights = locate(meta, sample(meta.shape, size), tp, rank, blocks)
    values = tensor.detach()[tuple(i.to(tensor.device) for i in index)]
    return int((bits(values.reshape(-1)) * weights.to(tensor.device)).sum())


class SyncCheck:
    """One rank's check of the train -> generation switch (``HybridEngine``).

    Its generation tensors are those of its generation stage at its generation TP rank, the same
    for every member of its micro-DP group, and that group's members hold every training shard
    they are made of. Before the gather each member sums, per generation tensor, the samples of
    the training shards it sends (``sent``: a TP-split parameter's own shard; a replicated one by
    the member at TP offset 0 of its stage only, so that it is counted once; an embedding split
    with its tied copy, ``ReshardPlan.tied``, by the first stage for its first rows and by the
    last stage, from the copy, for the rest); after it, one
    all-reduce over the group gives the expected fingerprints, and ``verify`` compares them with
    the ones recomputed from the tensors the rank holds (``held``)."""

    def __init__(self, plan: ReshardPlan, rank: int, stacked: bool):
        """``stacked``: the tensors are the plan's (``gather_generation_weights``), stacked where
        ``GenParam.blocks > 1``; False: all in the standard layout (``naive_gather``)."""
        rp = plan.ranks[rank]
        gen, train = plan.gen, plan.gen.train
        self.gen_tp_rank, self.gen_pp_rank = rp.gen_tp_rank, rp.gen_pp_rank
        self.names = list(rp.stage.params)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.sent, self.held = Probe(len(self.names)), Probe(len(self.names))
        metas = {m.name: m for m in plan.metas}
        num_layers = num_layers_of(list(plan.metas))
        _, pp_rank, tp_rank = train.coords(rank)
        tied = plan.tied if stacked else None  # naive_gather sends the embedding whole
        for slot, (name, gp) in enumerate(rp.stage.params.items()):
            m = metas[name]
            smp = sample(m.shape)
            blocks = gp.blocks if stacked else 1
            self.shapes[name] = gp.shape if stacked else m.shard_shape(gen.tp)
            self.held.add(name, slot, locate(m, smp, gen.tp, rp.gen_tp_rank, blocks),
                          self.shapes[name])
            if tied is not None and name == tied.embedding:
                # its first rows from the embedding, the rest from the last stage's copy
                first = pp_rank != train.pp - 1
                if pp_rank not in (0, train.pp - 1):
                    continue
                index, weights = locate(m, smp, train.tp, tp_rank)
                keep = (index[0] < tied.row) == first
                self.sent.add(name if first else tied.copy.name, slot,
                              (tuple(i[keep] for i in index), weights[keep]),
                              m.shard_shape(train.tp))
                continue
            if owner_stage(m, train.pp, num_layers, train.last_stage_layers) != pp_rank:
                continue
            if m.tp_dim is not None:
                self.sent.add(name, slot, locate(m, smp, train.tp, tp_rank),
                              m.shard_shape(train.tp))
            elif tp_rank % gen.tp_stride == 0:
                self.sent.add(name, slot, locate(m, smp), m.shape)

    def verify(self, sent: torch.Tensor, tensors: Mapping[str, torch.Tensor], group,
               dtype: torch.dtype, version: int) -> None:
        """Raise ``WeightSyncError`` for the first generation tensor in ``tensors`` that is
        missing, of another shape or dtype, or whose fingerprint differs from the sum of the
        group's ``sent`` partials (this rank's is ``sent``; collective over ``group``, None for a
        group of one). Every member takes part in the all-reduce before any raises; the rank
        holding the faulty tensor raises."""
        if group is not None:
            dist.all_reduce(sent, group=group)

        def fail(name: str, detail: str):
            return WeightSyncError(name, self.gen_tp_rank, self.gen_pp_rank, version, detail)

        for name in self.names:
            t = tensors.get(name)
            if t is None:
                raise fail(name, "is missing from the generation weights")
            want = (self.shapes[name], dtype)
            if (tuple(t.shape), t.dtype) != want:
                raise fail(name, f"arrived as {t.dtype} {tuple(t.shape)} "
                                 f"({t.numel() * t.element_size()} bytes), expected {dtype} "
                                 f"{self.shapes[name]} ({math.prod(want[0]) * _size(dtype)} bytes)")
        held = self.held(tensors, sent.device)
        bad = (held != sent).nonzero()
        if bad.numel():
            k = int(bad[0])
            raise fail(self.names[k], f"arrived with fingerprint {int(held[k])}, the training "
                                      f"shards sent {int(sent[k])}")


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

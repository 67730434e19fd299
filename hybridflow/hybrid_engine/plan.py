"""The reshard plan: which slice of which training shard goes where, so that one all-gather per
bucket in each micro-DP group builds the generation weights (HybridFlow, arXiv 2409.19256, sec. 5).

Pure: layouts and parameter metadata in, a frozen plan out; no process, no tensor.

How a micro-DP group gathers. Its ``n = s*q`` members (``s = t/tg`` TP shards, ``q = p/pg``
training stages merged into the generation stage) are numbered ``member = i*s + j`` for training
stage ``i`` of the merge and TP offset ``j`` (the order of ``GenLayout.micro_dp_groups``, which is
also the order of the global ranks, hence of the group ranks). Every bucket is one all-gather of
``n`` equal segments of ``seg_numel`` elements; member ``m`` packs its pieces into segment ``m``
and pads the rest. What member ``(i, j)`` contributes:

* a TP-split parameter of stage ``i``: its whole training shard. The generation shard at gen tp
  rank ``g`` is the concatenation along ``tp_dim`` of training shards ``g*s .. g*s+s-1``, except
  ``tp_chunks=2`` (SwiGLU ``linear_fc1``), whose generation shard is [gate_g; up_g] with gate_g the
  concatenation of the ``s`` gate halves: packed, the chunks come out of the buffer as
  [gate_0; up_0; gate_1; up_1; ...] and need a local re-arrangement (mode ``"rearrange"``); a
  direct row sends the gate halves and the up halves in two all-gathers instead (see Views).
* a replicated parameter (norms) of stage ``i``: nothing when ``q == 1`` (every member already has
  it, the generation tensor is the training tensor: mode ``"alias"``); else the ``j``-th of ``s``
  near-equal flat slices, so the ``s`` TP peers of stage ``i`` share the sending.

Bucketing. Parameters are arranged in *rows* aligned across the merged stages: row ``(slot, k)``
holds the ``k``-th parameter of local layer ``slot`` of every stage, which has the same shape on
every stage, so member segments are equally full and layer rows need no padding (but where the
training split is uneven, ``layout.last_stage_layers``: a last stage with fewer layers than the
stages merged with it pads its segments of the rows past its layers; one with more, the others).
Parameters outside the layers (embedding on the first stage; final norm and output layer on the
last) form extra rows, TP-split and replicated ones apart, largest first, so that the embedding and
the output layer share a row when both are in the group. Generation stages merge consecutive
training stages (``GenLayout``), so they hold the layers of those, whichever the split.

Direct rows. A row whose all-gather reaches ``min_view_bytes`` gets a bucket of its own in which
every member's segment is one contiguous slice of one training shard (the whole shard, or one half
of a SwiGLU ``linear_fc1`` shard): the executor all-gathers straight from the training tensor, so
nothing is packed, and where the rank's shard already lives in its own segment
(``resident_offsets``) the all-gather is in place and the shard is not duplicated. Smaller rows
(norms, tiny layers) are packed: consecutive rows fill a bucket up to ``bucket_bytes``.

Views. A generation tensor is a view into the gathered storage when its chunks, taken in
generation order, are adjacent there. With ``s == 1`` every generation tensor is one chunk: all are
views. With ``s > 1`` a tensor split along dim 0 is adjacent only if it is alone in its segments,
which a direct row is (``linear_qkv``, embedding, output layer; ``linear_fc1`` as a gate row and an
up row when ``q == 1``). Row-parallel weights (``tp_dim=1``: ``linear_proj``, ``linear_fc2``)
interleave, and so does fc1 when ``q > 1``: their direct rows land in transient buffers
(``storage_offset is None``) and one strided copy per tensor puts them into the storage (mode
"concat"); packed parameters are copied likewise (fc1 packed with ``q > 1``: "rearrange").

Stacked generation shards (``blocks=True``, for a rollout that computes with them, the fast
decoder). With ``s > 1`` every TP-split row is direct, each member sending its whole training
shard, and kept: the ``s`` shards that make one generation shard are then adjacent in the storage,
so every TP-split parameter is a view, held as its training shards stacked, ``[s, *shard]``, for
row-parallel weights and fc1 (``models.params.stacked_layout``; their standard layouts would
interleave the shards) and in its standard layout for the other dim-0 splits, which is the same
memory. Each rank's own shard is then one whole piece of a kept bucket: every training shard can
be resident, TP merges included (``resident_offsets``), and the generation weights keep no second
copy of any. The bytes sent are the same as without; only replicated parameters with ``q > 1``
and ``s > 1`` (norms, a few KiB per layer) are still copied.

Communication. ``recv_bytes`` of a rank is the payload of the other members' segments: its
generation shard minus its own training shard (plus, when ``q > 1`` and ``s > 1``, the
``(s-1)/s`` of its own stage's replicated parameters that its TP peers send). For a model whose
parameters are all TP-split and evenly spread over the stages this is the paper's Table 2 volume
``(t*p - tg*pg) / (tg*pg*t*p) * M`` exactly. Replicated parameters (norms) are not divided by
TP, so the formula does not count them right: they cost nothing when ``q == 1`` and a full copy per
other merged stage when ``q > 1``. Pre/post parameters live on one stage only: a rank of
stage 0 already holds the embedding shard and receives that much less, the others receive it, and
the members whose stage lacks a matching pre/post parameter pad their segments for that row:
``padding_bytes`` (received by a rank, not counted in ``recv_bytes``). With equal segments the
padding is the least possible: the busiest member sets the total all-gather size. (A tied
embedding split with its copy moves the ranks' ``recv_bytes`` but not their sum; next paragraph.)

Tied embeddings (``tied_copy``). A model whose output layer is tied to its embedding keeps, with
``pp > 1``, a copy of the embedding on the last training stage (``output_layer.weight``, which
Megatron keeps equal to it by all-reducing their grads over the embedding group). Where it is no
generation parameter of its own (one generation stage: ``pg == 1``) and each generation shard is
one training shard (``s == 1``), that copy is a second source of the embedding's row: the member
of stage 0 sends the first ``ceil(rows/2)`` rows of its shard, the member of the last stage the
rest from its copy, so the segments are half a shard and neither pads one for the other
(``TiedSplit``). Otherwise the last stage's member pads a whole embedding-sized segment, which an
all-gather (NCCL) sends: for Llama-3.2-1B shapes at PP=2 -> 1, 0.489 GiB of padding received by
stage 0's rank; now 0, and each of the two ranks receives half the embedding (stage 0 the half it
already has: the all-gather gives every member every segment), so the larger ``recv_bytes``
drops by half an embedding and the group's sum is unchanged. At ``q == 2`` the two halves are
adjacent in the gathered buffer and the embedding stays a view; with ``q > 2`` the middle stages
pad half segments and the halves are copied out of a transient buffer ("concat"). The embedding
of stage 0 is then no longer one whole piece, so it is not resident (``resident_offsets``): its
generation storage holds the embedding beside the training one, as the last stage's already did
beside its copy, and the larger of the two ranks' memory is unchanged. With TP merges (``s > 1``)
the halves would interleave in the gathered buffer, so the copy is not used there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridflow.models.params import (ParamMeta, num_layers_of, owner_stage, stacked_layout,
                                      stage_layers)
from hybridflow.parallel.layout import GenLayout, LayoutError

MODES = ("alias", "view", "concat", "rearrange")


@dataclass(frozen=True)
class Piece:
    """A slice of one rank's flattened training shard, packed into its segment of a bucket."""

    name: str
    offset: int
    """Start in the flattened training shard."""
    numel: int
    dst: int
    """Start in the rank's segment."""


@dataclass(frozen=True)
class Bucket:
    """One all-gather of ``members`` segments of ``seg_numel`` elements."""

    seg_numel: int
    pieces: tuple[tuple[Piece, ...], ...]
    """Per member of the micro-DP group, what it packs (in segment order)."""
    storage_offset: int | None
    """Where the gathered buffer lives in the generation storage (generation tensors are views
    into it); None for a transient buffer whose parameters are all copied out."""

    @property
    def members(self) -> int:
        return len(self.pieces)

    @property
    def numel(self) -> int:
        return self.members * self.seg_numel

    def payload(self, member: int) -> int:
        return sum(p.numel for p in self.pieces[member])

    def extent(self, member: int) -> int:
        """Elements at the start of ``member``'s segment that its pieces span; the rest of the
        segment is padding."""
        return max((p.dst + p.numel for p in self.pieces[member]), default=0)

    def direct(self, member: int) -> Piece | None:
        """The one piece that fills ``member``'s segment, which it can send straight from its
        training shard; None when it packs several pieces or pads."""
        pieces = self.pieces[member]
        if len(pieces) == 1 and pieces[0].dst == 0 and pieces[0].numel == self.seg_numel:
            return pieces[0]
        return None


@dataclass(frozen=True)
class Chunk:
    """A block of a generation tensor as it sits in a gathered bucket."""

    bucket: int
    member: int
    offset: int
    """Start inside the member's segment."""
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GenParam:
    """How one generation tensor is obtained from the gathered buckets."""

    name: str
    shape: tuple[int, ...]
    """Generation shard shape: the standard one, or ``(blocks, *training shard shape)``."""
    mode: str
    """"alias": the rank's own training tensor; "view": a view into the storage; "concat": the
    chunks joined along cat_dim into the storage; "rearrange": the same, but the chunks are not in
    buffer order (fc1 = [gate; up] gathered as [gate_0; up_0; gate_1; up_1])."""
    chunks: tuple[Chunk, ...]
    """In generation order; empty for "alias"."""
    cat_dim: int
    """The chunks, viewed with their shapes, are concatenated along this dim ..."""
    cat_shape: tuple[int, ...]
    """... into this shape (``shape``, or the flat size for replicated pieces), then reshaped."""
    storage_offset: int | None
    """Start of the tensor in the generation storage (None for "alias")."""
    blocks: int = 1
    """> 1: the tensor holds the generation shard as that many training shards stacked
    (``plan_reshard(blocks=True)``; ``models.params.unstack`` gives the standard layout)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StagePlan:
    """What every micro-DP group of one generation pipeline stage gathers; the same for all its
    groups (every gen tp rank, every replica): only the ranks differ."""

    gen_pp_rank: int
    members: int
    buckets: tuple[Bucket, ...]
    params: dict[str, GenParam] = field(hash=False)
    """Generation tensors of this stage, in model order."""
    storage_numel: int
    """Elements of the generation storage: kept buckets, then copied parameters."""


@dataclass(frozen=True)
class RankPlan:
    """One rank's part: its micro-DP group, its pieces and its traffic."""

    rank: int
    group: tuple[int, ...]
    """The micro-DP group's global ranks, in member order."""
    member: int
    gen_tp_rank: int
    gen_pp_rank: int
    stage: StagePlan
    send_bytes: int
    """Payload this rank contributes (each peer receives it once)."""
    recv_bytes: int
    """Payload received from the other members (padding excluded)."""
    padding_bytes: int
    """Padding in the other members' segments, received and thrown away."""

    @property
    def buckets(self) -> tuple[tuple[Piece, ...], ...]:
        """Per bucket, the (name, offset, numel, dst) pieces of this rank's training shards."""
        return tuple(b.pieces[self.member] for b in self.stage.buckets)


@dataclass(frozen=True)
class ReshardPlan:
    gen: GenLayout
    metas: tuple[ParamMeta, ...]
    dtype_bytes: int
    bucket_bytes: int
    blocks: bool
    """Generation shards of TP merges may be stacked training shards (see the module docstring)."""
    stages: tuple[StagePlan, ...]
    """Per generation pipeline stage."""
    ranks: tuple[RankPlan, ...]
    """Per global rank."""
    tied: TiedSplit | None = None
    """How the embedding's row is split with its tied copy (``plan_reshard(tied_copy=...)``);
    None where the copy is not used."""

    def source_metas(self) -> dict[str, ParamMeta]:
        """{name: meta} of every training shard the plan reads: ``metas`` and the tied copy."""
        out = {m.name: m for m in self.metas}
        if self.tied is not None:
            out[self.tied.copy.name] = self.tied.copy
        return out

    def groups(self) -> list[tuple[int, ...]]:
        """All micro-DP groups, in the order ``GenLayout.micro_dp_groups`` gives them."""
        return [tuple(g) for g in self.gen.micro_dp_groups()]


@dataclass(frozen=True)
class TiedSplit:
    """The embedding's row sent half by its owner, half by the last stage's tied copy."""

    embedding: str
    copy: ParamMeta
    """The last training stage's copy (a tied output layer): same shape and split."""
    row: int
    """First row of each training shard that the copy's holders send; the rows before it the
    embedding's holders send."""


@dataclass
class _Row:
    """Units of packing: per member, (name, offset, numel) slices of training shards."""

    slices: list[list[tuple[str, int, int]]]
    solo: bool
    """A direct row: a bucket of its own, each member's slice sent as it is."""
    keep: bool = False
    """For a solo row: its gathered buffer is part of the generation storage (views into it)."""

    @property
    def sizes(self) -> list[int]:
        return [sum(n for _, _, n in s) for s in self.slices]


def plan_reshard(gen: GenLayout, metas: list[ParamMeta], dtype_bytes: int, bucket_bytes: int, *,
                 min_view_bytes: int | None = None, blocks: bool = False,
                 tied_copy: str | None = None) -> ReshardPlan:
    """Plan the train -> generation reshard of the parameters ``metas`` (full model, model order).

    ``bucket_bytes`` bounds the output of one all-gather of packed rows (all segments, padding
    included); ``min_view_bytes`` (default ``min(bucket_bytes, 1 MiB)``) is the gathered size from
    which a row is direct: an all-gather of its own, straight from the training shards (a view
    into the storage when the layouts allow, see the module docstring). ``blocks``: the
    consumer of the generation weights takes stacked shards (see the module docstring), so that
    no parameter needs a copy. ``tied_copy``: the name of the last training stage's copy of the
    embedding (a tied output layer that is not itself in ``metas``), which then sends part of the
    embedding's row where the layouts allow (see Tied embeddings in the module docstring).
    """
    train = gen.train
    if train.vpp not in (None, 1):
        raise LayoutError("layout.vpp: the reshard does not support virtual pipeline stages yet; "
                          "set layout.vpp to null")
    if dtype_bytes < 1 or bucket_bytes < 1:
        raise ValueError(f"dtype_bytes ({dtype_bytes}) and bucket_bytes ({bucket_bytes}) must be "
                         f"positive")
    names = [m.name for m in metas]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate parameter names: {dup}")
    for m in metas:
        if m.tp_dim is not None and m.shape[m.tp_dim] % (train.tp * m.tp_chunks):
            raise LayoutError(f"layout.tp={train.tp} does not split {m.name} (dim {m.tp_dim} of "
                              f"{m.shape}) into equal shards; pick a tp that divides it")
    num_layers = num_layers_of(metas)
    if num_layers:
        stage_layers(num_layers, train.pp, 0, train.last_stage_layers)  # errors name layout.*
    stage_of = {m.name: owner_stage(m, train.pp, num_layers, train.last_stage_layers)
                for m in metas}
    if min_view_bytes is None:
        min_view_bytes = min(bucket_bytes, 1 << 20)
    if tied_copy in stage_of:
        raise ValueError(f"tied_copy {tied_copy!r} is resharded itself (it is in metas)")
    tied = _tied_split(gen, metas, tied_copy) if tied_copy is not None else None

    stages = tuple(_plan_stage(gen, metas, stage_of, gp, num_layers, dtype_bytes, bucket_bytes,
                               min_view_bytes, blocks, tied) for gp in range(gen.pp))
    if tied is not None and not any(p.name == tied.copy.name for b in stages[0].buckets
                                    for pieces in b.pieces for p in pieces):
        tied = None  # the stage did not use the copy (see _plan_stage)
    ranks: list[RankPlan | None] = [None] * train.world_size
    for group in gen.micro_dp_groups():
        for member, rank in enumerate(group):
            _, gp, gt = gen.coords(rank)
            st = stages[gp]
            others = [k for k in range(st.members) if k != member]
            ranks[rank] = RankPlan(
                rank=rank, group=tuple(group), member=member, gen_tp_rank=gt, gen_pp_rank=gp,
                stage=st,
                send_bytes=dtype_bytes * sum(b.payload(member) for b in st.buckets),
                recv_bytes=dtype_bytes * sum(b.payload(k) for b in st.buckets for k in others),
                padding_bytes=dtype_bytes * sum(b.seg_numel - b.payload(k)
                                                for b in st.buckets for k in others))
    return ReshardPlan(gen=gen, metas=tuple(metas), dtype_bytes=dtype_bytes,
                       bucket_bytes=bucket_bytes, blocks=blocks, stages=stages,
                       ranks=tuple(ranks), tied=tied)


def _tied_split(gen: GenLayout, metas: list[ParamMeta], copy: str) -> TiedSplit | None:
    """How the embedding's row is split with the last stage's copy ``copy``: where one micro-DP
    group holds both (one generation stage over several training ones) and each generation shard
    is one training shard (``tp_stride == 1``: with TP merges the halves would not be adjacent in
    the gathered buffer, and the embedding would be copied instead of viewed); else None."""
    if gen.pp != 1 or gen.train.pp == 1 or gen.tp_stride != 1:
        return None
    embed = next((m for m in metas if m.position == "pre" and m.tp_dim == 0
                  and m.tp_chunks == 1), None)
    if embed is None:
        return None
    rows = embed.shard_shape(gen.train.tp)[0]
    if rows < 2:
        return None
    meta = ParamMeta(name=copy, shape=embed.shape, tp_dim=0, layer=None, position="post")
    return TiedSplit(embedding=embed.name, copy=meta, row=(rows + 1) // 2)


def resident_offsets(plan: ReshardPlan, rank: int) -> dict[str, int]:
    """Training shards of ``rank`` that can live inside its generation storage, and where:
    {name: element offset}. A shard qualifies when it is one whole piece of a bucket that is part
    of the storage; kept there (its training parameter a view of the storage), the all-gather of
    that bucket is in place and the generation weights hold no second copy of it."""
    rp = plan.ranks[rank]
    metas = plan.source_metas()
    tp = plan.gen.train.tp
    found: dict[str, list[int | None]] = {}
    for bucket in rp.stage.buckets:
        for p in bucket.pieces[rp.member]:
            m = metas[p.name]
            whole = p.offset == 0 and p.numel == (math.prod(m.shard_shape(tp))
                                                  if m.tp_dim is not None else m.numel)
            at = None
            if whole and bucket.storage_offset is not None:
                at = bucket.storage_offset + rp.member * bucket.seg_numel + p.dst
            found.setdefault(p.name, []).append(at)
    return {name: at[0] for name, at in found.items() if len(at) == 1 and at[0] is not None}


def copied_own_bytes(plan: ReshardPlan, rank: int, resident: bool = True) -> int:
    """Bytes of ``rank``'s own training shards that its generation weights hold a second copy of:
    every shard of its stage that the plan does not alias, less, with ``resident``, those that
    ``resident_offsets`` places in the storage. What ``redundant_bytes`` measures, planned."""
    train = plan.gen.train
    own_stage = train.coords(rank)[1]
    num_layers = num_layers_of(list(plan.metas))
    metas = {m.name: m for m in plan.metas}
    skip = resident_offsets(plan, rank) if resident else {}
    total = 0
    for name, gp in plan.ranks[rank].stage.params.items():
        m = metas[name]
        stage = owner_stage(m, train.pp, num_layers, train.last_stage_layers)
        if gp.mode == "alias" or name in skip or stage != own_stage:
            continue
        total += math.prod(m.shard_shape(train.tp)) if m.tp_dim is not None else m.numel
    return total * plan.dtype_bytes


def _split(numel: int, parts: int) -> list[tuple[int, int]]:
    """(offset, numel) of ``parts`` near-equal consecutive slices of ``range(numel)``."""
    base, extra = divmod(numel, parts)
    out, start = [], 0
    for j in range(parts):
        size = base + (j < extra)
        out.append((start, size))
        start += size
    return out


def _aligned_rows(metas: list[ParamMeta], stage_of: dict[str, int], stages: list[int],
                  num_layers: int, pp: int, last: int | None
                  ) -> list[dict[int, ParamMeta]]:
    """Rows of parameters aligned across the merged training ``stages``: {stage index: meta}."""
    layer_rows: dict[tuple[int, int], dict[int, ParamMeta]] = {}
    per_layer_count: dict[tuple[int, int], int] = {}
    extras: dict[int, list[ParamMeta]] = {i: [] for i in range(len(stages))}
    for m in metas:
        s = stage_of[m.name]
        if s not in stages:
            continue
        i = stages.index(s)
        if m.position == "layer":
            slot = m.layer - stage_layers(num_layers, pp, s, last).start
            k = per_layer_count.get((i, slot), 0)
            per_layer_count[(i, slot)] = k + 1
            layer_rows.setdefault((slot, k), {})[i] = m
        else:
            extras[i].append(m)
    extra_rows: list[dict[int, ParamMeta]] = []
    for split in (True, False):  # TP-split with TP-split, so that such a row can be direct
        rows: list[dict[int, ParamMeta]] = []
        for i, ms in extras.items():
            ms = [m for m in ms if (m.tp_dim is not None) == split]
            for k, m in enumerate(sorted(ms, key=lambda m: -m.numel)):
                if k == len(rows):
                    rows.append({})
                rows[k][i] = m
        extra_rows += rows
    return extra_rows + [layer_rows[k] for k in sorted(layer_rows)]


def _row_units(row: dict[int, ParamMeta], t: int, s: int, q: int, dtype_bytes: int,
               min_view_bytes: int, blocks: bool, tied: TiedSplit | None = None) -> list[_Row]:
    """Split one aligned row into packing units: one direct unit (two for fc1 when ``s > 1``: a
    gate row and an up row; one with ``blocks``, and for any size), or one packed unit.
    ``tied``: the row is the embedding's, split with the last stage's copy (``s == 1``)."""
    n = s * q

    def member(i: int, j: int) -> int:
        return i * s + j

    def shard_numel(m: ParamMeta) -> int:
        return math.prod(m.shard_shape(t)) if m.tp_dim is not None else m.numel

    def whole(i: int, m: ParamMeta) -> list[tuple[int, tuple[str, int, int]]]:
        """(merged stage, slice) of what is sent of the training shard of ``m`` of stage ``i``:
        all of it, or its first ``tied.row`` rows and, from the copy, the rest."""
        if tied is None or m.name != tied.embedding:
            return [(i, (m.name, 0, shard_numel(m)))]
        cut = tied.row * math.prod(m.shard_shape(t)[1:])
        return [(i, (m.name, 0, cut)), (q - 1, (tied.copy.name, cut, shard_numel(m) - cut))]

    split = [m for m in row.values() if m.tp_dim is not None]
    if blocks and s > 1 and split and len(split) == len(row):  # whole shards, kept: stacked views
        slices = [[] for _ in range(n)]
        for i, m in row.items():
            for j in range(s):
                slices[member(i, j)].append((m.name, 0, shard_numel(m)))
        return [_Row(slices, solo=True, keep=True)]
    big = n * max(shard_numel(m) // (s if m.tp_dim is None else 1)
                  for m in row.values()) * dtype_bytes >= min_view_bytes
    if big and s == 1:  # every member sends its stage's tensor whole; every tensor is a view
        slices: list[list[tuple[str, int, int]]] = [[] for _ in range(n)]
        for i, m in row.items():
            for k, piece in whole(i, m):
                slices[member(k, 0)].append(piece)
        # the embedding split with its copy is a view when the two members are adjacent
        return [_Row(slices, solo=True, keep=tied is None or q == 2)]
    kinds = {(m.tp_dim, m.tp_chunks) for m in split}
    if big and s > 1 and len(split) == len(row) and len(kinds) == 1:
        ((dim, c),) = kinds
        # dim-0 splits are views (fc1 too, as adjacent gate and up rows, unless the stages'
        # fc1s interleave: q > 1); row-parallel weights are copied out of a transient buffer.
        keep = dim == 0 and (c == 1 or q == 1)
        units = []
        for part in range(c):
            slices = [[] for _ in range(n)]
            for i, m in row.items():
                sub = shard_numel(m) // c
                for j in range(s):
                    slices[member(i, j)].append((m.name, part * sub, sub))
            units.append(_Row(slices, solo=True, keep=keep))
        return units
    slices = [[] for _ in range(n)]
    for i, m in row.items():
        for j in range(s):
            if m.tp_dim is not None:  # with ``tied``, s == 1: j == 0
                for k, piece in whole(i, m):
                    slices[member(k, j)].append(piece)
            elif q > 1:
                off, size = _split(m.numel, s)[j]
                if size:
                    slices[member(i, j)].append((m.name, off, size))
    return [_Row(slices, solo=False)] if any(any(x) for x in slices) else []


# (parameter name, member) -> where its slices sit in the buckets: [(bucket, dst, offset, numel)]
_Where = dict[tuple[str, int], list[tuple[int, int, int, int]]]


def _plan_stage(gen: GenLayout, metas: list[ParamMeta], stage_of: dict[str, int], gp: int,
                num_layers: int, dtype_bytes: int, bucket_bytes: int,
                min_view_bytes: int, blocks: bool, tied: TiedSplit | None) -> StagePlan:
    """The plan of generation pipeline stage ``gp``: its buckets and its generation tensors."""
    t, s, q = gen.train.tp, gen.tp_stride, gen.pp_stride
    n = s * q
    stages = [gp * q + i for i in range(q)]

    units: list[_Row] = []
    if n > 1:
        rows = _aligned_rows(metas, stage_of, stages, num_layers, gen.train.pp,
                             gen.train.last_stage_layers)
        if tied is not None and any(row.get(0) is not None and row[0].name == tied.embedding
                                    and q - 1 in row for row in rows):
            tied = None  # the last stage sends a parameter of its own in that row
        for row in rows:
            here = tied if tied is not None and tied.embedding in {m.name for m in row.values()} \
                else None
            units += _row_units(row, t, s, q, dtype_bytes, min_view_bytes, blocks, here)
    else:
        tied = None
    buckets, where, storage = _place(_group_units(units, n, dtype_bytes, bucket_bytes), n, s)

    params: dict[str, GenParam] = {}
    for m in metas:
        if stage_of[m.name] not in stages:
            continue
        i = stages.index(stage_of[m.name])
        if n == 1 or (m.tp_dim is None and q == 1):
            params[m.name] = GenParam(m.name, m.shard_shape(gen.tp), "alias", (), 0, (), None)
            continue
        params[m.name], storage = _gen_param(m, i, gen, blocks, buckets, where, storage, tied)
    return StagePlan(gen_pp_rank=gp, members=n, buckets=tuple(buckets), params=params,
                     storage_numel=storage)


def _group_units(units: list[_Row], n: int, dtype_bytes: int, bucket_bytes: int
                 ) -> list[list[_Row]]:
    """The units of each bucket, for ``n`` members."""
    # Greedy: consecutive rows share a bucket while it stays within bucket_bytes; a solo row is a
    # bucket of its own and leaves the open bucket open, so small rows around it still pack.
    grouped: list[list[_Row]] = []
    cur: list[_Row] = []
    cur_sizes = [0] * n
    for u in units:
        if u.solo:
            grouped.append([u])
            continue
        sizes = [a + b for a, b in zip(cur_sizes, u.sizes)]
        if cur and n * max(sizes) * dtype_bytes > bucket_bytes:
            grouped.append(cur)
            cur, sizes = [], u.sizes
        cur.append(u)
        cur_sizes = sizes
    if cur:
        grouped.append(cur)
    return grouped


def _place(grouped: list[list[_Row]], n: int, s: int) -> tuple[list[Bucket], _Where, int]:
    """The buckets of ``grouped``, where each slice went, and the storage they take."""
    # Kept buckets (all of them when s == 1, the direct rows that hold views otherwise) go first
    # in the generation storage.
    where: _Where = {}
    buckets: list[Bucket] = []
    storage = 0
    for b, rows in enumerate(grouped):
        pieces: list[list[Piece]] = [[] for _ in range(n)]
        fill = [0] * n
        for u in rows:
            for k in range(n):
                for name, off, numel in u.slices[k]:
                    pieces[k].append(Piece(name, off, numel, fill[k]))
                    where.setdefault((name, k), []).append((b, fill[k], off, numel))
                    fill[k] += numel
        seg = max(fill)
        keep = rows[0].keep if rows[0].solo else s == 1
        buckets.append(Bucket(seg_numel=seg, pieces=tuple(tuple(ps) for ps in pieces),
                              storage_offset=storage if keep else None))
        storage += n * seg if keep else 0
    return buckets, where, storage


def _locate(where: _Where, name: str, k: int, start: int, shape: tuple[int, ...]) -> Chunk:
    """The chunk of ``shape`` at element ``start`` of member ``k``'s shard of ``name``."""
    numel = math.prod(shape)
    for b, dst, off, size in where[(name, k)]:
        if off <= start and start + numel <= off + size:
            return Chunk(b, k, dst + start - off, shape)
    raise AssertionError(f"{name}: elements {start}..{start + numel} of member {k} not placed")


def _gen_chunks(m: ParamMeta, i: int, gen: GenLayout, blocks: bool, where: _Where,
                tied: TiedSplit | None) -> tuple[tuple[Chunk, ...], int, tuple[int, ...], int]:
    """The chunks of ``m`` (of merged stage ``i``) in generation order, the dim and shape they
    are concatenated along and into, and the number of stacked blocks."""
    t, s = gen.train.tp, gen.tp_stride
    stacked = 1
    if tied is not None and m.name == tied.embedding:  # s == 1: its rows, then the copy's
        shape = m.shard_shape(t)
        rest = shape[1:]
        last = (gen.pp_stride - 1) * s
        chunks = (_locate(where, m.name, i * s, 0, (tied.row, *rest)),
                  _locate(where, tied.copy.name, last, tied.row * math.prod(rest),
                          (shape[0] - tied.row, *rest)))
        cat_dim, cat_shape = 0, shape
    elif m.tp_dim is not None and blocks and s > 1:  # the s whole shards, stacked
        shard_shape = m.shard_shape(t)
        chunks = tuple(_locate(where, m.name, i * s + j, 0, (1, *shard_shape)) for j in range(s))
        stacked = s if stacked_layout(m) else 1
        cat_dim, cat_shape = 0, (s, *shard_shape)
    elif m.tp_dim is not None:
        shard_shape = m.shard_shape(t)
        piece_shape = list(shard_shape)
        piece_shape[m.tp_dim] //= m.tp_chunks
        sub = math.prod(piece_shape)
        chunks = tuple(_locate(where, m.name, i * s + j, c * sub, tuple(piece_shape))
                       for c in range(m.tp_chunks) for j in range(s))
        cat_dim, cat_shape = m.tp_dim, m.shard_shape(gen.tp)
    else:
        chunks = tuple(_locate(where, m.name, i * s + j, off, (size,))
                       for j, (off, size) in enumerate(_split(m.numel, s)) if size)
        cat_dim, cat_shape = 0, (m.numel,)
    return chunks, cat_dim, cat_shape, stacked


def _gen_param(m: ParamMeta, i: int, gen: GenLayout, blocks: bool, buckets: list[Bucket],
               where: _Where, storage: int, tied: TiedSplit | None) -> tuple[GenParam, int]:
    """How ``m`` (of merged stage ``i``) is obtained: a view when its chunks are adjacent in
    the storage, else a copy placed at ``storage``; returns it and the storage's new end."""
    chunks, cat_dim, cat_shape, stacked = _gen_chunks(m, i, gen, blocks, where, tied)
    pos = [_position(buckets, c) for c in chunks]
    adjacent = (all(p is not None for p in pos)
                and all(pos[x] + chunks[x].numel == pos[x + 1] for x in range(len(pos) - 1))
                and (len(chunks) == 1 or math.prod(cat_shape[:cat_dim]) == 1))
    if adjacent:
        mode, offset = "view", pos[0]
    else:
        in_order = [(c.bucket, c.member, c.offset) for c in chunks]
        mode = "concat" if in_order == sorted(in_order) else "rearrange"
        offset, storage = storage, storage + math.prod(m.shard_shape(gen.tp))
    shape = tuple(cat_shape) if stacked > 1 else m.shard_shape(gen.tp)
    return GenParam(m.name, shape, mode, chunks, cat_dim, tuple(cat_shape), offset,
                    blocks=stacked), storage


def _position(buckets: list[Bucket], c: Chunk) -> int | None:
    """Start of a chunk in the generation storage; None when its bucket is transient."""
    b = buckets[c.bucket]
    if b.storage_offset is None:
        return None
    return b.storage_offset + c.member * b.seg_numel + c.offset


"""Run a reshard plan: bucketed all-gathers in the micro-DP groups build the generation weights.

Each rank packs its pieces of a bucket into its own segment of the bucket's output buffer and
all-gathers in place (``all_gather_single``; a list ``all_gather`` into views of the same buffer
where the backend lacks it). The next bucket is packed while the current one is on the wire, and
no more than that one is in flight beyond it. Generation tensors are views into one flat storage
per rank wherever the plan allows (see ``plan.py``); the rest are assembled into that storage from
transient buffers. The training shards are only read, so going back to training is dropping the
storage (``back_to_training``).

``naive_gather`` is the baseline (verl's path): all-gather every tensor over the training TP
group, broadcast it over the training PP group from its owner stage, then cut the generation shard.
"""

from __future__ import annotations

from typing import Callable, Mapping, Union

import torch
import torch.distributed as dist

from hybridflow.hybrid_engine.meta import ParamMeta, num_layers_of, owner_stage, shard, unshard
from hybridflow.hybrid_engine.plan import Bucket, GenParam, ReshardPlan
from hybridflow.parallel.layout import GenLayout, TrainLayout

Groups = Union[Mapping[tuple[int, ...], "dist.ProcessGroup | None"],
               Callable[[tuple[int, ...]], "dist.ProcessGroup | None"]]


def create_micro_dp_groups(gen: GenLayout) -> dict[tuple[int, ...], dist.ProcessGroup | None]:
    """One process group per micro-DP group (None when they are single ranks). Every rank must call
    this with the same layout: ``new_group`` is collective over the whole world."""
    groups = [tuple(g) for g in gen.micro_dp_groups()]
    if gen.micro_dp == 1:
        return {g: None for g in groups}
    return {g: dist.new_group(list(g)) for g in groups}


def create_train_groups(train: TrainLayout) -> dict[tuple[int, ...], dist.ProcessGroup | None]:
    """Training TP and PP groups (for ``naive_gather``), keyed by their ranks. Collective, like
    ``create_micro_dp_groups``."""
    out: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for size, groups in ((train.tp, train.tp_groups()), (train.pp, train.pp_groups())):
        for g in groups:
            out[tuple(g)] = dist.new_group(g) if size > 1 else None
    return out


def gather_generation_weights(plan: ReshardPlan, rank: int,
                              train_shards: Mapping[str, torch.Tensor], group_of: Groups, *,
                              single: bool | None = None) -> dict[str, torch.Tensor]:
    """This rank's generation weights {name: tensor}, in model order (full parameters when the
    generation layout is tg=1, pg=1).

    ``train_shards`` are this rank's training shards ({name: tensor}, the shapes ``shard`` gives,
    one dtype); they are only read, and the "alias" parameters of the plan are returned as these
    very tensors. ``group_of`` maps the micro-DP group's ranks to its process group (the dict of
    ``create_micro_dp_groups``, or a callable). ``single`` forces (True) or avoids (False) the
    single-tensor all-gather; by default it is used unless the backend refuses it.
    """
    rp = plan.ranks[rank]
    st = plan.stages[rp.gen_pp_rank]
    dtype, device = _check_shards(plan, rank, train_shards)
    group = _lookup(group_of, rp.group) if st.buckets else None
    storage = torch.empty(st.storage_numel, dtype=dtype, device=device)
    flat = {name: t.reshape(-1) for name, t in train_shards.items()}
    # When its last bucket is in, a copied parameter is assembled; a transient buffer is dropped.
    build_at: dict[int, list[GenParam]] = {}
    last_use: dict[int, int] = {}
    for p in st.params.values():
        if p.mode in ("concat", "rearrange"):
            done = max(c.bucket for c in p.chunks)
            build_at.setdefault(done, []).append(p)
            for c in p.chunks:
                last_use[c.bucket] = max(last_use.get(c.bucket, c.bucket), done)

    gatherer = _Gatherer(single)
    live: dict[int, torch.Tensor] = {}
    in_flight: tuple[int, object] | None = None
    for b, bucket in enumerate(st.buckets):
        if bucket.storage_offset is None:
            buf = torch.empty(bucket.numel, dtype=dtype, device=device)
        else:
            buf = storage.narrow(0, bucket.storage_offset, bucket.numel)
        own = buf.narrow(0, rp.member * bucket.seg_numel, bucket.seg_numel)
        _pack(own, bucket, rp.member, flat)  # overlaps the previous bucket's all-gather
        live[b] = buf
        work = gatherer(buf, own, group)
        if in_flight is not None:
            _finish(*in_flight, st.buckets, live, build_at, last_use, storage)
        in_flight = (b, work)
    if in_flight is not None:
        _finish(*in_flight, st.buckets, live, build_at, last_use, storage)

    out: dict[str, torch.Tensor] = {}
    for name, p in st.params.items():
        if p.mode == "alias":
            out[name] = train_shards[name]
        else:
            out[name] = storage.narrow(0, p.storage_offset, p.numel).view(p.shape)
    return out


def back_to_training(gen_weights: dict[str, torch.Tensor],
                     train_shards: Mapping[str, torch.Tensor]) -> int:
    """Free the generation storage and return the bytes released.

    The training shards were never written, so nothing is copied back: the storages behind
    ``gen_weights`` that are not training shards are released (``resize_(0)``, which also
    invalidates any other view of them, e.g. a rollout engine's parameters), and ``gen_weights``
    is emptied.
    """
    keep = {t.untyped_storage().data_ptr() for t in train_shards.values()}
    freed, seen = 0, set()
    for t in gen_weights.values():
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr in keep or ptr in seen or s.nbytes() == 0:
            continue
        seen.add(ptr)
        freed += s.nbytes()
        s.resize_(0)
    gen_weights.clear()
    return freed


def naive_gather(gen: GenLayout, metas: list[ParamMeta], rank: int,
                 train_shards: Mapping[str, torch.Tensor], group_of: Groups
                 ) -> dict[str, torch.Tensor]:
    """Baseline with the same result as ``gather_generation_weights``: every parameter is made
    whole on every rank (TP all-gather, PP broadcast), then the generation shard is cut from it.

    ``group_of`` maps training TP and PP groups' ranks to process groups
    (``create_train_groups``).
    """
    train = gen.train
    d, pp_rank, tp_rank = train.coords(rank)
    _, gen_pp, gen_tp = gen.coords(rank)
    tp_ranks = tuple(train.rank(d, pp_rank, x) for x in range(train.tp))
    pp_ranks = tuple(train.rank(d, x, tp_rank) for x in range(train.pp))
    tp_group = _lookup(group_of, tp_ranks) if train.tp > 1 else None
    pp_group = _lookup(group_of, pp_ranks) if train.pp > 1 else None
    dtype, device = _dtype_device(train_shards)
    num_layers = num_layers_of(metas)
    out: dict[str, torch.Tensor] = {}
    for m in metas:
        owner = owner_stage(m, train.pp, num_layers)
        if owner == pp_rank:
            local = train_shards[m.name].contiguous()
            if m.tp_dim is not None and train.tp > 1:
                parts = [torch.empty_like(local) for _ in range(train.tp)]
                dist.all_gather(parts, local, group=tp_group)
                full = unshard(parts, m)
            else:
                full = local
        else:
            full = torch.empty(m.shape, dtype=dtype, device=device)
        if train.pp > 1:
            full = full.contiguous()
            dist.broadcast(full, src=pp_ranks[owner], group=pp_group)
        if owner // gen.pp_stride == gen_pp:
            out[m.name] = shard(full, m, gen.tp, gen_tp)
    return out


class _Gatherer:
    """All-gather of a flat buffer whose ``own`` slice is this rank's segment, asynchronously."""

    def __init__(self, single: bool | None):
        self.single = single

    def __call__(self, out: torch.Tensor, own: torch.Tensor, group):
        if self.single is not False:
            fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            try:
                return fn(out, own, group=group, async_op=True)
            except (RuntimeError, NotImplementedError):
                # Older gloo raises here, on every rank alike, before anything is sent.
                if self.single:
                    raise
                self.single = False
        return dist.all_gather(list(out.split(own.numel())), own, group=group, async_op=True)


def _pack(own: torch.Tensor, bucket: Bucket, member: int, flat: Mapping[str, torch.Tensor]) -> None:
    end = 0
    for p in bucket.pieces[member]:
        own.narrow(0, p.dst, p.numel).copy_(flat[p.name].narrow(0, p.offset, p.numel))
        end = p.dst + p.numel
    if end < own.numel():
        own.narrow(0, end, own.numel() - end).zero_()  # padding: deterministic, never read


def _finish(b: int, work, buckets: tuple[Bucket, ...], live: dict[int, torch.Tensor],
            build_at: dict[int, list[GenParam]], last_use: dict[int, int],
            storage: torch.Tensor) -> None:
    work.wait()
    for p in build_at.get(b, ()):
        parts = [live[c.bucket].narrow(0, c.member * buckets[c.bucket].seg_numel + c.offset,
                                       c.numel).view(c.shape) for c in p.chunks]
        dst = storage.narrow(0, p.storage_offset, p.numel).view(p.cat_shape)
        torch.cat(parts, dim=p.cat_dim, out=dst)
    for x in [x for x in live if buckets[x].storage_offset is None and last_use.get(x, x) <= b]:
        del live[x]


def _lookup(group_of: Groups, ranks: tuple[int, ...]):
    return group_of(ranks) if callable(group_of) else group_of[ranks]


def _dtype_device(train_shards: Mapping[str, torch.Tensor]) -> tuple[torch.dtype, torch.device]:
    dtypes = {t.dtype for t in train_shards.values()}
    if len(dtypes) != 1:
        raise ValueError(f"train_shards must hold one dtype, got {sorted(map(str, dtypes))}"
                         if dtypes else "train_shards is empty")
    t = next(iter(train_shards.values()))
    return t.dtype, t.device


def _check_shards(plan: ReshardPlan, rank: int, train_shards: Mapping[str, torch.Tensor]
                  ) -> tuple[torch.dtype, torch.device]:
    dtype, device = _dtype_device(train_shards)
    size = torch.empty((), dtype=dtype).element_size()
    if size != plan.dtype_bytes:
        raise ValueError(f"train_shards are {dtype}, the plan was made for {plan.dtype_bytes}-byte "
                         f"elements; plan with dtype_bytes={size}")
    rp = plan.ranks[rank]
    st = plan.stages[rp.gen_pp_rank]
    need = {p.name for pieces in rp.buckets for p in pieces}
    need |= {name for name, p in st.params.items() if p.mode == "alias"}
    metas = {m.name: m for m in plan.metas}
    for name in need:
        want = metas[name].shard_shape(plan.gen.train.tp)
        if name not in train_shards:
            raise ValueError(f"train_shards of rank {rank} lacks {name}")
        if tuple(train_shards[name].shape) != want or not train_shards[name].is_contiguous():
            raise ValueError(f"train_shards[{name!r}] of rank {rank}: shape "
                             f"{tuple(train_shards[name].shape)}, expected a contiguous {want}")
    return dtype, device

"""Run a reshard plan: bucketed all-gathers in the micro-DP groups build the generation weights.

Each bucket is one all-gather of equal segments into a flat buffer. A member whose segment is one
slice of a training shard (a direct row, see ``plan.py``) sends that slice as it is; where the
shard lives in its own segment of the storage (``resident_offsets``; the caller passes that
``storage``) the all-gather is in place and nothing is copied at all. Other members pack their
pieces into their own segment first. Consecutive buckets are launched together (one coalesced
NCCL group of up to ``coalesce_bytes``), so the wire sees few, large launches.

On gloo (CPU) a bucket is gathered as one broadcast per member instead, of the elements its
pieces span (``Bucket.extent``) into its segment of the gathered buffer: gloo's all-gather
allocates a flat output of the whole gather at every call and copies it out
(``ProcessGroupGloo``'s allgather), and sends the padding, where its broadcast reads and writes
the tensors themselves. A direct piece is sent from the training shard; a generation tensor
that is one of the rank's training shards, whole
(``t == tg``: its own stage's parameters), is then that shard itself, and its place in the
storage is never touched (on CPU a page never touched costs neither a fault nor memory); other
own pieces are copied into the member's segment, as the all-gather does.

Generation tensors are views into one flat storage per rank wherever the plan allows; the rest
(row-parallel weights, packed parameters) are gathered into transient buffers and copied into the
storage, one ``cat`` per tensor, on a side CUDA stream, so the copies of one launch overlap the
all-gathers of the next. The transient buffers are regions of one ring buffer sized for two
launches: a region is reused once the copies that read it are done, which the next all-gather
into it waits for on the device (the host never waits). Launches grow from ``coalesce_bytes/8``
to ``coalesce_bytes`` (the wire starts early, the bulk goes in few launches) and, when there are
copies, shrink again at the end, so that little copying is left after the last all-gather.
The training shards are only read, so going back to training is dropping the storage
(``back_to_training``).

``naive_gather`` is the baseline (verl's path): all-gather every tensor over the training TP
group, broadcast it over the training PP group from its owner stage, then cut the generation shard.
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext
from typing import Callable, Mapping, Union

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from hybridflow.hybrid_engine.plan import Bucket, GenParam, ReshardPlan, StagePlan
from hybridflow.models.params import ParamMeta, num_layers_of, owner_stage, shard, unshard
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
                              single: bool | None = None, broadcast: bool | None = None,
                              storage: torch.Tensor | None = None,
                              coalesce_bytes: int = 2 << 30,
                              stats: dict | None = None) -> dict[str, torch.Tensor]:
    """This rank's generation weights {name: tensor}, in model order (full parameters when the
    generation layout is tg=1, pg=1).

    ``train_shards`` are this rank's training shards ({name: tensor}, the shapes ``shard`` gives,
    one dtype); they are only read, and the "alias" parameters of the plan are returned as these
    very tensors. ``group_of`` maps the micro-DP group's ranks to its process group (the dict of
    ``create_micro_dp_groups``, or a callable). ``single`` forces (True) or avoids (False) the
    single-tensor all-gather; by default it is used unless the backend refuses it.
    ``broadcast`` gathers each bucket with one broadcast per member (True) or an all-gather
    (False); by default broadcasts on gloo, all-gathers elsewhere (see the module docstring).

    ``storage``: the generation storage to fill (``new_storage``; by default a new one). Training
    shards that are views of it at their ``resident_offsets`` are gathered in place.
    ``coalesce_bytes`` bounds the gathered bytes of one launch (a larger bucket is a launch of its
    own). ``stats``, if given, receives ``launches`` and ``transient_bytes`` (the ring's size).
    """
    rp = plan.ranks[rank]
    st = plan.stages[rp.gen_pp_rank]
    dtype, device = _check_shards(plan, rank, train_shards)
    group = _lookup(group_of, rp.group) if st.buckets else None
    if storage is None:
        storage = new_storage(plan, rank, device, dtype)
    elif (storage.numel() != st.storage_numel or storage.dtype != dtype
          or storage.device != device or storage.dim() != 1):
        raise ValueError(f"storage: a flat {dtype} tensor of {st.storage_numel} elements on "
                         f"{device} expected (new_storage), got {storage.dtype} "
                         f"{tuple(storage.shape)} on {storage.device}")
    flat = {name: t.reshape(-1) for name, t in train_shards.items()}
    transient = [b.storage_offset is None for b in st.buckets]
    launches = _launches([b.numel for b in st.buckets], max(1, coalesce_bytes // plan.dtype_bytes),
                         ramp_down=any(transient))
    if broadcast is None:
        broadcast = group is not None and dist.get_backend(group) == "gloo"
    own = _own_shards(st, rp.member, train_shards) if broadcast else {}
    run = _Run(st, rp.member, storage, flat, group, _Gatherer(single), broadcast,
               _ring_numel(st.buckets, launches), skip_own=set(own.values()))
    for launch in launches:
        run.launch(launch)
    run.finish()
    if stats is not None:
        stats.update(launches=len(launches), transient_bytes=run.ring.nbytes)

    out: dict[str, torch.Tensor] = {}
    for name, p in st.params.items():
        if p.mode == "alias" or name in own:
            out[name] = train_shards[name]
        else:
            out[name] = storage.narrow(0, p.storage_offset, p.numel).view(p.shape)
    return out


def _own_shards(st: StagePlan, member: int, train_shards: Mapping[str, torch.Tensor]
                ) -> dict[str, int]:
    """{name: bucket} of the view parameters that are exactly one of ``member``'s training
    shards, whole: the bucket's segment of ``member`` is that shard and nothing else."""
    out = {}
    for name, p in st.params.items():
        if p.mode != "view" or p.blocks != 1:
            continue
        first = p.chunks[0]  # a view's chunks are adjacent: fc1's [gate; up] is two
        piece = st.buckets[first.bucket].direct(member)
        if (first.offset == 0 and all(c.member == member and c.bucket == first.bucket
                                      for c in p.chunks)
                and piece is not None and piece.name == name and piece.offset == 0
                and piece.numel == p.numel and tuple(train_shards[name].shape) == p.shape):
            out[name] = first.bucket
    return out


def new_storage(plan: ReshardPlan, rank: int, device: torch.device | str,
                dtype: torch.dtype) -> torch.Tensor:
    """An (uninitialised) generation storage for ``rank``, which ``gather_generation_weights``
    fills."""
    numel = plan.stages[plan.ranks[rank].gen_pp_rank].storage_numel
    return torch.empty(numel, dtype=dtype, device=device)


def place_shards(shards: Mapping[str, torch.Tensor], offsets: Mapping[str, int],
                 storage: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The shards named in ``offsets`` (``resident_offsets``) copied into ``storage`` at those
    element offsets, as views of it, or, with ``storage`` None, each into memory of its own
    (out of the storage again); the others as they are. The caller drops the sources: the
    resident switch moves the training shards in before the all-gathers and out after."""
    out = dict(shards)
    with torch.no_grad():
        for name, at in offsets.items():
            src = shards[name]
            dst = (torch.empty_like(src, memory_format=torch.contiguous_format) if storage is None
                   else storage.narrow(0, at, src.numel()).view(src.shape))
            out[name] = dst.copy_(src)
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
        owner = owner_stage(m, train.pp, num_layers, train.last_stage_layers)
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


def broadcast_gather(out: torch.Tensor, inp: torch.Tensor, group=None) -> None:
    """An all-gather of ``inp`` into ``out`` (``group``'s size times as long) as one broadcast per
    member, the way a bucket is gathered on gloo (``_broadcasts``, every segment whole):
    what ``hybridflow calibrate`` and ``tools/bench_reshard.py`` time as gloo's gather rate."""
    members, me = dist.get_world_size(group), dist.get_rank(group)
    works = _broadcasts(out, inp, [inp.numel()] * members, inp.numel(), me, group)
    # Its own segment: a copy, while the broadcast reads ``inp``.
    out.narrow(0, me * inp.numel(), inp.numel()).copy_(inp)
    for w in works:
        w.wait()


def _broadcasts(out: torch.Tensor, inp: torch.Tensor, extents: list[int], seg_numel: int,
                member: int, group) -> list:
    """One asynchronous broadcast per member k of the first ``extents[k]`` elements of its
    segment (``seg_numel`` long) of ``out``: ``member`` sends them from ``inp``, the others'
    land in ``out``. Every rank issues them in the same order (member order)."""
    works = []
    for k, numel in enumerate(extents):
        if numel:
            t = inp.narrow(0, 0, numel) if k == member else out.narrow(0, k * seg_numel, numel)
            works.append(dist.broadcast(t, group=group, group_src=k, async_op=True))
    return works


class _Gatherer:
    """Asynchronous all-gathers of flat buffers, ``ops`` = [(out, inp)]: several at once as one
    coalesced launch (one NCCL group)."""

    def __init__(self, single: bool | None):
        self.single = single

    def __call__(self, ops: list[tuple[torch.Tensor, torch.Tensor]], group):
        if self.single is not False:
            fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            try:
                if len(ops) == 1:
                    return fn(ops[0][0], ops[0][1], group=group, async_op=True)
                # Private, but what Megatron's and FSDP's bucketed all-gathers use.
                with _coalescing_manager(group, async_ops=True) as cm:
                    for out, inp in ops:
                        fn(out, inp, group=group, async_op=True)
                return cm
            except (RuntimeError, NotImplementedError):
                # Older gloo raises here, on every rank alike, before anything is sent.
                if self.single:
                    raise
                self.single = False
        return _Works([dist.all_gather(list(out.split(inp.numel())), inp, group=group,
                                       async_op=True) for out, inp in ops])


class _Works:
    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


def _launches(sizes: list[int], cap: int, ramp_down: bool) -> list[list[int]]:
    """Consecutive buckets (their gathered ``sizes``) grouped into launches of at most ``cap``
    elements: the first of about ``cap/8``, each next one twice the last; with ``ramp_down`` the
    last ones shrink the same way. A bucket larger than its launch's limit is a launch alone."""

    def limits():
        limit = max(1, cap // 8)
        while True:
            yield min(limit, cap)
            limit *= 2

    def greedy(order: list[int], stop_at_cap: bool) -> tuple[list[list[int]], list[int]]:
        out: list[list[int]] = []
        lim = limits()
        limit, size = next(lim), 0
        for k, b in enumerate(order):
            if out and size + sizes[b] <= limit:
                out[-1].append(b)
                size += sizes[b]
                continue
            if out:
                limit = next(lim)
                if stop_at_cap and limit >= cap:  # the rest goes to the front pass
                    return out, order[k:]
            out.append([b])
            size = sizes[b]
        return out, []

    order = list(range(len(sizes)))
    back: list[list[int]] = []
    if ramp_down and cap > 1:
        back, rest = greedy(order[::-1], stop_at_cap=True)
        order = rest[::-1]
        if not order:  # everything fitted in the shrinking launches: plain front pass instead
            back, order = [], list(range(len(sizes)))
    front, _ = greedy(order, stop_at_cap=False)
    return front + [launch[::-1] for launch in back[::-1]]


def _ring_numel(buckets: tuple[Bucket, ...], launches: list[list[int]]) -> int:
    """Transient elements of two consecutive launches at most, plus the largest transient bucket
    (what wrapping around may waste): the next launch never overwrites the last one's buffers,
    whose copies it overlaps. No more than all transient buckets together (then it never wraps)."""
    per_launch = [sum(buckets[b].numel for b in launch if buckets[b].storage_offset is None)
                  for launch in launches]
    if not any(per_launch):
        return 0
    pairs = max(a + b for a, b in zip(per_launch, per_launch[1:] + [0]))
    return min(sum(per_launch), pairs + max(b.numel for b in buckets if b.storage_offset is None))


class _Ring:
    """Transient buffers carved in a circle out of one flat buffer. A region is reused once it
    is retired (the copies that read it are enqueued, ``event`` recorded after them): the
    current stream, hence the next all-gather, waits for that event on the device."""

    def __init__(self, numel: int, like: torch.Tensor):
        self.buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        self.nbytes = numel * like.element_size()
        self.head = 0
        self.busy: deque[list] = deque()  # [start, end, retired, event]
        self.spare: list[torch.Tensor] = []  # buffers outside the ring (not expected)

    def take(self, numel: int) -> tuple[torch.Tensor, list | None]:
        cap = self.buf.numel()
        if numel <= cap:
            start = self.head if self.head + numel <= cap else 0
            end = start + numel

            def overlapped() -> bool:
                return any(r[0] < end and start < r[1] for r in self.busy)

            while overlapped() and self.busy[0][2]:  # oldest first, retired ones only
                event = self.busy.popleft()[3]
                if event is not None:
                    torch.cuda.current_stream(self.buf.device).wait_event(event)
            if not overlapped():
                region = [start, end, False, None]
                self.busy.append(region)
                self.head = end
                return self.buf.narrow(0, start, numel), region
        # Larger than the ring, or over a region still to be read: memory outside the ring.
        self.spare.append(torch.empty(numel, dtype=self.buf.dtype, device=self.buf.device))
        return self.spare[-1], None


class _Run:
    """One rank's run of a stage plan: launches, copies on a side stream, the transient ring."""

    def __init__(self, st: StagePlan, member: int, storage: torch.Tensor,
                 flat: Mapping[str, torch.Tensor], group, gatherer: _Gatherer, broadcast: bool,
                 ring_numel: int, skip_own: set[int] = frozenset()):
        self.st, self.member, self.storage, self.flat = st, member, storage, flat
        self.group, self.gatherer, self.broadcast = group, gatherer, broadcast
        self.skip_own = skip_own  # buckets whose own segment nothing reads (broadcasts only)
        self.side = torch.cuda.Stream(storage.device) if storage.is_cuda else None
        self.ring = _Ring(ring_numel, storage)
        # A copied parameter is assembled once its last bucket is launched; a transient region
        # is retired once every parameter that reads it is.
        self.build_at: dict[int, list[GenParam]] = {}
        self.last_use: dict[int, int] = {}
        for p in st.params.values():
            if p.mode in ("concat", "rearrange"):
                done = max(c.bucket for c in p.chunks)
                self.build_at.setdefault(done, []).append(p)
                for c in p.chunks:
                    self.last_use[c.bucket] = max(self.last_use.get(c.bucket, c.bucket), done)
        self.bufs: dict[int, torch.Tensor] = {}
        self.regions: dict[int, list | None] = {}
        self.work_of: dict[int, object] = {}
        self.works: list = []
        self.side_waits: set[int] = set()

    def launch(self, buckets: list[int]) -> None:
        ops, works = [], []
        for b in buckets:
            bucket = self.st.buckets[b]
            if bucket.storage_offset is None:
                buf, self.regions[b] = self.ring.take(bucket.numel)
            else:
                buf = self.storage.narrow(0, bucket.storage_offset, bucket.numel)
            own = buf.narrow(0, self.member * bucket.seg_numel, bucket.seg_numel)
            piece = bucket.direct(self.member)
            if piece is not None:  # sent as it is (in place when the shard lives in ``own``)
                src = self.flat[piece.name].narrow(0, piece.offset, piece.numel)
            else:
                # Broadcasts send no padding, so it need not be zeroed (nor its memory touched).
                _pack(own, bucket, self.member, self.flat, pad=not self.broadcast)
                src = own
            self.bufs[b] = buf
            if self.broadcast:  # on the wire at once, while the next bucket is prepared
                extents = [bucket.extent(k) for k in range(bucket.members)]
                works += _broadcasts(buf, src, extents, bucket.seg_numel, self.member,
                                     self.group)
                if src.data_ptr() != own.data_ptr() and b not in self.skip_own:
                    own.copy_(src)  # the broadcast reads ``src`` meanwhile, not ``own``
            else:
                ops.append((buf, src))
        work = _Works(works) if self.broadcast else self.gatherer(ops, self.group)
        self.works.append(work)
        for b in buckets:
            self.work_of[b] = work
        for b in buckets:
            for p in self.build_at.get(b, ()):
                self._assemble(p)
        last = max(buckets)
        event = None
        for x in [x for x in self.bufs if self.last_use.get(x, x) <= last]:
            del self.bufs[x]
            region = self.regions.pop(x, None)
            if region is not None:
                if event is None and self.side is not None:
                    event = torch.cuda.Event()
                    event.record(self.side)
                region[2], region[3] = True, event

    def _assemble(self, p: GenParam) -> None:
        st = self.st
        parts = [self.bufs[c.bucket].narrow(0, c.member * st.buckets[c.bucket].seg_numel
                                            + c.offset, c.numel).view(c.shape) for c in p.chunks]
        dst = self.storage.narrow(0, p.storage_offset, p.numel).view(p.cat_shape)
        with torch.cuda.stream(self.side) if self.side is not None else nullcontext():
            for c in p.chunks:
                work = self.work_of[c.bucket]
                if id(work) not in self.side_waits:  # the side stream waits for the gather
                    self.side_waits.add(id(work))
                    work.wait()
            torch.cat(parts, dim=p.cat_dim, out=dst)

    def finish(self) -> None:
        for work in self.works:
            work.wait()  # the current stream waits for every all-gather (the views)
        if self.side is not None:
            # After this the ring is freed in the current stream's order, after the copies.
            torch.cuda.current_stream(self.storage.device).wait_stream(self.side)
        self.bufs.clear()


def _pack(own: torch.Tensor, bucket: Bucket, member: int, flat: Mapping[str, torch.Tensor],
          pad: bool = True) -> None:
    for p in bucket.pieces[member]:
        dst = own.narrow(0, p.dst, p.numel)
        src = flat[p.name].narrow(0, p.offset, p.numel)
        if dst.data_ptr() != src.data_ptr():  # a resident shard is already in place
            dst.copy_(src)
    end = bucket.extent(member)
    if pad and end < own.numel():
        own.narrow(0, end, own.numel() - end).zero_()  # padding: deterministic, never read


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
    metas = plan.source_metas()
    for name in need:
        want = metas[name].shard_shape(plan.gen.train.tp)
        if name not in train_shards:
            raise ValueError(f"train_shards of rank {rank} lacks {name}")
        if tuple(train_shards[name].shape) != want or not train_shards[name].is_contiguous():
            raise ValueError(f"train_shards[{name!r}] of rank {rank}: shape "
                             f"{tuple(train_shards[name].shape)}, expected a contiguous {want}")
    return dtype, device

"""The actor's switch between its training and generation layouts on one rank (HybridFlow,
arXiv 2409.19256, section 5).

``HybridEngine`` owns, for one rank of a ``TrainEngine``, everything the switch needs: the
generation layout, the reshard plan (made once), the micro-DP process groups (created once, by
every rank in the same order), and the memory handoff:

* ``to_generation()`` first releases what generation does not need -- the DDP grad buffers
  (their storage is resized to 0, so every ``main_grad`` and bucket view stays a valid tensor
  object) and, with ``offload_optimizer``, the optimizer state (moved to host memory) -- and then
  builds the generation weights: one bucketed all-gather per micro-DP group (mode ``"3d"``) or
  verl's per-tensor TP all-gather + PP broadcast (mode ``"naive"``, the A/B baseline).
* ``to_training()`` frees the generation storage (tensors that alias the training parameters are
  left alone), gives the grad buffers back zeroed and brings the optimizer state home. The
  switch only reads the training parameters, so nothing is copied back (resident parameters,
  below, move out of the storage first).

Resident parameters (``resident=True``, the paper's zero redundancy). At every switch to generation
the training parameters that the plan can place in the generation storage
(``plan.resident_offsets``) move there (``param.data`` becomes a view of the storage; their own
memory is freed), so their all-gathers are in place and the generation weights hold no second copy
of them; at the switch back they move out again, into memory of their own, and the storage is
freed. Training holds its shards only, generation the storage only; the price is one local copy
of the rank's shards each way (device bandwidth, against the all-gather's link bandwidth), and
for a moment at the start of the switch the storage and the shards together (as the copying path
holds them for the whole of generation). Which shards can move: every one when only pipeline
stages merge (``t == tg``); with TP merges too, every TP-split one if the rollout computes with
stacked shards (``blocks=True``: row-parallel weights and fc1 as ``[s, *training shard]``, see
``plan.py``; the fast decoder does), else the dim-0 splits but fc1. Megatron's distributed
optimizer keeps the parameters in its own contiguous buffer, which they cannot leave: resident
needs it off. Without it, Megatron reads ``param.data`` afresh at every step (the fp16 optimizer
copies its fp32 main weights into it), so the move is safe.

LoRA. With adapters (``engine.adapters``) generation computes with ``W + BA``: each rank merges
its own shards (``Adapters.merged``, no communication) and the merged tensors are what the switch
gathers. ``lora_merge="copy"`` merges into new tensors and leaves the frozen base as it is, so
the merged shards are a second copy of the adapted weights while generating (``redundant_bytes``
counts them) and resident parameters are refused. ``lora_merge="in_place"`` merges into the base
shards themselves and, at the switch back, writes the base back from a host copy taken at the
first switch (on a GPU in one page-locked buffer per dtype, ``host_memory.locked_copies``) --
the base is frozen, so one copy serves every switch until ``drop_base_copy`` (a checkpoint load).
Generation then holds no second copy of any weight and the resident switch works as without
LoRA; the price is host memory for the adapted shards and one host-to-device copy of them per
switch back (exact: the base's own bytes come back).

Verification (``verify``, the run's ``weight_sync.verify``: every sync, the first, or off). Each
rank checks the generation tensors it built against what its micro-DP group's training shards
sent (``verify.SyncCheck``): each member sums a fixed sample of its shards before the gather, one
all-reduce of those partial fingerprints (an int64 per generation tensor) gives what each
generation tensor must hold, and a tensor that is missing, misshapen or different stops the switch
with a ``WeightSyncError`` naming it, its generation shard and the sync's number. Its time is
``verify_seconds``, apart from ``seconds``.

Tied embeddings. With ``tie_embeddings`` the vLLM model ties ``lm_head`` to ``embed_tokens``, so a
generation pipeline of one stage needs only the embedding. With a generation pipeline of several
stages the last one needs the embedding as its output layer too: the last *training* stage holds
it already as ``output_layer.weight`` (Megatron keeps that copy equal to the embedding by
all-reducing their grads), so ``generation_metas`` adds it to the plan as a last-stage parameter
and the last generation stage gathers it like any other; its generation tensor is named
``output_layer.weight`` (``convert`` names it ``model.embed_tokens.weight`` for a tied model).
With one generation stage that copy is no generation parameter but a second source of the
embedding (``tied_copy``): the first and the last training stage each send part of its rows, so
neither pads its segment of the embedding's all-gather for the other (``plan.py``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch
import torch.distributed as dist

from hybridflow.hybrid_engine.execute import (back_to_training, create_micro_dp_groups,
                                              gather_generation_weights, naive_gather,
                                              new_storage, place_shards)
from hybridflow.hybrid_engine.plan import plan_reshard, resident_offsets
from hybridflow.hybrid_engine.verify import VERIFY_MODES, SyncCheck, verified
from hybridflow.models.params import ParamMeta, num_layers_of, owner_stage
from hybridflow.parallel.layout import GenLayout
from hybridflow.training.host_memory import locked_copies

if TYPE_CHECKING:
    from hybridflow.training.engine import TrainEngine

log = logging.getLogger(__name__)

MODES = ("3d", "naive")
LORA_MERGES = ("copy", "in_place")
TIED_OUTPUT = "output_layer.weight"


@dataclass
class GenerationWeights:
    """This rank's weights in the generation layout, and what the switch cost."""

    tensors: dict[str, torch.Tensor]
    """Megatron names (global layer indices) -> this rank's generation TP shard, for the layers of
    its generation pipeline stage, in model order. Valid until ``to_training``."""
    gen_tp_rank: int
    gen_pp_rank: int
    replica: int
    """Generation data-parallel replica: dg * d of them."""
    bytes_received: int
    """Weight bytes this rank received in the switch (padding excluded)."""
    naive_bytes: int
    """What the naive path (TP all-gather + PP broadcast of every tensor) would receive for the
    same switch, from the layouts: the A/B figure."""
    redundant_bytes: int
    """Bytes of the generation tensors that duplicate this rank's own training shards (its own
    pieces copied into the gathered buffers); tensors that alias the training shards count 0.
    With LoRA merged by copy every adapted weight's merged shard counts: it is a second copy
    beside the base (merged in place it is the base's own memory)."""
    seconds: float
    """Wall time of the switch, release of grads/optimizer state included, its verification
    not."""
    verify_seconds: float = 0.0
    """Wall time of the sync's verification (``weight_sync.verify``; 0 when not verified)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def generation_metas(metas: list[ParamMeta], tie_embeddings: bool, gen: GenLayout
                     ) -> list[ParamMeta]:
    """The parameters to reshard: ``metas``, plus the last stage's copy of a tied embedding when the
    generation pipeline has several stages (see the module docstring)."""
    names = {m.name for m in metas}
    if not tie_embeddings or gen.pp == 1 or TIED_OUTPUT in names:
        return list(metas)
    embed = next(m for m in metas if m.position == "pre" and m.tp_dim == 0)
    return list(metas) + [ParamMeta(name=TIED_OUTPUT, shape=embed.shape, tp_dim=0, layer=None,
                                    position="post")]


def tied_copy(metas: list[ParamMeta], tie_embeddings: bool, gen: GenLayout) -> str | None:
    """The name of the last training stage's copy of a tied embedding where it is no generation
    parameter (one generation stage), for ``plan_reshard(tied_copy=...)`` to send from; else
    None."""
    if not tie_embeddings or gen.train.pp == 1 or TIED_OUTPUT in {m.name for m in metas}:
        return None
    return TIED_OUTPUT


def naive_recv_bytes(gen: GenLayout, metas: list[ParamMeta], rank: int, dtype_bytes: int) -> int:
    """Bytes ``naive_gather`` makes ``rank`` receive: the other TP ranks' shards of every
    TP-split parameter of its stage, and every parameter of the other stages in full."""
    train = gen.train
    _, pp_rank, _ = train.coords(rank)
    num_layers = num_layers_of(metas)
    total = 0
    for m in metas:
        if owner_stage(m, train.pp, num_layers, train.last_stage_layers) == pp_rank:
            if m.tp_dim is not None and train.tp > 1:
                total += (train.tp - 1) * math.prod(m.shard_shape(train.tp))
        elif train.pp > 1:
            total += m.numel
    return total * dtype_bytes


def switch_recv_bytes(gen: GenLayout, metas: list[ParamMeta], dtype_bytes: int,
                      mode: str = "3d", bucket_bytes: int = 256 * 2**20,
                      tie_embeddings: bool = False) -> list[int]:
    """Bytes each training rank receives in one switch to ``gen`` (by rank; padding excluded):
    what the reshard plan of ``bucket_bytes`` buckets gathers into it (mode "3d"; with
    ``tie_embeddings`` the last stage's copy sends as in the switch, ``tied_copy``), or
    ``naive_gather``'s TP all-gather and PP broadcast (mode "naive"). What ``hybridflow check``
    reports and the cost model times, from the layouts alone."""
    if mode not in MODES:
        raise ValueError(f"hybrid_engine.mode: unknown mode {mode!r}; use one of {MODES}")
    ranks = range(gen.train.world_size)
    if mode == "naive":
        return [naive_recv_bytes(gen, metas, r, dtype_bytes) for r in ranks]
    plan = plan_reshard(gen, metas, dtype_bytes, bucket_bytes,
                        tied_copy=tied_copy(metas, tie_embeddings, gen))
    return [plan.ranks[r].recv_bytes for r in ranks]


def redundant_bytes(tensors: dict[str, torch.Tensor], train_shards: dict[str, torch.Tensor],
                    metas: list[ParamMeta], gen: GenLayout, rank: int) -> int:
    """Bytes of ``rank``'s generation ``tensors`` whose content it also holds elsewhere, in its
    training shards: its own TP shard of each TP-split parameter of its training stage, all of
    each replicated one. A tensor whose memory holds the training shard itself (an alias, or a
    shard resident in the generation storage) counts nothing."""
    train = gen.train
    _, pp_rank, _ = train.coords(rank)
    num_layers = num_layers_of(metas)
    by_name = {m.name: m for m in metas}
    total = 0
    for name, t in tensors.items():
        m = by_name[name]
        if owner_stage(m, train.pp, num_layers, train.last_stage_layers) != pp_rank:
            continue
        own = train_shards.get(name)
        if own is not None and _inside(own, t):
            continue
        numel = math.prod(m.shard_shape(train.tp)) if m.tp_dim is not None else m.numel
        total += numel * t.element_size()
    return total


def _inside(part: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether ``part``'s memory lies within ``whole``'s (both contiguous)."""
    start, end = whole.data_ptr(), whole.data_ptr() + whole.numel() * whole.element_size()
    return (part.device == whole.device and start <= part.data_ptr()
            and part.data_ptr() + part.numel() * part.element_size() <= end)


class HybridEngine:
    """Switches one rank's actor between its training layout and a generation layout."""

    def __init__(self, engine: TrainEngine, gen_tp: int = 1, gen_pp: int = 1,
                 bucket_mb: float = 256, mode: str = "3d", offload_optimizer: bool = False,
                 resident: bool = False, blocks: bool = False, lora_merge: str = "copy",
                 verify: str = "every"):
        if mode not in MODES:
            raise ValueError(f"hybrid_engine.mode: unknown mode {mode!r}; use one of {MODES}")
        if lora_merge not in LORA_MERGES:
            raise ValueError(f"hybrid_engine.lora_merge: unknown {lora_merge!r}; use one of "
                             f"{LORA_MERGES}")
        if lora_merge == "in_place" and engine.adapters is None:
            raise ValueError("hybrid_engine.lora_merge: in_place merges LoRA adapters, and this "
                             "engine has none; leave it at copy")
        if resident and mode != "3d":
            raise ValueError("hybrid_engine.resident: needs mode '3d' (the naive path gathers "
                             "every tensor anew); set resident to false or mode to '3d'")
        if resident and engine.adapters is not None and lora_merge != "in_place":
            raise ValueError("hybrid_engine.resident: generation computes with the merged LoRA "
                             "weights, which a copying merge keeps apart from the frozen base; "
                             "set resident to false or lora_merge to in_place")
        if not bucket_mb > 0:
            raise ValueError(f"hybrid_engine.bucket_mb: must be > 0, got {bucket_mb}")
        if verify not in VERIFY_MODES:
            raise ValueError(f"weight_sync.verify: unknown {verify!r}; use one of "
                             f"{VERIFY_MODES}")
        self.engine, self.mode, self.offload_optimizer = engine, mode, offload_optimizer
        self.lora_merge = lora_merge
        self._base: dict[str, torch.Tensor] = {}  # host copies of the adapted base shards
        self._base_current = False  # they hold the base the engine has now
        self.rank = dist.get_rank()
        self.gen = GenLayout(train=engine.layout, tp=gen_tp, pp=gen_pp)
        self.metas = generation_metas(list(engine.metas.values()),
                                      engine.model_config.tie_embeddings, self.gen)
        dtypes = {p.dtype for _, p in engine.named_local_params()}
        if len(dtypes) != 1:
            raise ValueError(f"the training parameters hold several dtypes "
                             f"{sorted(map(str, dtypes))}; the reshard needs one")
        self.dtype = dtypes.pop()
        self.dtype_bytes = torch.empty((), dtype=self.dtype).element_size()
        self.plan = plan_reshard(self.gen, self.metas, self.dtype_bytes,
                                 bucket_bytes=max(1, int(bucket_mb * 2**20)), blocks=blocks,
                                 tied_copy=tied_copy(self.metas,
                                                     engine.model_config.tie_embeddings,
                                                     self.gen))
        # Collective over the whole world: every rank builds the same groups in the same order,
        # once; the naive path reuses Megatron's TP and PP groups (and its verification the
        # micro-DP groups, which hold the sources of each generation shard).
        self.verify = verify
        self.groups = (create_micro_dp_groups(self.gen) if mode == "3d" or verify != "off"
                       else None)
        self.check = SyncCheck(self.plan, self.rank, stacked=mode == "3d") \
            if verify != "off" else None
        self.syncs = 0  # switches to generation so far: the version generation holds
        self.replica, self.gen_pp_rank, self.gen_tp_rank = self.gen.coords(self.rank)
        self.naive_bytes = naive_recv_bytes(self.gen, self.metas, self.rank, self.dtype_bytes)
        self._grad_buffers: list[tuple[object, int]] = []  # (Megatron grad buffer, bytes)
        self._offsets = self._resident_offsets() if resident else {}
        self._weights: GenerationWeights | None = None
        self._host: dict[tuple, torch.Tensor] = {}  # pinned homes of offloaded optimizer state
        self.summary = (f"HybridEngine: train view ({engine.layout}) -> generation view "
                        f"({self.gen}); mode {mode}, buckets of {bucket_mb:g} MB"
                        + (", resident parameters" if resident else "")
                        + (", LoRA merged in place" if lora_merge == "in_place" else "")
                        + (", stacked shards" if blocks and self.gen.tp_stride > 1 else ""))
        if self.rank == 0:
            log.info(self.summary)

    @property
    def in_generation(self) -> bool:
        return self._weights is not None

    # ----------------------------------------------------------------------------- the switch
    def to_generation(self) -> GenerationWeights:
        """Release grads (and optimizer state) and build this rank's generation weights;
        verified (``verify``: every sync, or the first of this engine) or ``WeightSyncError``."""
        if self._weights is not None:
            raise RuntimeError("HybridEngine.to_generation: already in the generation layout; "
                               "call to_training() first")
        verify = verified(self.verify, self.syncs + 1)
        self.syncs += 1
        _sync(self.engine.device)
        start = time.perf_counter()
        checked = 0.0
        self._release_grad_buffers()
        if self.offload_optimizer:
            self._move_optimizer_state(torch.device("cpu"))
        if self.engine.device.type == "cuda":
            # The allocator's peak from here on is the generation phase's (the worker reports it
            # before switching back: memory/generation_peak_gib); before, it was training's.
            torch.cuda.reset_peak_memory_stats()
        storage = None
        if self._offsets:
            storage = new_storage(self.plan, self.rank, self.engine.device, self.dtype)
            self._place(storage)
        shards = self._train_shards()
        try:
            source = self._merge_adapters(shards)
            if verify:
                begin = time.perf_counter()
                sent = self.check.sent(source, self.engine.device)  # before anything is sent
                checked += time.perf_counter() - begin
            if self.mode == "3d":
                tensors = gather_generation_weights(self.plan, self.rank, source, self.groups,
                                                    storage=storage)
                received = self.plan.ranks[self.rank].recv_bytes
            else:
                tensors = naive_gather(self.gen, self.metas, self.rank, source, self._train_group)
                received = self.naive_bytes
            if verify:
                _sync(self.engine.device)
                begin = time.perf_counter()
                group = self.groups[self.plan.ranks[self.rank].group]
                self.check.verify(sent, tensors, group, self.dtype, self.syncs)
                checked += time.perf_counter() - begin
        except BaseException:
            if storage is not None:
                self._place(None)
            self._restore_base()
            self._restore_training_memory()  # stay a consistent training engine
            raise
        redundant = redundant_bytes(tensors, shards, self.metas, self.gen, self.rank)
        if self.engine.device.type == "cuda":
            # The freed grads, optimizer state and transient buckets go back to the driver, for the
            # rollout engine's KV cache.
            torch.cuda.empty_cache()
        _sync(self.engine.device)
        self._weights = GenerationWeights(
            tensors=tensors, gen_tp_rank=self.gen_tp_rank, gen_pp_rank=self.gen_pp_rank,
            replica=self.replica, bytes_received=received, naive_bytes=self.naive_bytes,
            redundant_bytes=redundant, seconds=time.perf_counter() - start - checked,
            verify_seconds=checked)
        if self.rank == 0:
            log.info("HybridEngine: to generation in %.3f s, received %.1f MB (naive path: %.1f "
                     "MB)", self._weights.seconds, received / 2**20, self.naive_bytes / 2**20)
        return self._weights

    def to_training(self) -> int:
        """Drop the generation weights, give back grads (zeroed) and optimizer state. Returns the
        generation bytes freed (resident parameters moved out of the storage first)."""
        if self._weights is None:
            raise RuntimeError("HybridEngine.to_training: not in the generation layout; call "
                               "to_generation() first")
        _sync(self.engine.device)
        if self._offsets:
            self._place(None)
        freed = back_to_training(self._weights.tensors, self._train_shards())
        self._weights = None
        self._restore_base()
        self._restore_training_memory()
        return freed

    def drop_base_copy(self) -> None:
        """The host copy of the LoRA base (``lora_merge="in_place"``) is stale: the base weights
        were loaded anew, and the next switch copies them again (into the same host memory)."""
        self._base_current = False

    @property
    def base_copy_bytes(self) -> int:
        """Host bytes of the LoRA base kept for ``lora_merge="in_place"`` (0 before the first
        switch and without it)."""
        return sum(t.numel() * t.element_size() for t in self._base.values())

    # ----------------------------------------------------------------------------- LoRA
    def _merge_adapters(self, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the switch gathers: ``shards``, with LoRA's ``W + BA`` for the adapted weights
        (see the module docstring: new tensors, or the shards themselves overwritten after their
        host copy was taken)."""
        adapters = self.engine.adapters
        if adapters is None:
            return shards
        if self.lora_merge == "copy":
            return adapters.merged(shards)
        if not self._base_current:
            # On the stream of the merge below, so each copy is taken before the overwrite.
            names = list(adapters.modules)  # the adapted base weights
            if self._base:
                for name in names:
                    self._base[name].copy_(shards[name], non_blocking=True)
            elif self.engine.device.type == "cuda":
                self._base = dict(zip(names, locked_copies([shards[n] for n in names], self)))
            else:
                self._base = {name: shards[name].clone() for name in names}
            self._base_current = True
        return adapters.merged(shards, in_place=True)

    def _restore_base(self) -> None:
        """Write the LoRA base back over its merged shards (in-place merges only)."""
        if self.lora_merge != "in_place" or not self._base_current:
            return  # (a switch that failed before its copy: the base was not overwritten)
        shards = self._train_shards()
        for name, host in self._base.items():
            shards[name].copy_(host, non_blocking=True)
        _sync(self.engine.device)

    # ----------------------------------------------------------------------------- helpers
    def _resident_offsets(self) -> dict[str, int]:
        for buf in self.grad_buffers():
            if getattr(buf, "param_data", None) is not None:
                raise ValueError("hybrid_engine.resident: the parameters live in Megatron's "
                                 "contiguous param buffer (distributed optimizer) and cannot move; "
                                 "set it to false, or actor.engine.optim.distributed to false")
        return resident_offsets(self.plan, self.rank)

    def _place(self, storage: torch.Tensor | None) -> None:
        """Move the resident parameters into ``storage`` at their offsets, or (None) out of it,
        each into memory of its own; the memory they leave is freed."""
        moved = place_shards(self._train_shards(), self._offsets, storage)
        for name, param in self.engine.named_local_params():
            if name in self._offsets:
                param.data = moved[name]

    def _train_shards(self) -> dict[str, torch.Tensor]:
        # Every local parameter, also those outside the plan (the last stage's tied output layer
        # when the generation pipeline has one stage): back_to_training must know them all.
        return {name: p.detach() for name, p in self.engine.named_local_params()}

    def _train_group(self, ranks: tuple[int, ...]):
        pg = self.engine.pg
        for group in (pg.tp, pg.pp):
            if tuple(dist.get_process_group_ranks(group)) == tuple(ranks):
                return group
        raise AssertionError(f"no training group with ranks {ranks}")

    def grad_buffers(self) -> Iterator[object]:
        """Megatron's DDP grad buffers of this rank (each has ``grad_data``)."""
        for chunk in self.engine.chunks:
            yield from chunk.buffers
            yield from getattr(chunk, "expert_parallel_buffers", ())

    def _release_grad_buffers(self) -> None:
        # resize_(0) frees the memory but keeps the storage object, so param.main_grad and the
        # buckets' views into grad_data stay valid tensors and come back with the storage.
        for buf in self.grad_buffers():
            storage = buf.grad_data.untyped_storage()
            if storage.nbytes():
                self._grad_buffers.append((buf, storage.nbytes()))
                storage.resize_(0)

    def _restore_training_memory(self) -> None:
        if self.offload_optimizer:
            self._move_optimizer_state(self.engine.device)
        self._restore_grad_buffers()
        _sync(self.engine.device)

    def _restore_grad_buffers(self) -> None:
        for buf, nbytes in self._grad_buffers:
            buf.grad_data.untyped_storage().resize_(nbytes)
            buf.grad_data.zero_()
        self._grad_buffers = []

    def _move_optimizer_state(self, device: torch.device) -> int:
        """Move the optimizer's state (Adam moments, fp32 main weights that are not the model's
        own parameters) to ``device``; returns the bytes moved. A no-op where it already is (on a
        CPU-only machine everything is)."""
        opt = self.engine.optimizer
        if opt is None:
            return 0
        model = {id(p) for chunk in self.engine.chunks for p in chunk.parameters()}
        moved = 0

        def move(key: tuple, t: torch.Tensor) -> torch.Tensor:
            nonlocal moved
            if t.device == device:
                return t
            moved += t.numel() * t.element_size()
            if device.type == "cpu" and t.is_cuda:
                # Pinned host buffers, kept across switches: pinning is slow, copies from it fast.
                host = self._host.get(key)
                if host is None or host.shape != t.shape or host.dtype != t.dtype:
                    host = self._host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                return host.copy_(t, non_blocking=True)
            return t.to(device, non_blocking=True)

        for inner in _inner_optimizers(opt):
            for group in inner.param_groups:
                for p in group["params"]:
                    if id(p) not in model:  # the model's own params are the training weights
                        p.data = move((id(p),), p.data)
            for state in inner.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        state[k] = move((id(state), k), v)
        _sync(device if device.type == "cuda" else self.engine.device)
        return moved


def _inner_optimizers(opt) -> list:
    """The torch optimizers inside a Megatron optimizer (chained or not)."""
    chained = getattr(opt, "chained_optimizers", None) or [opt]
    return [o.optimizer for o in chained if getattr(o, "optimizer", None) is not None]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)

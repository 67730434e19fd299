"""Benchmark the 3D-HybridEngine's train -> generation switch against its floor and two baselines.

    torchrun --nproc-per-node N tools/bench_reshard.py --model llama-7b --train-tp 4 --gen-tp 2
    torchrun --nproc-per-node 2 tools/bench_reshard.py --model llama-7b --layout 2,1,1,1 \
        --layout 1,2,1,1          # several layouts (train tp,pp -> generation tp,pp), one launch

gloo on CPU, NCCL on GPU (one GPU per process, ``cuda:LOCAL_RANK``). For each layout one run
measures, each as the median over ``--iters`` after ``--warmup`` iterations of the slowest rank's
time:

* ``transition_s``: ours, ``gather_generation_weights`` (direct and packed all-gathers in the
  micro-DP groups, coalesced launches, the generation storage allocated inside), and ``back_s``:
  ``back_to_training``;
* ``resident_s``: the HybridEngine's resident switch (the megatron backend's default): the plan
  with stacked shards (``blocks=True``), the storage allocated, the training shards that can live
  in it (``resident_offsets``: every TP-split one with stacked shards) copied there and their
  all-gathers in place; ``resident_back_s``: the shards copied out into memory of their own and
  the storage freed;
* ``verified_s``: ours with ``weight_sync.verify: every`` (the training shards' partial
  fingerprints, the switch, their all-reduce in the micro-DP group and the generation tensors'
  fingerprints, ``hybrid_engine.verify.SyncCheck``), and ``verify_s``: the check alone, after an
  untimed switch; ``verify_frac`` = ``verify_s / transition_s``, against the bound ``0.02``;
* ``floor_s``: one all-gather, in the same micro-DP groups, of as many bytes as our buckets carry
  (padding included), from a ready buffer into a ready buffer: no packing, no allocation;
* ``per_tensor_s``: verl's path (``naive_gather``): all-gather every tensor over the training TP
  group, broadcast it over the training PP group, cut the generation shard;
* ``via_host_s``: the same segments packed into pinned host memory, all-gathered by gloo on the
  host, and copied back to the device in one piece (``--via-host-iters`` runs, no warm-up: it
  takes seconds).
* ``megatron_s``: Megatron-Core's own train -> inference reshard (``megatron.core.resharding``,
  0.16.1): ``swap_model_weights`` from the GPTModel the training engine builds at the training
  layout, its parameters our training shards themselves (no copy), into a GPTModel at the
  generation layout (tp = generation tp, pp = 1, allocated once, before the timing, and kept), by
  the point-to-point plan it builds on the first call and caches, through its ``NCCLCopyService``
  on CUDA and its ``GlooCopyService`` on CPU (``MegatronReshard``). The generation layout is
  ours: both end with the Megatron-named generation shards in the standard layout. What differs:
  its destination model is allocated for good (ours allocates the storage inside the switch and
  frees it going back, so ``back_s`` has no counterpart), and it cannot build a generation
  pipeline (pg > 1), whose layouts it skips.

Weights are random but no rank ever holds the full model: every element's value is a function of
its position in the full tensor (and the tensor's name and ``--seed``), so each rank fills its own
training shards, and the reference for ``max_abs_err`` (each generation tensor cut at the
generation layout) is computed the same way, on every rank, with no communication. Big presets
therefore need no Megatron model and only shard-sized memory.

Memory: ``peak_weight_bytes`` is, on CUDA, ``torch.cuda.max_memory_allocated`` minus the memory
allocated before the switch (the generation storage plus the transient ring);
on CPU, whose allocator keeps no statistics, it is the storage plus the executor's transient
ring. ``redundant_bytes`` are the bytes of generation tensors that repeat this rank's
own training shard (a copy of it, while the training shard lives on); ``resident_*`` are the same
figures for the resident switch (whose peak counts the storage and, for a moment, the shards
beside it), and ``resident_train_extra_bytes`` what it leaves allocated once back in training
beyond the training shards (CUDA: measured; CPU: 0 by construction). Megatron's figures:
``megatron_recv_bytes`` / ``megatron_sent_bytes``, what its copy service receives from and sends to
other ranks (counted at the service: ``CountingCopyService``), against ours
``recv_wire_bytes`` (what our gathers deliver to a rank: ``wire_bytes``), and
``megatron_recv_total_bytes`` / ``recv_wire_total_bytes``, the same summed over the ranks;
``megatron_peak_bytes``, its destination
model plus, on CUDA, ``max_memory_allocated`` above the memory allocated before the swap, on CPU
the buffers its ops hold at once (the receive buffer of every op, the gloo service's host buffer
for each, and the copies of the slices it sends that are not contiguous); ``megatron_max_abs_err``
against the same reference cut and ``megatron_equal_to_ours`` (every destination tensor
``torch.equal`` to ours). The other byte figures are the maximum over ranks.

Only rank 0 prints: readable lines, then, as the last lines of stdout, one JSON object per layout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

# The tool runs from a checkout (torchrun tools/bench_reshard.py), not from an install.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridflow.hybrid_engine.execute import (  # noqa: E402
    back_to_training, broadcast_gather, create_micro_dp_groups, create_train_groups,
    gather_generation_weights, naive_gather, new_storage, place_shards)
from hybridflow.hybrid_engine.plan import ReshardPlan, plan_reshard, resident_offsets  # noqa: E402
from hybridflow.hybrid_engine.switch import (TIED_OUTPUT, generation_metas,  # noqa: E402
                                             naive_recv_bytes, redundant_bytes, tied_copy)
from hybridflow.hybrid_engine.verify import SyncCheck  # noqa: E402
from hybridflow.models.config import ModelConfig  # noqa: E402
from hybridflow.models.params import (  # noqa: E402
    DTYPES, ParamMeta, llama_param_metas, num_layers_of, owner_stage, unstack)
from hybridflow.parallel.layout import GenLayout, TrainLayout  # noqa: E402

PRESETS = {
    # heads and KV heads divisible by 4, so tp=4 works on the tiny model too
    "tiny": dict(vocab_size=512, hidden_size=256, ffn_hidden_size=512, num_layers=4,
                 num_heads=8, num_kv_heads=4, head_dim=32),
    # SmolLM2-135M shapes (tied embeddings): the CPU quickstart's model
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, ffn_hidden_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, tie_embeddings=True),
    # Llama-3.2-1B shapes (tied embeddings)
    "llama-1b": dict(vocab_size=128256, hidden_size=2048, ffn_hidden_size=8192, num_layers=16,
                     num_heads=32, num_kv_heads=8, head_dim=64, tie_embeddings=True),
    # Llama-2-7B and -13B shapes
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, ffn_hidden_size=11008, num_layers=32,
                     num_heads=32, num_kv_heads=32, head_dim=128),
    "llama-13b": dict(vocab_size=32000, hidden_size=5120, ffn_hidden_size=13824, num_layers=40,
                      num_heads=40, num_kv_heads=40, head_dim=128),
}
GiB = 2**30


# ----------------------------------------------------------------------------- weights


def _global_ids(meta: ParamMeta, dim: int, tp: int, tp_rank: int, device) -> torch.Tensor:
    """Indices, in the full tensor, of dim ``dim`` of TP shard ``tp_rank`` (as ``meta.shard``)."""
    size = meta.shape[dim]
    if dim != meta.tp_dim or tp == 1:
        return torch.arange(size, device=device)
    chunk = size // meta.tp_chunks
    sub = chunk // tp
    return torch.cat([torch.arange(c * chunk + tp_rank * sub, c * chunk + (tp_rank + 1) * sub,
                                   device=device) for c in range(meta.tp_chunks)])


def fill_shard(meta: ParamMeta, tp: int, tp_rank: int, salt: int, dtype: torch.dtype,
               device) -> torch.Tensor:
    """The TP shard ``tp_rank`` of a full tensor whose element at flat index g is
    ``((g * 40503 + salt) % 4093 - 2046) * 2**-16``: any shard, at any layout, on any rank,
    without the full tensor."""
    out = torch.empty(meta.shard_shape(tp), dtype=dtype, device=device)
    ids = [_global_ids(meta, d, tp, tp_rank, device) for d in range(len(meta.shape))]

    def value(g: torch.Tensor) -> torch.Tensor:
        return (((g * 40503 + salt) % 4093) - 2046).to(torch.float32) * 2.0**-16

    if len(ids) == 1:
        return out.copy_(value(ids[0]))
    rows, cols = ids
    block = max(1, 2**24 // cols.numel())  # bounds the int64 temporaries
    for start in range(0, rows.numel(), block):
        r = rows[start:start + block]
        out[start:start + r.numel()].copy_(value(r[:, None] * meta.shape[1] + cols[None, :]))
    return out


def salt_of(name: str, seed: int, tied: bool) -> int:
    # a tied output layer is the embedding, element for element
    if tied and name == TIED_OUTPUT:
        name = "embedding.word_embeddings.weight"
    return (zlib.crc32(name.encode()) + 7919 * seed) % 4093


# ----------------------------------------------------------------------------- timing


class Timer:
    """Per-iteration wall time of the slowest rank, the device drained before and after."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        self.sync()
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def __call__(self, fn: Callable[[], object]) -> tuple[float, object]:
        self.barrier()
        start = time.perf_counter()
        out = fn()
        self.sync()
        dt = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=self.device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return float(dt.item()), out


def median_of(timer: Timer, fn: Callable[[], object], warmup: int, iters: int,
              after: Callable[[object], None] = lambda out: None) -> float:
    times = []
    for i in range(warmup + iters):
        dt, out = timer(fn)
        after(out)
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def median_back_of(timer: Timer, switch: Callable[[], object], back: Callable[[object], None],
                   warmup: int, iters: int) -> float:
    """Median seconds of ``back(out)`` after each untimed ``out = switch()``."""
    times = []
    for i in range(warmup + iters):
        out = switch()
        dt, _ = timer(lambda: back(out))
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def all_max(value: float, device, op=dist.ReduceOp.MAX) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """One all-gather into a flat buffer, as the switch gathers: NCCL's, on gloo one broadcast
    per member (``broadcast_gather``; gloo's own all-gather allocates and copies out its whole
    output at every call)."""
    if dist.get_backend(group) == "gloo":
        broadcast_gather(out, inp, group)
    else:
        dist.all_gather_into_tensor(out, inp, group=group)


# ----------------------------------------------------------------------------- the paths


def wire_bytes(st, member: int, group, esz: int) -> int:
    """Bytes our gathers deliver to ``member`` of a micro-DP group (``group``; None: it gathers
    nothing): on gloo, where each bucket is one broadcast per member of the elements its pieces
    span, the other members' extents; elsewhere (all-gathers) their whole segments, padding
    included (``recv_bytes + padding_bytes``)."""
    if group is None:
        return 0
    gloo = dist.get_backend(group) == "gloo"
    return esz * sum(b.extent(k) if gloo else b.seg_numel
                     for b in st.buckets for k in range(b.members) if k != member)


class ViaHost:
    """The segments of our buckets packed into (pinned) host memory, all-gathered by gloo, copied
    back to the device in one piece."""

    def __init__(self, plan: ReshardPlan, rank: int, shards: dict[str, torch.Tensor], group,
                 device: torch.device):
        rp = plan.ranks[rank]
        self.st = plan.stages[rp.gen_pp_rank]
        self.member, self.group, self.device = rp.member, group, device
        self.flat = {n: t.reshape(-1) for n, t in shards.items()}
        self.seg = sum(b.seg_numel for b in self.st.buckets)
        dtype = next(iter(shards.values())).dtype
        pin = device.type == "cuda"
        self.host_seg = torch.zeros(self.seg, dtype=dtype, pin_memory=pin)
        self.host_out = torch.empty(self.st.members * self.seg, dtype=dtype, pin_memory=pin)

    def __call__(self) -> torch.Tensor:
        base = 0
        for b in self.st.buckets:
            for p in b.pieces[self.member]:
                self.host_seg.narrow(0, base + p.dst, p.numel).copy_(
                    self.flat[p.name].narrow(0, p.offset, p.numel), non_blocking=True)
            base += b.seg_numel
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        _all_gather(self.host_out, self.host_seg, self.group)
        out = torch.empty(self.host_out.shape, dtype=self.host_out.dtype, device=self.device)
        return out.copy_(self.host_out, non_blocking=True)


# ----------------------------------------------------------------------------- megatron-core's


class CountingCopyService:
    """A Megatron-Core copy service that counts, per rank, the bytes sent to and received from
    other ranks (own slices are local copies) and the bytes of the buffers it is handed, and passes
    every op on. The CopyService API as ``execute_reshard_plan`` calls it (it prefers the
    ``_with_id`` forms, which the centralized plan always uses)."""

    def __init__(self, inner, rank: int):
        self.inner, self.rank = inner, rank
        self.sent = self.received = self.recv_buffers = self.send_copies = 0
        self.param_storages: set[int] = set()  # data_ptrs of the source parameters' storages

    def _send(self, tensor: torch.Tensor, dest: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.sent += nbytes if dest != self.rank else 0
        if tensor.untyped_storage().data_ptr() not in self.param_storages:
            self.send_copies += nbytes  # execute's .contiguous() of a strided slice

    def _recv(self, tensor: torch.Tensor, src: int) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.received += nbytes if src != self.rank else 0
        self.recv_buffers += nbytes

    def submit_send(self, tensor, dest_rank):
        self._send(tensor, dest_rank)
        self.inner.submit_send(tensor, dest_rank)

    def submit_recv(self, tensor, src_rank):
        self._recv(tensor, src_rank)
        self.inner.submit_recv(tensor, src_rank)

    def submit_send_with_id(self, task_id, tensor, dest_rank):
        self._send(tensor, dest_rank)
        self.inner.submit_send_with_id(task_id, tensor, dest_rank)

    def submit_recv_with_id(self, task_id, tensor, src_rank):
        self._recv(tensor, src_rank)
        self.inner.submit_recv_with_id(task_id, tensor, src_rank)

    def run(self):
        self.inner.run()

    def reset(self) -> None:
        self.sent = self.received = self.recv_buffers = self.send_copies = 0


def megatron_copy_service(device: torch.device):
    """Megatron-Core's copy service for the device: ``NCCLCopyService`` on CUDA,
    ``GlooCopyService`` on CPU. Collective (each creates a group over the world).

    megatron-core 0.16.1's ``GlooCopyService.__init__`` creates a CUDA stream, which fails without
    CUDA, and its ``run`` waits on that stream only when it is set: on CPU the service is built
    here with the attributes ``__init__`` sets, the stream None."""
    from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService
    from megatron.core.resharding.copy_services.nccl_copy_service import NCCLCopyService

    if device.type == "cuda":
        return NCCLCopyService()
    service = GlooCopyService.__new__(GlooCopyService)
    service.rank, service.world_size = dist.get_rank(), dist.get_world_size()
    service.gloo_pg = dist.new_group(backend="gloo")
    service.send_ops, service.recv_ops, service._copy_stream = [], [], None
    return service


class MegatronReshard:
    """Megatron-Core's reshard between two GPTModels: the one the training engine builds at
    ``train`` (``training.model``), whose parameters become ``shards`` themselves, and one at the
    generation layout (tp = ``gen.tp``, pp = 1: ``MegatronRollout``'s model, initialised, since
    initialisation is what marks parameters tensor-parallel, which Megatron's planner reads).
    Collective: every rank builds both, with the groups in the same order."""

    def __init__(self, cfg: ModelConfig, train: TrainLayout, gen: GenLayout, dtype_name: str,
                 shards: dict[str, torch.Tensor], device: torch.device):
        # deferred: Megatron (seconds to import)
        from megatron.core.models.gpt import GPTModel

        from hybridflow.parallel.groups import generation_process_groups, init_megatron_parallel
        from hybridflow.training.config import EngineConfig
        from hybridflow.training.model import (_build_chunks, block_spec, global_name,
                                               transformer_config)

        engine = EngineConfig(dtype=dtype_name)
        pg = init_megatron_parallel(train)
        self.src = _build_chunks(cfg, train, transformer_config(cfg, train, engine), pg)[0]
        for name, p in self.src.named_parameters():
            # A tied output layer's last-stage copy is in ``shards`` where our plan sends from it
            # (``tied_copy``); Megatron's target has no output layer, so it sends nothing of it.
            p.data = shards.get(global_name(self.src, name), p.data)
        gen_pg = generation_process_groups(gen)
        # Megatron's planner reads the target's DP group: the ranks holding the same generation
        # shard (the same generation pp and tp coordinates).
        by_shard: dict[tuple[int, int], list[int]] = {}
        for r in range(dist.get_world_size()):
            by_shard.setdefault(gen.coords(r)[1:], []).append(r)
        for ranks in sorted(by_shard.values()):
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                gen_pg.dp = group
        tf = transformer_config(cfg, TrainLayout(tp=gen.tp), engine)
        self.dst = GPTModel(
            config=tf, transformer_layer_spec=block_spec(tf, vp_stage=None, pp_rank=0, sdpa=False),
            vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
            pre_process=True, post_process=True,
            share_embeddings_and_output_weights=cfg.tie_embeddings,
            position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
            pg_collection=gen_pg).to(device=device, dtype=DTYPES[dtype_name])
        self.dst_params = {global_name(self.dst, n): p for n, p in self.dst.named_parameters()}
        self.dst_bytes = sum(p.numel() * p.element_size() for p in self.dst_params.values())
        self.service = CountingCopyService(megatron_copy_service(device), dist.get_rank())
        self.service.param_storages = {p.untyped_storage().data_ptr()
                                       for p in self.src.parameters()}
        self.host_staging = device.type != "cuda"  # GlooCopyService's host buffer per receive

    def __call__(self) -> None:
        from megatron.core.resharding import reshard_model_weights  # deferred: Megatron

        reshard_model_weights(self.src, self.dst, service=self.service)

    def transient_bytes(self) -> int:
        """The buffers the last swap's ops held at once (see the module docstring; CPU)."""
        staging = self.service.recv_buffers if self.host_staging else 0
        return self.service.recv_buffers + staging + self.service.send_copies

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: p.data for name, p in self.dst_params.items()}


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--train-tp", type=int, default=1)
    ap.add_argument("--train-pp", type=int, default=1)
    ap.add_argument("--gen-tp", type=int, default=1)
    ap.add_argument("--gen-pp", type=int, default=1)
    ap.add_argument("--layout", action="append", default=[], metavar="TP,PP,TG,PG",
                    help="a layout to measure (repeatable); replaces --train-tp/pp, --gen-tp/pp")
    ap.add_argument("--last-stage-layers", type=int, default=None, metavar="L",
                    help="layers on the last training stage of the layouts with pp > 1, the "
                         "others splitting the rest (layout.last_stage_layers); default: even")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--bucket-mb", type=float, default=256.0,
                    help="the largest all-gather of packed (small) parameters")
    ap.add_argument("--min-view-mb", type=float, default=None,
                    help="gathered size from which a row is a direct all-gather (plan default)")
    ap.add_argument("--coalesce-mb", type=float, default=None,
                    help="gathered MB per coalesced launch at most (executor default)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--via-host-iters", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", default="", help="comma-separated paths not to time: "
                    "verify,resident,floor,per_tensor,via_host,megatron")
    args = ap.parse_args(argv)
    layouts = args.layout or [f"{args.train_tp},{args.train_pp},{args.gen_tp},{args.gen_pp}"]
    try:
        args.layouts = [tuple(int(x) for x in lay.split(",")) for lay in layouts]
        assert all(len(lay) == 4 for lay in args.layouts)
    except (ValueError, AssertionError):
        ap.error(f"--layout takes TP,PP,TG,PG (four integers), got {layouts}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    results = []
    try:
        for layout in args.layouts:
            results.append(run(args, device, *layout))
            if cuda:
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        for result in results:
            print(json.dumps(result), flush=True)


def _mb(x: float | None) -> int | None:
    return None if x is None else max(1, int(x * 2**20))


def run(args: argparse.Namespace, device: torch.device, train_tp: int, train_pp: int,
        gen_tp: int, gen_pp: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    skip = {s for s in args.skip.split(",") if s}
    mp = train_tp * train_pp
    if world % mp:
        raise SystemExit(f"train tp x pp = {mp} must divide the world size {world}")
    train = TrainLayout(tp=train_tp, pp=train_pp, dp=world // mp,
                        last_stage_layers=args.last_stage_layers if train_pp > 1 else None)
    gen = GenLayout(train=train, tp=gen_tp, pp=gen_pp)
    cfg = ModelConfig(arch="llama", max_position_embeddings=4096, **PRESETS[args.model])
    dtype = DTYPES[args.dtype]
    esz = torch.empty((), dtype=dtype).element_size()
    metas = generation_metas(llama_param_metas(cfg), cfg.tie_embeddings, gen)
    copy = tied_copy(metas, cfg.tie_embeddings, gen)  # the last stage's, as the switch sends it
    plan = plan_reshard(gen, metas, esz, bucket_bytes=_mb(args.bucket_mb),
                        min_view_bytes=_mb(args.min_view_mb), tied_copy=copy)
    knobs = {} if args.coalesce_mb is None else {"coalesce_bytes": _mb(args.coalesce_mb)}
    rp = plan.ranks[rank]
    st = plan.stages[rp.gen_pp_rank]
    _, pp_rank, tp_rank = train.coords(rank)
    _, gen_pp, gen_tp = gen.coords(rank)
    num_layers = num_layers_of(metas)
    timer = Timer(device)

    # Groups: collective, every rank in the same order.
    groups = create_micro_dp_groups(gen)
    train_groups = create_train_groups(train) if "per_tensor" not in skip else {}
    mine = rp.group
    group = groups[mine]
    host_group = group
    if device.type == "cuda" and gen.micro_dp > 1 and "via_host" not in skip:
        host_groups = {tuple(g): dist.new_group(list(g), backend="gloo")
                       for g in gen.micro_dp_groups()}
        host_group = host_groups[mine]

    shards = {m.name: fill_shard(m, train.tp, tp_rank, salt_of(m.name, args.seed,
                                                                cfg.tie_embeddings), dtype, device)
              for m in metas
              if owner_stage(m, train.pp, num_layers, train.last_stage_layers) == pp_rank}
    if plan.tied is not None and pp_rank == train.pp - 1:  # the tied output layer's copy
        shards[plan.tied.copy.name] = fill_shard(plan.tied.copy, train.tp, tp_rank,
                                                 salt_of(plan.tied.copy.name, args.seed, True),
                                                 dtype, device)
    last = "" if train.last_stage_layers is None else f"l{train.last_stage_layers}"
    layout = f"t{train.tp}p{train.pp}{last}d{train.dp}->tg{gen.tp}pg{gen.pp}"
    direct = sum(all(b.direct(k) is not None for k in range(b.members)) for b in st.buckets)
    kept = sum(b.storage_offset is not None for b in st.buckets)
    say(f"bench_reshard: {args.model} {args.dtype}, train ({train}) -> generation ({gen}), "
        f"world {world}, {dist.get_backend()} on {device.type}; {len(st.buckets)} all-gathers "
        f"({direct} direct, {kept} into the storage), packed ones <= {args.bucket_mb:g} MB")

    # ---- correctness and memory of one instrumented switch
    def check(tensors: dict[str, torch.Tensor]) -> float:
        want = [m for m in metas if owner_stage(m, train.pp, num_layers, train.last_stage_layers)
                // gen.pp_stride == gen_pp]
        if [m.name for m in want] != list(tensors):
            return math.inf
        err = 0.0
        for m in want:
            ref = fill_shard(m, gen.tp, gen_tp, salt_of(m.name, args.seed, cfg.tie_embeddings),
                             dtype, device)
            got = tensors[m.name]
            if got.dim() == ref.dim() + 1:  # stacked training shards
                got = unstack(got, m)
            if got.shape != ref.shape:
                return math.inf
            err = max(err, float((got.float() - ref.float()).abs().max()))
        return err

    def instrumented(switch, back) -> tuple[float, int, int, int, int]:
        """(max_abs_err, peak bytes, redundant bytes, launches, bytes left after the switch
        back) of one switch: ``switch(stats)`` -> (weights, training shards), ``back``."""
        timer.barrier()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        stats: dict = {}
        weights, train_shards = switch(stats)
        timer.sync()
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device) - base
        else:
            peak = stats["transient_bytes"] + st.storage_numel * esz
        err = check(weights)
        redundant = redundant_bytes(weights, train_shards, metas, gen, rank)
        back(weights, train_shards)
        timer.sync()
        left = torch.cuda.memory_allocated(device) - base if device.type == "cuda" else 0
        return err, peak, redundant, stats["launches"], left

    err, peak, redundant, launches, _ = instrumented(
        lambda stats: (gather_generation_weights(plan, rank, shards, groups, stats=stats,
                                                 **knobs), shards), back_to_training)
    gen_bytes = sum(math.prod(p.shape) for p in st.params.values()) * esz

    # ---- ours
    def ours():
        return gather_generation_weights(plan, rank, shards, groups, **knobs)

    transition_s = median_of(timer, ours, args.warmup, args.iters,
                             after=lambda w: back_to_training(w, shards))
    back_s = median_back_of(timer, ours, lambda w: back_to_training(w, shards), args.warmup,
                            args.iters)

    # ---- ours, verified (weight_sync.verify: every), and the check alone
    verify = {}
    if "verify" not in skip:
        sync_check = SyncCheck(plan, rank, stacked=True)

        def checked(weights):
            sync_check.verify(sync_check.sent(shards, device), weights, group, dtype, 1)
            return weights

        times = []
        for i in range(args.warmup + args.iters):  # the check alone, after an untimed switch
            weights = ours()
            dt, _ = timer(lambda: checked(weights))
            back_to_training(weights, shards)
            times += [dt] if i >= args.warmup else []
        verify_s = statistics.median(times)
        verify = {"verified_s": median_of(timer, lambda: checked(ours()), args.warmup,
                                          args.iters, after=lambda w: back_to_training(w, shards)),
                  "verify_s": verify_s,
                  "verify_frac": verify_s / transition_s if transition_s else None,
                  "verify_bound": 0.02}

    # ---- resident: stacked shards; the training shards move into the storage and out again
    resident = {}
    rplan = plan_reshard(gen, metas, esz, bucket_bytes=_mb(args.bucket_mb),
                         min_view_bytes=_mb(args.min_view_mb), blocks=True, tied_copy=copy)
    offsets = resident_offsets(rplan, rank)
    if "resident" not in skip and all_max(len(offsets), device):
        home = {"shards": shards}  # where the training shards live between switches

        def resident_switch(stats=None):
            storage = new_storage(rplan, rank, device, dtype)
            placed = place_shards(home["shards"], offsets, storage)
            home["shards"] = placed
            return gather_generation_weights(rplan, rank, placed, groups, storage=storage,
                                             stats=stats, **knobs), placed

        def resident_back(weights, placed):
            home["shards"] = place_shards(placed, offsets, None)
            back_to_training(weights, home["shards"])

        r_err, r_peak, r_redundant, _, r_left = instrumented(resident_switch, resident_back)
        r_s = median_of(timer, resident_switch, args.warmup, args.iters,
                        after=lambda w: resident_back(*w))
        resident = {
            "resident_s": r_s, "resident_back_s": median_back_of(
                timer, resident_switch, lambda w: resident_back(*w), args.warmup, args.iters),
            "resident_max_abs_err": all_max(r_err, device),
            "resident_peak_weight_bytes": int(all_max(r_peak, device)),
            "resident_redundant_bytes": int(all_max(r_redundant, device)),
            "resident_train_extra_bytes": int(all_max(r_left, device)),
            "resident_params": int(all_max(len(offsets), device)),
            "resident_moved_bytes": int(all_max(sum(shards[n].numel() for n in offsets) * esz,
                                                device)),
        }
        del home

    # ---- floor: the same bytes, one all-gather, ready buffers
    floor_s = 0.0
    seg_total = sum(b.seg_numel for b in st.buckets)
    if group is not None and "floor" not in skip:
        inp = torch.zeros(seg_total, dtype=dtype, device=device)
        out = torch.empty(st.members * seg_total, dtype=dtype, device=device)
        floor_s = median_of(timer, lambda: _all_gather(out, inp, group), args.warmup, args.iters)
        del inp, out

    # ---- per-tensor baseline (verl)
    per_tensor_s = per_tensor_err = per_tensor_peak = None
    if "per_tensor" not in skip:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        naive = naive_gather(gen, metas, rank, shards, train_groups)
        timer.sync()
        if device.type == "cuda":
            per_tensor_peak = torch.cuda.max_memory_allocated(device) - base
        per_tensor_err = check(naive)
        del naive
        per_tensor_s = median_of(
            timer, lambda: naive_gather(gen, metas, rank, shards, train_groups), args.warmup,
            args.iters, after=lambda w: w.clear())

    # ---- via host
    via_host_s = None
    if "via_host" not in skip:
        via_host_s = 0.0
        if group is not None:
            via = ViaHost(plan, rank, shards, host_group, device)
            via_host_s = median_of(timer, via, 0, max(1, args.via_host_iters))
            del via

    # ---- megatron-core's reshard: a GPTModel at each layout, the same shards, the same reference
    megatron = {}
    if "megatron" not in skip and gen.pp == 1:
        mg = MegatronReshard(cfg, train, gen, args.dtype, shards, device)
        for p in mg.dst_params.values():  # a parameter the swap misses shows in the error
            p.data.fill_(1.0)
        timer.barrier()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        mg()  # builds and caches Megatron's plan, then swaps
        timer.sync()
        if device.type == "cuda":
            m_peak = torch.cuda.max_memory_allocated(device) - base + mg.dst_bytes
        else:
            m_peak = mg.transient_bytes() + mg.dst_bytes
        got = mg.weights()
        order = {m.name: i for i, m in enumerate(metas)}
        m_err = check(dict(sorted(got.items(), key=lambda kv: order.get(kv[0], len(order)))))
        ours_w = ours()
        equal = set(ours_w) == set(got) and all(torch.equal(w, got[n]) for n, w in ours_w.items())
        back_to_training(ours_w, shards)
        del ours_w
        plan_ops = mg.dst._cached_reshard_plan
        received, sent = mg.service.received, mg.service.sent
        megatron = {
            "megatron_s": median_of(timer, mg, args.warmup, args.iters),
            "megatron_copy_service": type(mg.service.inner).__name__,
            "megatron_max_abs_err": all_max(m_err, device),
            "megatron_equal_to_ours": not all_max(not equal, device),
            "megatron_recv_bytes": int(all_max(received, device)),
            "megatron_recv_total_bytes": int(all_max(received, device, dist.ReduceOp.SUM)),
            "megatron_sent_bytes": int(all_max(sent, device)),
            "megatron_ops": int(all_max(len(plan_ops.send_ops) + len(plan_ops.recv_ops),
                                        device)),
            "megatron_peak_bytes": int(all_max(m_peak, device)),
            "megatron_model_bytes": int(all_max(mg.dst_bytes, device)),
        }
        del mg, got
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- report (bytes and errors: the maximum over ranks)
    err = all_max(err, device)
    if per_tensor_err is not None:
        per_tensor_err = all_max(per_tensor_err, device)
    recv = int(all_max(rp.recv_bytes, device))
    wire = wire_bytes(st, rp.member, group, esz)
    naive_recv = int(all_max(naive_recv_bytes(gen, metas, rank, esz), device))
    result = {
        "layout": layout, "model": args.model, "dtype": args.dtype, "world": world,
        "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "bucket_mb": args.bucket_mb, "min_view_mb": args.min_view_mb,
        "coalesce_mb": args.coalesce_mb,
        "buckets": len(st.buckets), "direct_buckets": direct, "launches": launches,
        "iters": args.iters,
        "transition_s": transition_s, "back_s": back_s, **verify, "floor_s": floor_s,
        "ratio_to_floor": transition_s / floor_s if floor_s else None,
        **resident,
        "resident_ratio_to_floor": (resident["resident_s"] / floor_s
                                    if floor_s and resident else None),
        "per_tensor_s": per_tensor_s, "via_host_s": via_host_s,
        "via_host_iters": max(1, args.via_host_iters) if via_host_s else None,
        "max_abs_err": err, "per_tensor_max_abs_err": per_tensor_err,
        "gen_weight_bytes": int(all_max(gen_bytes, device)),
        "peak_weight_bytes": int(all_max(peak, device)),
        "peak_source": ("cuda.max_memory_allocated" if device.type == "cuda"
                        else "storage + the executor's transient ring"),
        "per_tensor_peak_bytes": (int(all_max(per_tensor_peak, device))
                                  if per_tensor_peak is not None else None),
        "redundant_bytes": int(all_max(redundant, device)),
        "recv_bytes": recv, "per_tensor_recv_bytes": naive_recv,
        "padding_bytes": int(all_max(rp.padding_bytes, device)),
        "recv_wire_bytes": int(all_max(wire, device)),
        "recv_wire_total_bytes": int(all_max(wire, device, dist.ReduceOp.SUM)),
        **megatron,
    }

    def s(x):
        return "skipped" if x is None else f"{x * 1e3:9.2f} ms"

    def b(x):
        return f"{x / GiB:.3f} GiB" if x >= GiB / 10 else f"{x / 2**20:.2f} MiB"

    def vs_floor(x):
        return f"{x / floor_s:.2f}x floor" if floor_s else "nothing to move"

    say(f"  generation weights {b(result['gen_weight_bytes'])}/rank; receives {b(recv)} "
        f"(per-tensor path: {b(naive_recv)}), padding {b(result['padding_bytes'])}")
    say(f"  train->gen  ours        {s(transition_s)}   ({vs_floor(transition_s)}, "
        f"{launches} launches)")
    if verify:
        frac = verify["verify_frac"]
        say(f"  train->gen  verified    {s(verify['verified_s'])}   (the check alone "
            f"{s(verify['verify_s']).strip()}: "
            + (f"{100 * frac:.2f}% of ours, bound 2%)" if frac is not None else "nothing moved)"))
    if resident:
        say(f"  train->gen  resident    {s(resident['resident_s'])}   "
            f"({vs_floor(resident['resident_s'])}, {resident['resident_params']} shards "
            f"({b(resident['resident_moved_bytes'])}) moved in, gathered in place)")
    say(f"  floor       all-gather  {s(floor_s)}")
    if per_tensor_s is not None:
        say(f"  per-tensor  (verl)      {s(per_tensor_s)}   "
            f"({per_tensor_s / transition_s:.2f}x ours)")
    if via_host_s is not None:
        say(f"  via host    (gloo)      {s(via_host_s)}")
    if megatron:
        say(f"  megatron    ({megatron['megatron_copy_service']}) {s(megatron['megatron_s'])}   "
            f"({megatron['megatron_s'] / transition_s:.2f}x ours, {megatron['megatron_ops']} "
            f"send/recv ops)")
    say(f"  gen->train  ours        {s(back_s)}")
    say(f"  max_abs_err {err:g} (per-tensor {per_tensor_err}), peak "
        f"{b(result['peak_weight_bytes'])} ({result['peak_source']}), redundant "
        f"{b(result['redundant_bytes'])}")
    if megatron:
        say(f"  megatron: max_abs_err {megatron['megatron_max_abs_err']:g}, equal to ours "
            f"{megatron['megatron_equal_to_ours']}; receives "
            f"{b(megatron['megatron_recv_bytes'])} (ours on the wire "
            f"{b(result['recv_wire_bytes'])}; all ranks "
            f"{b(megatron['megatron_recv_total_bytes'])} against ours "
            f"{b(result['recv_wire_total_bytes'])}); peak "
            f"{b(megatron['megatron_peak_bytes'])} (its generation model "
            f"{b(megatron['megatron_model_bytes'])})")
    if resident:
        say(f"  resident: max_abs_err {resident['resident_max_abs_err']:g}, peak "
            f"{b(resident['resident_peak_weight_bytes'])}, redundant "
            f"{b(resident['resident_redundant_bytes'])}, left beyond the shards in training "
            f"{b(resident['resident_train_extra_bytes'])}; gen->train "
            f"{s(resident['resident_back_s'])}")
    return result


if __name__ == "__main__":
    main()

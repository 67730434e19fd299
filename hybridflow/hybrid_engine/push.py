"""The weight push from the training pool to a generation pool of its own (``rollout.mode``
one_step_off or async), verified.

The actor's rank 0 holds the full weights (``TrainEngine.full_weights``: every training shard
gathered, LoRA merged) and broadcasts them to the generation ranks over a gloo group of its own
(``push_group``: rank 0 the sender, ranks 1.. the generation ranks), built on a store of its own
with ``ProcessGroupGloo`` directly, so neither pool's default torch.distributed world is touched
(verl and OpenRLHF use such a stateless group for the same push). ``PushPlan`` fixes, from the
model's parameter list alone, the order of the tensors and their buckets (at most ``bucket_mb``
each, a tensor never split), so both sides agree without talking:

1. a header: the version (the number of updates the weights have had), whether this push is
   verified, and, if it is, the sender's fingerprint of every generation TP shard of every tensor
   (exact integer sums of a fixed sample, ``verify``'s, read in one pass per shard by the probes
   ``PushPlan.receiver_probe`` builds once, ``PushPlan.fingerprints``);
2. one broadcast per bucket, of its tensors flattened in plan order.

Each generation rank takes its TP shard of every tensor (``models.params.shard``) and, when the
push is verified, recomputes its shards' fingerprints in one pass (``check``,
``PushPlan.receiver_probe``): a tensor missing, misshapen,
of another version, or holding other bits at a sampled position (a shard swapped, a bucket left
from the previous version, a fused QKV in another order) raises ``WeightSyncError`` naming the
tensor, the shard and the version.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping

import torch
import torch.distributed as dist

from hybridflow.hybrid_engine.verify import Probe, WeightSyncError, locate, sample
from hybridflow.models.params import ParamMeta, shard

HEADER = 2
"""Entries of the header before the fingerprints: version, verified (0/1)."""


def push_group(address: str, rank: int, size: int, timeout_s: float):
    """A gloo group of ``size`` processes on a store of its own at ``address`` ("file://PATH" on
    one machine, "tcp://HOST:PORT" with rank 0 the store's host), apart from any default
    torch.distributed world of the processes."""
    timeout = datetime.timedelta(seconds=timeout_s or 10 ** 6)
    if address.startswith("file://"):
        store = dist.FileStore(address.removeprefix("file://"), size)
    else:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore("hybridflow-push", store), rank, size, timeout)


@dataclass(frozen=True)
class PushPlan:
    """The tensors of a push (``metas``, in model order), their dtype, their buckets (index
    ranges into ``metas``) and the generation TP size the receivers shard them to."""

    metas: tuple[ParamMeta, ...]
    dtype: torch.dtype
    buckets: tuple[range, ...]
    gen_tp: int

    @classmethod
    def build(cls, metas: list[ParamMeta], dtype: torch.dtype, gen_tp: int,
              bucket_mb: float) -> "PushPlan":
        size = torch.empty((), dtype=dtype).element_size()
        limit, buckets, start, used = bucket_mb * 2**20, [], 0, 0
        for i, m in enumerate(metas):
            nbytes = m.numel * size
            if i > start and used + nbytes > limit:
                buckets.append(range(start, i))
                start, used = i, 0
            used += nbytes
        buckets.append(range(start, len(metas)))
        for m in metas:
            m.shard_shape(gen_tp)  # divides, or says which tensor does not
        return cls(tuple(metas), dtype, tuple(buckets), gen_tp)

    @property
    def nbytes(self) -> int:
        """Bytes of one push's tensors (what every generation rank receives)."""
        return sum(m.numel for m in self.metas) * torch.empty((), dtype=self.dtype).element_size()

    def header_size(self) -> int:
        return HEADER + len(self.metas) * self.gen_tp

    @cached_property
    def _probes(self) -> dict[int, Probe]:
        """``receiver_probe``'s, by generation TP rank, each built at its first use."""
        return {}

    def receiver_probe(self, tp_rank: int) -> Probe:
        """The fingerprints of generation TP shard ``tp_rank`` of every tensor, read from the
        shards in one pass: slot i for tensor i."""
        if tp_rank not in self._probes:
            probe = Probe(len(self.metas))
            for i, m in enumerate(self.metas):
                probe.add(m.name, i, locate(m, sample(m.shape), self.gen_tp, tp_rank),
                          m.shard_shape(self.gen_tp))
            self._probes[tp_rank] = probe
        return self._probes[tp_rank]

    def fingerprints(self, full: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[tensors, gen_tp]``: the fingerprint of every generation TP shard of every tensor
        of ``full`` (full shapes), read from its shards' views as each receiver reads its own."""
        device = full[self.metas[0].name].device
        return torch.stack([
            self.receiver_probe(r)({m.name: shard(full[m.name], m, self.gen_tp, r)
                                    for m in self.metas}, device)
            for r in range(self.gen_tp)], dim=1).cpu()


@dataclass
class Received:
    """What a generation rank holds after a push: its TP shard of every tensor, by name, and the
    header's version and fingerprints (``expected[i, r]``: tensor i's shard r; None when the push
    was not verified)."""

    shards: dict[str, torch.Tensor]
    version: int
    expected: torch.Tensor | None
    seconds: float


def send(group, plan: PushPlan, full: Mapping[str, torch.Tensor], version: int,
         verified: bool) -> float:
    """Rank 0's side of a push of ``full`` (every tensor of the plan, full shape) as
    ``version``; returns the seconds its fingerprints took (0 unless ``verified``)."""
    header = torch.zeros(plan.header_size(), dtype=torch.int64)
    header[0], header[1] = version, int(verified)
    verify_s = 0.0
    if verified:
        start = time.perf_counter()
        header[HEADER:] = plan.fingerprints(full).reshape(-1)
        verify_s = time.perf_counter() - start
    group.broadcast(header, 0).wait()
    for bucket in plan.buckets:
        flat = torch.cat([full[plan.metas[i].name].detach().to("cpu", plan.dtype).reshape(-1)
                          for i in bucket])
        group.broadcast(flat, 0).wait()
    return verify_s


def receive(group, plan: PushPlan, tp_rank: int) -> Received:
    """A generation rank's side of a push: its TP shard ``tp_rank`` of every tensor, and the
    header (``check`` verifies them)."""
    start = time.perf_counter()
    header = torch.zeros(plan.header_size(), dtype=torch.int64)
    group.broadcast(header, 0).wait()
    shards = {}
    for bucket in plan.buckets:
        metas = [plan.metas[i] for i in bucket]
        flat = torch.empty(sum(m.numel for m in metas), dtype=plan.dtype)
        group.broadcast(flat, 0).wait()
        for m, piece in zip(metas, flat.split([m.numel for m in metas])):
            shards[m.name] = shard(piece.view(m.shape), m, plan.gen_tp, tp_rank)
    expected = header[HEADER:].view(len(plan.metas), plan.gen_tp) if header[1] else None
    return Received(shards, int(header[0]), expected, time.perf_counter() - start)


def check(plan: PushPlan, received: Received, tp_rank: int, version: int) -> None:
    """Raise ``WeightSyncError`` for the first tensor of ``received`` (a generation rank's shards
    at TP rank ``tp_rank``) that is missing, of another shape or dtype, or whose fingerprint is
    not the sender's, or if the push carried another version than ``version``."""
    def fail(name: str, detail: str) -> WeightSyncError:
        return WeightSyncError(name, tp_rank, 0, version, detail)

    if received.version != version:
        raise fail("the push header", f"carried version {received.version}")
    for m in plan.metas:
        t = received.shards.get(m.name)
        if t is None:
            raise fail(m.name, "is missing from the pushed weights")
        want = m.shard_shape(plan.gen_tp)
        if (tuple(t.shape), t.dtype) != (want, plan.dtype):
            raise fail(m.name, f"arrived as {t.dtype} {tuple(t.shape)}, expected {plan.dtype} "
                               f"{want} ({math.prod(want) * t.element_size()} bytes)")
    if received.expected is not None:
        got = plan.receiver_probe(tp_rank)(received.shards, torch.device("cpu"))
        sent = received.expected[:, tp_rank]
        for i in torch.nonzero(got != sent).flatten().tolist()[:1]:
            raise fail(plan.metas[i].name, f"arrived with fingerprint {int(got[i])}, the "
                                           f"trainer sent {int(sent[i])}")


def store_address(folder: str | None, host: str | None = None, port: int | None = None) -> str:
    """The push group's store: a file in ``folder`` (one machine), else ``host:port``."""
    if folder is not None:
        return "file://" + os.path.join(folder, "push-store")
    return f"tcp://{host}:{port}"

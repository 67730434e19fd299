"""The 3D-HybridEngine reshard with real gloo collectives: every rank's generation weights equal the
shards cut from the full weights, bit for bit, and so do the naive baseline's.

One launch per world size runs several layouts in the same processes (groups are created for each
layout by all ranks), which keeps the process start-up cost to once per world size. Every layout
runs five ways: coalesced launches (all buckets in one or a few), gathered by broadcasts (gloo's
default) and by all-gathers; one launch per bucket; with the training shards resident in the
generation storage (in place); and resident with stacked shards (``blocks=True``), where a TP
merge copies no training shard either. The tied (qwen2) models hold the last stage's copy of the
embedding, which sends part of it where one generation stage merges the pipeline
(``plan_reshard(tied_copy=...)``).
"""

from __future__ import annotations

import torch

from hybridflow.hybrid_engine.execute import (back_to_training, broadcast_gather,
                                              create_micro_dp_groups,
                                              create_train_groups, gather_generation_weights,
                                              naive_gather, new_storage, place_shards)
from hybridflow.hybrid_engine.plan import plan_reshard, resident_offsets
from hybridflow.models.config import ModelConfig
from hybridflow.hybrid_engine.switch import TIED_OUTPUT, redundant_bytes, tied_copy
from hybridflow.models.params import (llama_param_metas, num_layers_of, owner_stage, shard,
                                      stacked_layout)
from hybridflow.parallel.layout import GenLayout, TrainLayout
from hybridflow.parallel.spawn import spawn

MODEL = dict(vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_heads=8,
             num_kv_heads=4, head_dim=8)
# ((tp, pp, dp[, last_stage_layers]), [(tg, pg), ...], qwen2?, single-tensor all-gather?,
#  min_view_bytes)
DIRECT = 16 * 1024  # all but the norms and the smallest layers are direct rows
CASES_4 = [
    ((4, 1, 1), [(1, 1), (2, 1)], False, None, DIRECT),
    ((2, 2, 1), [(1, 1), (2, 1), (1, 2), (2, 2)], True, None, DIRECT),
    ((2, 2, 1), [(1, 1)], False, False, 1 << 30),  # list all_gather, everything packed
    ((1, 4, 1), [(1, 1)], True, None, DIRECT),
    ((2, 1, 2), [(1, 1)], False, None, DIRECT),
]
CASES_2 = [
    ((2, 1, 1), [(1, 1)], True, None, DIRECT),
    ((1, 2, 1), [(1, 1)], False, None, 1 << 30),
    # uneven stages (1 layer, then 3 and the output layer): one generation stage, and two that
    # keep the training split
    ((1, 2, 1, 3), [(1, 1), (1, 2)], True, None, DIRECT),
]


def _full_weights(metas, seed):
    g = torch.Generator().manual_seed(seed)
    return {m.name: torch.randn(m.shape, generator=g) for m in metas}


def _check(got, want, plan, gen_pp, shards, what, modes=None) -> None:
    assert list(got) == list(want), f"{what}: wrong parameters"
    storage_ptr = None
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), f"{what}: {name}"
        mode = plan.stages[gen_pp].params[name].mode
        if modes is not None:
            modes.add(mode)
        if mode == "alias":
            assert tensor is shards[name]
        elif tensor is shards.get(name):  # gloo's broadcasts: an own whole shard is not copied
            assert mode == "view" and plan.gen.tp == plan.gen.train.tp, f"{what}: {name}"
        else:  # views and copies all live in one flat storage
            ptr = tensor.untyped_storage().data_ptr()
            assert storage_ptr in (None, ptr), f"{what}: {name} outside the storage"
            storage_ptr = ptr


def run_cases(rank: int, world_size: int, cases) -> tuple[list[str], set[str]]:
    # The gather that calibrate and bench_reshard time on gloo: rank r's segment from rank r.
    out = torch.empty(6 * world_size)
    broadcast_gather(out, torch.arange(6.0) + 10 * rank)
    assert torch.equal(out, torch.cat([torch.arange(6.0) + 10 * r for r in range(world_size)]))
    done, modes, tied_cases = [], set(), []
    for (t, p, d, *last), gens, qwen, single, min_view_bytes in cases:
        last = last[0] if last else None
        model = ModelConfig(**MODEL, arch="qwen2" if qwen else "llama", qkv_bias=qwen,
                            tie_embeddings=qwen)
        metas = llama_param_metas(model)
        full = _full_weights(metas, seed=t * 10 + p)
        train = TrainLayout(tp=t, pp=p, dp=d, last_stage_layers=last)
        _, pp_rank, tp_rank = train.coords(rank)
        num_layers = num_layers_of(metas)
        shards = {m.name: shard(full[m.name], m, t, tp_rank) for m in metas
                  if owner_stage(m, p, num_layers, last) == pp_rank}
        if qwen and p > 1 and pp_rank == p - 1:  # the tied output layer: a copy of the embedding
            embed = metas[0]
            shards[TIED_OUTPUT] = shard(full[embed.name], embed, t, tp_rank).clone()
        before = {k: v.clone() for k, v in shards.items()}
        train_groups = create_train_groups(train)
        for tg, pg in gens:
            gen = GenLayout(train=train, tp=tg, pp=pg)
            what = f"train {train} -> generation {gen}, rank {rank}"
            _, gen_pp, gen_tp = gen.coords(rank)
            want = {m.name: shard(full[m.name], m, tg, gen_tp) for m in metas
                    if owner_stage(m, p, num_layers, last) // gen.pp_stride == gen_pp}
            copy = tied_copy(metas, qwen, gen)
            plan = plan_reshard(gen, metas, dtype_bytes=4, bucket_bytes=48 * 1024,
                                min_view_bytes=min_view_bytes, tied_copy=copy)
            if copy is not None and gen.pp == 1 and gen.tp_stride == 1:
                tied_cases.append(what)
                assert plan.tied is not None, what
            groups = create_micro_dp_groups(gen)
            got = gather_generation_weights(plan, rank, shards, groups, single=single)
            _check(got, want, plan, gen_pp, shards, what, modes)
            # gloo gathers by broadcasts, which copy only the rank's packed pieces.
            rp = plan.ranks[rank]
            packed = 4 * sum(piece.numel for b in plan.stages[gen_pp].buckets
                             if b.direct(rp.member) is None for piece in b.pieces[rp.member])
            # stage 0's embedding split with the tied copy is a generation tensor of its own
            split = 4 * metas[0].numel // t if plan.tied is not None and pp_rank == 0 else 0
            if tg == t:
                assert redundant_bytes(got, shards, metas, gen, rank) == packed + split, what
            back_to_training(got, shards)
            # The same with all-gathers.
            got = gather_generation_weights(plan, rank, shards, groups, single=single,
                                            broadcast=False)
            _check(got, want, plan, gen_pp, shards, what + " (all-gathers)")
            naive = naive_gather(gen, metas, rank, shards, train_groups)
            assert list(naive) == list(want)
            for name, tensor in naive.items():
                assert torch.equal(tensor, want[name]), f"{what}: naive, {name}"
            freed = back_to_training(got, shards)
            assert freed == 4 * plan.stages[gen_pp].storage_numel, what

            # One launch per bucket: the transient ring wraps around many times.
            got = gather_generation_weights(plan, rank, shards, groups, single=single,
                                            coalesce_bytes=1)
            _check(got, want, plan, gen_pp, shards, what + " (launch per bucket)")
            back_to_training(got, shards)

            # Resident: the shards that can live in the storage do; they are gathered in place.
            storage = new_storage(plan, rank, "cpu", torch.float32)
            resident = place_shards(shards, resident_offsets(plan, rank), storage)
            got = gather_generation_weights(plan, rank, resident, groups, single=single,
                                            storage=storage)
            _check(got, want, plan, gen_pp, resident, what + " (resident)")
            if gen.micro_dp > 1 and (tg == t or min_view_bytes == DIRECT):
                assert resident_offsets(plan, rank), f"{what}: nothing resident"
            for name in resident_offsets(plan, rank):
                assert torch.equal(resident[name], shards[name]), f"{what}: resident {name}"
            # The storage holds training shards now: going back frees nothing.
            kept = 0 if resident_offsets(plan, rank) else 4 * plan.stages[gen_pp].storage_numel
            assert back_to_training(got, resident) == kept, what

            # Stacked shards, resident: nothing of the rank's own is copied, TP merges included
            # (but the norms when TP and PP merge at once).
            s = gen.tp_stride
            stacked_plan = plan_reshard(gen, metas, dtype_bytes=4, bucket_bytes=48 * 1024,
                                        min_view_bytes=min_view_bytes, blocks=True,
                                        tied_copy=copy)
            storage = new_storage(stacked_plan, rank, "cpu", torch.float32)
            resident = place_shards(shards, resident_offsets(stacked_plan, rank), storage)
            got = gather_generation_weights(stacked_plan, rank, resident, groups, single=single,
                                            storage=storage)
            by_name = {m.name: m for m in metas}
            stacked = {n: torch.stack([shard(full[n], by_name[n], t, gen_tp * s + j)
                                       for j in range(s)])
                       if s > 1 and stacked_layout(by_name[n]) else w for n, w in want.items()}
            _check(got, stacked, stacked_plan, gen_pp, resident, what + " (stacked, resident)")
            norms = 4 * sum(m.numel for m in metas if m.tp_dim is None
                            and owner_stage(m, p, num_layers, last) == pp_rank)
            assert redundant_bytes(got, resident, metas, gen, rank) == (
                norms if s > 1 and gen.pp_stride > 1 else 0) + split, what
            back_to_training(got, resident)

            for name, tensor in shards.items():
                assert torch.equal(tensor, before[name]), f"{what}: training shard {name} changed"
            if any(b.storage_offset is None for b in plan.stages[gen_pp].buckets):
                modes.add("transient bucket")
            done.append(what)
    assert tied_cases, "no case sent from the tied embedding's copy"
    return done, modes


def test_reshard_world_4() -> None:
    results = spawn(run_cases, 4, CASES_4)
    assert all(len(done) == sum(len(c[1]) for c in CASES_4) for done, _ in results)
    # Every way of producing a generation tensor was exercised.
    assert set.union(*(modes for _, modes in results)) == {
        "alias", "view", "concat", "rearrange", "transient bucket"}


def test_reshard_world_2() -> None:
    results = spawn(run_cases, 2, CASES_2)
    assert all(len(done) == sum(len(c[1]) for c in CASES_2) for done, _ in results)


def test_launches_ramp_up_and_down() -> None:
    from hybridflow.hybrid_engine.execute import _launches

    sizes = [10] * 100  # 1000 elements in all, launches of at most 160
    for ramp_down in (False, True):
        launches = _launches(sizes, 160, ramp_down)
        assert [b for launch in launches for b in launch] == list(range(100))
        totals = [sum(sizes[b] for b in launch) for launch in launches]
        assert max(totals) <= 160 and totals[:3] == [20, 40, 80]
        assert (totals[-3:] == [80, 40, 20]) == ramp_down
    assert _launches([5, 500, 5], 100, True) == [[0], [1], [2]]  # too big: a launch alone
    assert _launches(sizes, 1, True) == [[b] for b in range(100)]

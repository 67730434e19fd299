"""The 3D-HybridEngine reshard with real gloo all-gathers: every rank's generation weights equal the
shards cut from the full weights, bit for bit, and so do the naive baseline's.

One launch per world size runs several layouts in the same processes (groups are created for each
layout by all ranks), which keeps the process start-up cost to once per world size.
"""

from __future__ import annotations

import torch

from hybridflow.hybrid_engine.execute import (back_to_training, create_micro_dp_groups,
                                              create_train_groups, gather_generation_weights,
                                              naive_gather)
from hybridflow.hybrid_engine.meta import llama_param_metas, num_layers_of, owner_stage, shard
from hybridflow.hybrid_engine.plan import plan_reshard
from hybridflow.models.config import ModelConfig
from hybridflow.parallel.layout import GenLayout, TrainLayout
from hybridflow.parallel.spawn import spawn

MODEL = dict(vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_heads=8,
             num_kv_heads=4, head_dim=8)
# ((tp, pp, dp), [(tg, pg), ...], qwen2?, single-tensor all-gather?)
CASES_4 = [
    ((4, 1, 1), [(1, 1), (2, 1)], False, None),
    ((2, 2, 1), [(1, 1), (2, 1), (1, 2), (2, 2)], True, None),
    ((2, 2, 1), [(1, 1)], False, False),  # the list all_gather path
    ((1, 4, 1), [(1, 1)], True, None),
    ((2, 1, 2), [(1, 1)], False, None),
]
CASES_2 = [
    ((2, 1, 1), [(1, 1)], True, None),
    ((1, 2, 1), [(1, 1)], False, None),
]


def _full_weights(metas, seed):
    g = torch.Generator().manual_seed(seed)
    return {m.name: torch.randn(m.shape, generator=g) for m in metas}


def run_cases(rank: int, world_size: int, cases) -> tuple[list[str], set[str]]:
    done, modes = [], set()
    for (t, p, d), gens, qwen, single in cases:
        model = ModelConfig(**MODEL, arch="qwen2" if qwen else "llama", qkv_bias=qwen,
                            tie_embeddings=qwen)
        metas = llama_param_metas(model)
        full = _full_weights(metas, seed=t * 10 + p)
        train = TrainLayout(tp=t, pp=p, dp=d)
        _, pp_rank, tp_rank = train.coords(rank)
        num_layers = num_layers_of(metas)
        shards = {m.name: shard(full[m.name], m, t, tp_rank) for m in metas
                  if owner_stage(m, p, num_layers) == pp_rank}
        before = {k: v.clone() for k, v in shards.items()}
        train_groups = create_train_groups(train)
        for tg, pg in gens:
            gen = GenLayout(train=train, tp=tg, pp=pg)
            what = f"train {train} -> generation {gen}"
            _, gen_pp, gen_tp = gen.coords(rank)
            want = {m.name: shard(full[m.name], m, tg, gen_tp) for m in metas
                    if owner_stage(m, p, num_layers) // gen.pp_stride == gen_pp}
            plan = plan_reshard(gen, metas, dtype_bytes=4, bucket_bytes=48 * 1024,
                                min_view_bytes=16 * 1024)
            groups = create_micro_dp_groups(gen)
            got = gather_generation_weights(plan, rank, shards, groups, single=single)
            assert list(got) == list(want), f"{what}: rank {rank} has the wrong parameters"
            storage_ptr = None
            for name, tensor in got.items():
                assert torch.equal(tensor, want[name]), f"{what}: rank {rank} {name}"
                mode = plan.stages[gen_pp].params[name].mode
                modes.add(mode)
                if mode == "alias":
                    assert tensor is shards[name]
                else:  # views and copies all live in one flat storage
                    ptr = tensor.untyped_storage().data_ptr()
                    assert storage_ptr in (None, ptr), f"{what}: {name} outside the storage"
                    storage_ptr = ptr
            naive = naive_gather(gen, metas, rank, shards, train_groups)
            assert list(naive) == list(want)
            for name, tensor in naive.items():
                assert torch.equal(tensor, want[name]), f"{what}: naive, rank {rank} {name}"
            freed = back_to_training(got, shards)
            assert freed == 4 * plan.stages[gen_pp].storage_numel, what
            for name, tensor in shards.items():
                assert torch.equal(tensor, before[name]), f"{what}: training shard {name} changed"
            if any(b.storage_offset is None for b in plan.stages[gen_pp].buckets):
                modes.add("transient bucket")
            done.append(what)
    return done, modes


def test_reshard_world_4() -> None:
    results = spawn(run_cases, 4, CASES_4)
    assert all(len(done) == sum(len(g) for _, g, _, _ in CASES_4) for done, _ in results)
    # Every way of producing a generation tensor was exercised.
    assert set.union(*(modes for _, modes in results)) == {
        "alias", "view", "concat", "rearrange", "transient bucket"}


def test_reshard_world_2() -> None:
    results = spawn(run_cases, 2, CASES_2)
    assert all(len(done) == sum(len(g) for _, g, _, _ in CASES_2) for done, _ in results)

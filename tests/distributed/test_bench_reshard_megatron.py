"""bench_reshard's Megatron-Core baseline (``MegatronReshard``: ``reshard_model_weights`` between
GPTModels at the training and the generation layouts, over its GlooCopyService) builds, on 2 gloo
processes, generation weights equal to ours bit for bit, swap after swap, and its copy service
receives our plan's payload, which is what our gather delivers on gloo: the baseline cannot
silently break or measure something else.

Two cases: tiny TP=2 -> TP=1, where each rank receives exactly what Megatron's does, and tiny with
tied embeddings PP=2 -> TP=1. There the last stage's copy of the embedding is no source of
Megatron's (its target model has no output layer of its own), so its last stage receives the
whole embedding; ours sends half of it from that copy (``plan_reshard(tied_copy=...)``, as the
bench does), so each rank receives half: the same bytes in all, and the busiest rank half an
embedding less.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hybridflow.hybrid_engine.execute import (back_to_training, create_micro_dp_groups,
                                              gather_generation_weights)
from hybridflow.hybrid_engine.plan import plan_reshard
from hybridflow.hybrid_engine.switch import generation_metas, tied_copy
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import llama_param_metas, num_layers_of, owner_stage
from hybridflow.parallel.layout import GenLayout, TrainLayout
from hybridflow.parallel.spawn import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_reshard  # noqa: E402

# (train tp, train pp, tie_embeddings)
CASES = [(2, 1, False), (1, 2, True)]


def _megatron_against_ours(rank: int, world_size: int, cases) -> list[str]:
    done = []
    for t, p, tied in cases:
        cfg = ModelConfig(arch="llama", max_position_embeddings=4096,
                          **{**bench_reshard.PRESETS["tiny"], "tie_embeddings": tied})
        train = TrainLayout(tp=t, pp=p, dp=1)
        gen = GenLayout(train=train, tp=1)
        what = f"train {train} -> generation {gen}, tied={tied}, rank {rank}"
        metas = generation_metas(llama_param_metas(cfg), tied, gen)
        _, pp_rank, tp_rank = train.coords(rank)
        shards = {m.name: bench_reshard.fill_shard(m, t, tp_rank,
                                                   bench_reshard.salt_of(m.name, 0, tied),
                                                   torch.bfloat16, "cpu")
                  for m in metas if owner_stage(m, p, num_layers_of(metas)) == pp_rank}
        plan = plan_reshard(gen, metas, 2, bucket_bytes=256 * 2**20,
                            tied_copy=tied_copy(metas, tied, gen))
        assert (plan.tied is not None) == tied, what
        if tied and pp_rank == p - 1:
            copy = plan.tied.copy
            shards[copy.name] = bench_reshard.fill_shard(
                copy, t, tp_rank, bench_reshard.salt_of(copy.name, 0, tied), torch.bfloat16,
                "cpu")
        before = {n: w.clone() for n, w in shards.items()}
        groups = create_micro_dp_groups(gen)
        ours = gather_generation_weights(plan, rank, shards, groups)
        rp = plan.ranks[rank]
        # what our broadcasts deliver on gloo: the payload, no padding (bench_reshard.wire_bytes)
        ours_wire = bench_reshard.wire_bytes(plan.stages[rp.gen_pp_rank], rp.member,
                                             groups[rp.group], 2)

        mg = bench_reshard.MegatronReshard(cfg, train, gen, "bf16", shards, torch.device("cpu"))
        for swap in range(2):  # the first builds Megatron's plan, the second reuses it
            for param in mg.dst_params.values():
                param.data.fill_(1.0)
            mg.service.reset()
            mg()
            got = mg.weights()
            assert set(got) == set(ours), f"{what}: {sorted(set(got) ^ set(ours))}"
            for name, tensor in ours.items():
                assert torch.equal(got[name], tensor), f"{what}, swap {swap}: {name}"
            assert rp.recv_bytes == ours_wire, what
            # tied: half the embedding (bf16) moves from the last stage's receipts to stage 0's
            half = cfg.vocab_size * cfg.hidden_size if tied else 0
            assert rp.recv_bytes == mg.service.received + (half if pp_rank == 0 else -half), what
        for name, tensor in shards.items():
            assert torch.equal(tensor, before[name]), f"{what}: training shard {name} changed"
        back_to_training(ours, shards)
        done.append(what)
    return done


def test_megatron_reshard_equals_ours() -> None:
    results = spawn(_megatron_against_ours, 2, CASES)
    assert all(len(done) == len(CASES) for done in results)

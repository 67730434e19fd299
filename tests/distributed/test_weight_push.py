"""The verified push from the trainer to a generation pool of its own (``hybrid_engine.push``):
3 gloo processes, rank 0 the trainer's sender, ranks 1 and 2 a generation TP group of 2, over a
group of their own (``push_group``) beside the default world ``spawn`` sets up.

A correct push arrives whole, each receiver with its TP shard. Then the faults users report are
injected on the receiving side, after the copy and before the check, and each must raise a
``WeightSyncError`` naming the tensor, the generation shard and the version: a skipped tensor (its
buffer never written), a tensor missing, two TP shards swapped, a stale bucket (the previous
version's shards of one bucket), a transposed fused QKV, and a push of another version than the
one expected. ``weight_sync.verify: first`` checks the first push only, ``off`` none.
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.parallel.spawn import spawn

pytestmark = pytest.mark.slow  # one 3-process launch

QKV = "decoder.layers.1.self_attention.linear_qkv.weight"
PROJ = "decoder.layers.2.self_attention.linear_proj.weight"  # row-parallel: split on dim 1
FAULTS = ("skipped", "missing", "swap", "stale", "qkv", "version")


def _weights(version: int):
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from tests.distributed.test_switch import MODEL

    cfg = ModelConfig(**MODEL, arch="llama")
    metas = llama_param_metas(cfg)
    full = init_full_weights(metas, seed=3)
    return cfg, metas, {k: v + 0.01 * version for k, v in full.items()}


def _stale_bucket(plan) -> list[str]:
    """The tensors of the plan's second bucket (the one a stale copy leaves behind)."""
    return [plan.metas[i].name for i in plan.buckets[1]]


def _inject(fault, received, plan, cfg, tp_rank, previous):
    from hybridflow.models.params import megatron_qkv_to_vllm, shard

    metas = {m.name: m for m in plan.metas}
    s = received.shards
    if fault == "skipped":
        s[PROJ] = torch.zeros_like(s[PROJ])
    elif fault == "missing":
        del s[PROJ]
    elif fault == "swap":  # the other TP rank's shard
        _, _, full = _weights(2)
        s[PROJ] = shard(full[PROJ], metas[PROJ], plan.gen_tp, 1 - tp_rank)
    elif fault == "stale":
        for name in _stale_bucket(plan):
            s[name] = previous.shards[name]
    elif fault == "qkv":
        s[QKV] = megatron_qkv_to_vllm(s[QKV], cfg, plan.gen_tp)


def run(rank: int, world_size: int, store: str) -> dict:
    import torch.distributed as dist

    from hybridflow.hybrid_engine import push
    from hybridflow.hybrid_engine.verify import WeightSyncError, verified
    from hybridflow.models.params import shard

    assert dist.is_initialized()  # the default world, which the push group leaves alone
    group = push.push_group(f"file://{store}", rank, world_size, 60)
    cfg, metas, _ = _weights(0)
    plan = push.PushPlan.build(metas, torch.float32, gen_tp=2, bucket_mb=0.02)
    assert len(plan.buckets) > 2
    tp_rank = rank - 1
    out: dict = {"buckets": len(plan.buckets), "stale_names": _stale_bucket(plan)}
    # version 1 clean, then each fault on version 2, then verify first/off
    cases = [("clean", 1, "every", 1)] + [(f, 2, "every", 1) for f in FAULTS] + [
        ("first-1", 2, "first", 1), ("first-2", 2, "first", 2), ("off", 2, "off", 1)]
    previous = None
    for case, version, mode, pushes in cases:
        if rank == 0:
            push.send(group, plan, _weights(version)[2], version,
                      verified(mode, pushes))
            continue
        got = push.receive(group, plan, tp_rank)
        fault = "qkv" if case in ("first-1", "first-2", "off") else case
        if fault != "clean":
            _inject(fault, got, plan, cfg, tp_rank, previous)
        try:
            push.check(plan, got, tp_rank, version + (fault == "version"))
            out[case] = {"error": None}
        except WeightSyncError as e:
            out[case] = {"error": str(e), "tensor": e.tensor}
        if case == "clean":
            _, _, full = _weights(1)
            out["exact"] = all(torch.equal(got.shards[m.name],
                                           shard(full[m.name], m, 2, tp_rank)) for m in metas)
            previous = got
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    store = tmp_path_factory.mktemp("push") / "store"
    return spawn(run, 3, str(store))


def test_a_correct_push_arrives_whole_sharded(results):
    for ranks in results[1:]:
        assert ranks["clean"] == {"error": None}
        assert ranks["exact"]


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_is_caught_naming_the_tensor(results, fault):
    for tp_rank, ranks in enumerate(results[1:]):
        got = ranks[fault]
        assert got["error"] is not None, f"shard {tp_rank}: {fault} passed the check"
        want = {"skipped": [PROJ], "missing": [PROJ], "swap": [PROJ], "qkv": [QKV],
                "stale": ranks["stale_names"], "version": ["the push header"]}[fault]
        assert got["tensor"] in want, got["error"]
        version = 3 if fault == "version" else 2
        assert got["error"].startswith(f"weight sync {version}: {got['tensor']} (generation "
                                       f"shard tp {tp_rank}, pp 0)"), got["error"]


def test_first_checks_the_first_push_only_and_off_none(results):
    for ranks in results[1:]:
        assert ranks["first-1"]["tensor"] == QKV
        assert ranks["first-2"] == {"error": None}
        assert ranks["off"] == {"error": None}

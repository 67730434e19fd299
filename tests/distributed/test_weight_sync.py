"""Every weight sync verified: the HybridEngine's switch on a real Megatron TrainEngine, 2 gloo
processes, TP=2 -> 1 and PP=2 -> 1 on the tiny model (fused QKV, SwiGLU fc1).

A correct switch passes in every mode (3d, naive, resident with stacked shards). Then the faults
users report are injected into the execution step's output (``gather_generation_weights`` as the
switch calls it), after the gather and before the check, and each must stop the switch with a
``WeightSyncError`` naming the tensor, its generation shard and the sync: a tensor left zero, a
tensor missing, two shards swapped, a stale bucket (the previous sync's bytes in one bucket of
the storage after the training weights moved on), a transposed fused QKV (vLLM's [q; k; v] where
Megatron's per-group layout is expected). ``weight_sync.verify: first`` checks the first sync
only, ``off`` none.

The workers record each case's outcome instead of failing, so every rank finishes every case.
"""

from __future__ import annotations

import pytest
import torch

from hybridflow.parallel.spawn import spawn

pytestmark = pytest.mark.slow  # one 2-process launch

LAYOUTS = [(2, 1), (1, 2)]  # training (tp, pp) -> generation tp 1, pp 1
QKV = "decoder.layers.1.self_attention.linear_qkv.weight"
FAULTS = ("zero", "missing", "swap", "stale", "qkv")


def _target(layout) -> str:
    """A tensor of the last training stage (received by rank 0) that every fault can touch."""
    return ("decoder.layers.3.mlp.linear_fc1.weight" if layout == (1, 2)
            else "decoder.layers.1.self_attention.linear_proj.weight")


def _flat_storage(tensors, plan) -> torch.Tensor:
    """The generation storage (flat) behind the gathered views."""
    params = plan.stages[0].params
    view = next(t for n, t in tensors.items() if params[n].mode == "view"
                and t.untyped_storage().nbytes() == 4 * plan.stages[0].storage_numel)
    return torch.empty(0, dtype=view.dtype).set_(view.untyped_storage())


def _stale_bucket(plan) -> tuple[int, list[str]]:
    """A bucket kept in the storage, and the generation tensors it holds chunks of."""
    st = plan.stages[0]
    b = next(k for k, bucket in enumerate(st.buckets) if bucket.storage_offset is not None)
    return b, [n for n, gp in st.params.items() if any(c.bucket == b for c in gp.chunks)]


def _inject(fault: str, layout, cfg, plan, old: torch.Tensor | None):
    """A function of the gathered tensors that injects ``fault`` (in place of the dict)."""
    from hybridflow.models.params import megatron_qkv_to_vllm

    name = _target(layout)

    def inject(tensors):
        if fault == "zero":
            tensors[name] = torch.zeros_like(tensors[name])
        elif fault == "missing":
            del tensors[name]
        elif fault == "swap":
            if layout == (2, 1):  # the two TP shards of a row-parallel weight swapped
                a, b = tensors[name].chunk(2, dim=1)
                tensors[name] = torch.cat([b, a], dim=1)
            else:  # two pipeline stages' shards of the same parameter swapped
                other = name.replace("layers.3", "layers.0")
                tensors[name], tensors[other] = tensors[other], tensors[name]
        elif fault == "stale":
            flat = _flat_storage(tensors, plan)
            bucket = plan.stages[0].buckets[_stale_bucket(plan)[0]]
            at = bucket.storage_offset
            flat[at:at + bucket.numel].copy_(old[at:at + bucket.numel])
        elif fault == "qkv":
            tensors[QKV] = megatron_qkv_to_vllm(tensors[QKV], cfg, 1)
        return tensors
    return inject


def _switch(hybrid, inject=None) -> dict:
    """One switch to generation and back, with ``inject`` applied to the gathered tensors; the
    outcome: the error's message, or the verification's seconds."""
    import hybridflow.hybrid_engine.switch as sw
    from hybridflow.hybrid_engine.verify import WeightSyncError

    real = {"gather_generation_weights": sw.gather_generation_weights,
            "naive_gather": sw.naive_gather}
    if inject is not None:
        for key, fn in real.items():
            setattr(sw, key, lambda *a, _fn=fn, **k: inject(_fn(*a, **k)))
    try:
        gw = hybrid.to_generation()
    except WeightSyncError as e:
        return {"error": str(e), "tensor": e.tensor}
    finally:
        for key, fn in real.items():
            setattr(sw, key, fn)
    out = {"error": None, "verify_s": gw.verify_seconds}
    hybrid.to_training()
    return out


def _run_layout(rank: int, layout) -> dict:
    from hybridflow.hybrid_engine.switch import HybridEngine
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.parallel.layout import TrainLayout
    from tests.distributed.test_switch import MODEL, _engine

    t, p = layout
    cfg = ModelConfig(**MODEL, arch="llama")
    engine = _engine(cfg, TrainLayout(tp=t, pp=p, dp=1), init_full_weights(
        llama_param_metas(cfg), seed=3), adam=False)
    out: dict = {}

    def hybrid(mode="3d", verify="every", resident=False):
        return HybridEngine(engine, bucket_mb=0.05, mode=mode, verify=verify, resident=resident,
                            blocks=resident)

    for mode in ("3d", "naive", "resident"):
        out[f"clean-{mode}"] = _switch(hybrid("3d" if mode == "resident" else mode,
                                              resident=mode == "resident"))
    he = hybrid()
    for fault in FAULTS:
        old = None
        if fault == "stale":  # the previous sync's storage, then the training weights move on
            gw = he.to_generation()
            old = _flat_storage(gw.tensors, he.plan).clone()
            he.to_training()
            with torch.no_grad():
                for _, param in engine.named_local_params():
                    param.add_(0.01)
        out[fault] = _switch(he, _inject(fault, layout, cfg, he.plan, old))
        out[fault]["syncs"] = he.syncs
    out["stale_names"] = _stale_bucket(he.plan)[1]
    out["naive-zero"] = _switch(hybrid("naive"), _inject("zero", layout, cfg, he.plan, None))
    # first: the first sync is checked, the second not; off: none
    first = hybrid(verify="first")
    out["first-1"] = _switch(first, _inject("qkv", layout, cfg, he.plan, None))
    out["first-2"] = _switch(first, _inject("qkv", layout, cfg, he.plan, None))
    out["off-1"] = _switch(hybrid(verify="off"), _inject("qkv", layout, cfg, he.plan, None))
    return out


def run_layouts(rank: int, world_size: int) -> dict:
    return {layout: _run_layout(rank, layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def results():
    return spawn(run_layouts, 2)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2-tg1", "pp2-pg1"])
def test_a_correct_switch_passes_in_every_mode(results, layout):
    for ranks in results:
        for mode in ("3d", "naive", "resident"):
            got = ranks[layout][f"clean-{mode}"]
            assert got["error"] is None, got["error"]
            assert got["verify_s"] > 0


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2-tg1", "pp2-pg1"])
def test_each_fault_is_caught_naming_the_tensor(results, layout, fault):
    for rank, ranks in enumerate(results):
        got = ranks[layout][fault]
        assert got["error"] is not None, f"rank {rank}: {fault} passed the check"
        want = {"zero": [_target(layout)], "missing": [_target(layout)],
                "swap": [_target(layout), _target(layout).replace("layers.3", "layers.0")],
                "stale": ranks[layout]["stale_names"], "qkv": [QKV]}[fault]
        assert got["tensor"] in want, got["error"]
        assert got["error"].startswith(f"weight sync {got['syncs']}: {got['tensor']} "
                                       f"(generation shard tp 0, pp 0)"), got["error"]
        if fault == "missing":
            assert "missing" in got["error"]
    assert results[0][layout]["naive-zero"]["tensor"] == _target(layout)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2-tg1", "pp2-pg1"])
def test_first_checks_the_first_sync_only_and_off_none(results, layout):
    for ranks in results:
        r = ranks[layout]
        assert r["first-1"]["tensor"] == QKV and r["first-1"]["error"].startswith(
            "weight sync 1:")
        assert r["first-2"] == {"error": None, "verify_s": 0.0}
        assert r["off-1"] == {"error": None, "verify_s": 0.0}

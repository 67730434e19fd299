"""The planner without processes: the switch's volume and generation memory against the paper's
Table 2, the cost model against hand-computed seconds, the search and `hybridflow plan`."""

from __future__ import annotations

from fractions import Fraction

import pytest

from hybridflow.cli import main
from hybridflow.config import RLConfig, load_config
from hybridflow.mapping.calibrate import Calibration
from hybridflow.mapping.cost import matmul_params, predict, switch_bytes
from hybridflow.mapping.search import apply, candidates, search
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import llama_param_metas
from hybridflow.parallel.layout import GenLayout, TrainLayout

SHAPE = ModelConfig(vocab_size=64, hidden_size=16, ffn_hidden_size=32, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=8)
CALIB = Calibration(device="test", devices=4, matmul_flops={"fp32": 1e9},
                    memory_bandwidth=1e9, all_gather={2: 1e8, 4: 5e7}, broadcast={2: 1e8},
                    host_to_device=None, torch="test", measured_at="2026-12-01T00:00:00+00:00")


# (t, p) -> (tg, pg): TP merges, PP merges, both, and none
TABLE_2_LAYOUTS = [(8, 1, 1, 1), (8, 1, 2, 1), (4, 2, 2, 1), (4, 2, 1, 1), (2, 4, 2, 1),
                   (2, 4, 1, 2), (4, 4, 2, 2), (2, 2, 2, 2)]


@pytest.mark.parametrize("t, p, tg, pg", TABLE_2_LAYOUTS)
def test_switch_volume_and_generation_memory_are_table_2(t, p, tg, pg):
    # HybridFlow's row of Table 2: communication (t*p - tg*pg) / (tg*pg*t*p) * M per device,
    # peak memory of the generation weights M / (tg*pg), for a model whose parameters all split
    # over TP and spread evenly over the stages (the layers' linears; norms and the embedding are
    # what real models add: see hybridflow/hybrid_engine/plan.py).
    shape = ModelConfig(vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=8,
                        num_heads=8, num_kv_heads=8, head_dim=8)
    metas = [m for m in llama_param_metas(shape) if m.position == "layer" and m.tp_dim is not None]
    M = 2 * sum(m.numel for m in metas)  # bf16
    gen = GenLayout(train=TrainLayout(tp=t, pp=p), tp=tg, pp=pg)
    recv, storage = switch_bytes(gen, metas, dtype_bytes=2)
    assert recv == Fraction(t * p - tg * pg, tg * pg * t * p) * M
    assert storage == Fraction(M, tg * pg)
    if gen.micro_dp > 1:  # what the plan allocates for them
        from hybridflow.hybrid_engine.plan import plan_reshard
        plan = plan_reshard(gen, metas, 2, 256 * 2**20)
        assert {st.storage_numel * 2 for st in plan.stages} == {storage}


def config(*overrides):
    return load_config(RLConfig, None, [
        "algorithm.name=grpo", "train_batch_size=2", "rollout.sampling.n=2",
        "data.max_prompt_tokens=8", "rollout.sampling.max_tokens=4", "rollout.backend=megatron",
        "actor.engine.micro_batch_size=2", *overrides])


def test_cost_model_by_hand():
    # N in matmuls, per layer: qkv 32*16, proj 16*16, fc1 64*16, fc2 16*32, two norms 16 each;
    # final norm 16, output layer 64*16 (the untied input table is only indexed).
    n = 2 * (512 + 256 + 1024 + 512 + 32) + 16 + 1024
    assert matmul_params(SHAPE) == n == 5712
    p = predict(config(), {"model": SHAPE}, CALIB)
    # one forward over 4 samples of 12 tokens: 2 N s + attention 4 L h s^2 per sample, at 1e9
    fwd = (2 * n * 12 + 4 * 2 * 16 * 12 ** 2) * 4 / 1e9
    # prefill 2 N * 4 samples * 8 prompt tokens; 3 decode steps, each the slower of its FLOPs
    # (2 N * 4) and its bytes (4 N + the KV cache, 128 bytes per token): FLOPs here
    gen = 2 * n * 4 * 8 / 1e9 + 3 * max(2 * n * 4 / 1e9, (4 * n + 4 * 10 * 128) / 1e9)
    # update: 3 forwards, then Adam's 28 bytes per parameter (the input table included) at 1e9
    update = 3 * fwd + 28 * (n + 64 * 16) / 1e9
    assert p.phases == pytest.approx({"reshard": 0.0, "generate": gen, "old_logprobs": fwd,
                                      "ref_logprobs": fwd, "update_actor": update})
    assert p.step == pytest.approx(gen + 2 * fwd + update)


def test_layout_terms_act():
    one = predict(config(), {"model": SHAPE}, CALIB)
    # The switch gathers the stages.
    pp = predict(config("actor.layout.pp=2"), {"model": SHAPE}, CALIB)
    # pp=2, two forward micro-batches: the 1F1B bubble adds (p - 1) / m = 1/2 of the compute.
    assert pp.terms["old_logprobs"]["compute"] == pytest.approx(
        one.terms["old_logprobs"]["compute"] / 2)
    assert pp.terms["old_logprobs"]["bubble"] == pytest.approx(
        pp.terms["old_logprobs"]["compute"] / 2)
    assert pp.terms["reshard"]["all_gather"] > 0
    # dp=2: half the compute each, plus the gradient all-reduce.
    dp = predict(config("actor.layout.dp=2"), {"model": SHAPE}, CALIB)
    assert dp.terms["update_actor"]["compute"] == pytest.approx(
        one.terms["update_actor"]["compute"] / 2)
    assert dp.terms["update_actor"]["dp_allreduce"] > 0
    assert one.terms["update_actor"]["dp_allreduce"] == 0


def test_search_ranks_what_fits():
    cfg = config("actor.layout.dp=2", "actor.layout.pp=2", "train_batch_size=4")  # 4 devices
    found = candidates(cfg, SHAPE)
    # tp in {1, 2} (kv heads 1: only tp=1), pp in {1, 2}, generation tp | tp, 5 micro-batches
    assert {(o["actor.layout.tp"], o["actor.layout.pp"]) for o in found} == {(1, 1), (1, 2)}
    fits, refused = search(cfg, {"model": SHAPE}, CALIB)
    steps = [m.prediction.step for m in fits]
    assert steps == sorted(steps) and len(fits) + refused["config"] == len(found)
    assert refused["config"] > 0  # micro-batches that do not divide a rank's samples
    best = apply(cfg, fits[0].overrides)
    assert best.actor.layout.world_size == 4


def test_plan_cli(tmp_path, capsys):
    calib = tmp_path / "c.json"
    CALIB.to_json(calib)
    assert main(["plan", "model=tiny-llama", "actor.layout.dp=2",
                 f"cluster.calibration={calib}", f"tracking.out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "1. actor tp=" in out and "configured" in out and "the fastest: actor.layout.tp=" in out
    assert main(["plan", "model=tiny-llama", f"tracking.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "cluster.calibration" in err and "hybridflow calibrate" in err

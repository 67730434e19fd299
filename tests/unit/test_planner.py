"""The planner without processes: the switch's volume and generation memory against the paper's
Table 2, the cost model against hand-computed seconds, the search and `hybridflow plan`."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from hybridflow.cli import main
from hybridflow.config import RLConfig, load_config
from hybridflow.errors import ArgumentError, ConfigError
from hybridflow.planner.rates import Calibration
from hybridflow.planner.cost import matmul_params, predict, switch_bytes
from hybridflow.planner.rates import MicroBatchCosts, PassProfile
from hybridflow.planner.search import MICRO_BATCHES, apply, candidates, search
from hybridflow.models.config import ModelConfig
from hybridflow.models.params import llama_param_metas
from hybridflow.parallel.layout import GenLayout, TrainLayout

SHAPE = ModelConfig(vocab_size=64, hidden_size=16, ffn_hidden_size=32, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=8)
CALIB = Calibration(device="test", devices=4, matmul_flops={"fp32": 1e9},
                    memory_bandwidth=1e9, all_gather={2: 1e8, 4: 5e7}, broadcast={2: 1e8},
                    host_to_device=None, torch="test", measured_at="2026-12-01T00:00:00+00:00")
# Micro-batch costs of nothing but a point-to-point rate: the floors' prices (and an activation
# transfer at pp > 1), in a file `auto` chooses from.
NO_COSTS = MicroBatchCosts(forward_base_s=0, forward_layer_s=0, train_base_s=0, train_layer_s=0,
                           forward_stage_s=0, train_stage_s=0, p2p=1e9)
AUTO_CALIB = dataclasses.replace(CALIB, micro_batches=NO_COSTS)


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
    # The naive path (every tensor gathered over TP, broadcast over PP): all but the own shard.
    naive, _ = switch_bytes(gen, metas, dtype_bytes=2, mode="naive")
    assert naive == Fraction(t * p - 1, t * p) * M
    if gen.micro_dp > 1:  # what the plan allocates for them
        from hybridflow.hybrid_engine.plan import plan_reshard
        plan = plan_reshard(gen, metas, 2, 256 * 2**20)
        assert {st.storage_numel * 2 for st in plan.stages} == {storage}


@pytest.mark.parametrize("mode", ["3d", "naive"])
def test_check_reports_the_switch_bytes_the_cost_model_times(mode):
    from hybridflow.preflight import _reshard_bytes
    from hybridflow.hybrid_engine.switch import generation_metas
    shape = ModelConfig(vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=4,
                        num_heads=8, num_kv_heads=8, head_dim=8)
    cfg = config("actor.layout.tp=2", "actor.layout.pp=2", "rollout.tp=2",
                 f"hybrid_engine.mode={mode}")
    gen = GenLayout(train=cfg.actor.layout, tp=2)
    metas = generation_metas(llama_param_metas(shape), False, gen)
    recv, naive = _reshard_bytes(shape, gen, cfg)
    assert len(recv) == 4
    assert max(recv) == switch_bytes(gen, metas, 4, mode, int(cfg.rollout.bucket_mb * 2**20))[0]
    assert naive == switch_bytes(gen, metas, 4, "naive")[0] > switch_bytes(gen, metas, 4)[0]


def test_check_and_the_cost_model_count_the_tied_copy_sending():
    """Tied embeddings, PP=2 -> one generation stage: the last stage's copy sends half the
    embedding in the switch, so the busiest rank receives half an embedding less, and
    ``hybridflow check`` and the cost model say so."""
    from hybridflow.preflight import _reshard_bytes
    from hybridflow.hybrid_engine.switch import generation_metas, switch_recv_bytes
    shape = ModelConfig(vocab_size=64, hidden_size=64, ffn_hidden_size=128, num_layers=4,
                        num_heads=8, num_kv_heads=8, head_dim=8, tie_embeddings=True)
    cfg = config("actor.layout.pp=2", "rollout.tp=1")
    gen = GenLayout(train=cfg.actor.layout, tp=1)
    metas = generation_metas(llama_param_metas(shape), True, gen)
    bucket = int(cfg.rollout.bucket_mb * 2**20)
    whole = switch_recv_bytes(gen, metas, 4, "3d", bucket)  # the embedding from stage 0 alone
    recv, _ = _reshard_bytes(shape, gen, cfg)
    assert recv == switch_recv_bytes(gen, metas, 4, "3d", bucket, tie_embeddings=True)
    assert recv[1] == whole[1] - 4 * 64 * 64 // 2 and recv[0] == whole[0] + 4 * 64 * 64 // 2
    assert switch_bytes(gen, metas, 4, "3d", bucket, tie_embeddings=True)[0] == max(recv) \
        < max(whole)


def config(*overrides):
    return load_config(RLConfig, None, [
        "algorithm.name=grpo", "train_batch_size=2", "rollout.sampling.n=2",
        "data.max_prompt_tokens=8", "rollout.sampling.max_tokens=4", "rollout.backend=megatron",
        "actor.engine.micro_batch_size=2", *overrides])


# SmolLM2-135M's shape: the quickstart trains it at pp=2 on CPU.
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, ffn_hidden_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, tie_embeddings=True)


def test_uneven_split_moves_the_busiest_stage():
    from hybridflow.planner.cost import attention_flops, forward_flops, stage_matmul_params
    layer = sum(m.numel for m in llama_param_metas(SMOLLM2) if m.layer == 0)
    post = 576 + 49152 * 576  # the final norm, the output layer (tied: counted here)
    # Even: the last stage holds 15 layers and the output layer, the busiest.
    assert stage_matmul_params(SMOLLM2, 2) == [15 * layer, 15 * layer + post]
    # 20/10: stage 0 is now the busiest, by parameters.
    assert stage_matmul_params(SMOLLM2, 2, last=10) == [20 * layer, 10 * layer + post]
    assert stage_matmul_params(SMOLLM2, 4, last=6) == [8 * layer] * 3 + [6 * layer + post]
    assert attention_flops(SMOLLM2, 12, 2, last=13) == [4 * n * 576 * 144 for n in (17, 13)]
    # The quickstart's sequences: 64 prompt and 64 response tokens, the output layer over 65
    # columns. 17/13 balances the stages' FLOPs better than 15/15, and the busiest stage becomes
    # stage 0.
    seq = 128
    even = forward_flops(SMOLLM2, "lm", seq, 2, response=64)
    uneven = forward_flops(SMOLLM2, "lm", seq, 2, response=64, last=13)
    stage0 = 2 * 17 * layer * seq + 4 * 17 * 576 * seq ** 2
    assert uneven == stage0 < even
    assert even == 2 * (15 * layer + 576) * seq + 2 * 49152 * 576 * 65 + 4 * 15 * 576 * seq ** 2


def test_uneven_split_shortens_the_predicted_passes():
    shape = ["data.max_prompt_tokens=64", "rollout.sampling.max_tokens=64", "actor.layout.pp=2"]
    cfg, uneven = config(*shape), config(*shape, "actor.layout.last_stage_layers=13")
    even_p, uneven_p = (predict(c, {"model": SMOLLM2}, CALIB) for c in (cfg, uneven))
    assert uneven_p.phases["ref_logprobs"] < even_p.phases["ref_logprobs"]
    assert uneven_p.phases["update_actor"] < even_p.phases["update_actor"]


def test_search_keeps_a_configured_split_at_its_pp_only():
    cfg = config("actor.layout.pp=2", "actor.layout.last_stage_layers=1")
    at = {"actor.layout.tp": 1, "actor.layout.dp": 1, "rollout.tp": 1,
          "actor.engine.micro_batch_size": 2}
    assert apply(cfg, {**at, "actor.layout.pp": 2}).actor.layout.last_stage_layers == 1
    assert apply(cfg, {**at, "actor.layout.pp": 1}).actor.layout.last_stage_layers is None


def test_cost_model_by_hand():
    # N in matmuls, per layer: qkv 32*16, proj 16*16, fc1 64*16, fc2 16*32, two norms 16 each;
    # final norm 16, output layer 64*16 (the untied input table is only indexed).
    n = 2 * (512 + 256 + 1024 + 512 + 32) + 16 + 1024
    assert matmul_params(SHAPE) == n == 5712
    p = predict(config(), {"model": SHAPE}, CALIB)
    # one forward over 4 samples of 12 tokens: 2 N s + attention 4 L h s^2 per sample, at 1e9,
    # the output layer (64*16) over the 4 response tokens and the last prompt token only
    fwd = (2 * (n - 1024) * 12 + 2 * 1024 * 5 + 4 * 2 * 16 * 12 ** 2) * 4 / 1e9
    # prefill 2 N * 4 samples * 8 prompt tokens; 3 decode steps, each the slower of its FLOPs
    # (2 N * 4) and its bytes (4 N + the KV cache, 128 bytes per token): FLOPs here
    gen = 2 * n * 4 * 8 / 1e9 + 3 * max(2 * n * 4 / 1e9, (4 * n + 4 * 10 * 128) / 1e9)
    # update: 3 forwards, then Adam's 28 bytes per parameter (the input table included) at 1e9
    update = 3 * fwd + 28 * (n + 64 * 16) / 1e9
    # the rollout takes every weight (6736 fp32 parameters) at 1e9 B/s, and the grad buffers
    # come back zeroed (4 bytes per parameter)
    load = zero = 4 * (n + 64 * 16) / 1e9
    # One on-policy update: its own forward gives the old log-probs, which cost no pass.
    assert p.phases == pytest.approx({"reshard": 0.0, "weight_load": load, "generate": gen,
                                      "back_to_train": zero, "ref_logprobs": fwd,
                                      "update_actor": update})
    assert p.step == pytest.approx(load + gen + zero + fwd + update)
    assert (n, fwd, zero) == (N, FWD, WEIGHTS)  # the floors the tests below build on
    # The reward's KL reads them before the update: then they are a forward of their own.
    kl = predict(config("algorithm.kl_in_reward=true"), {"model": SHAPE}, CALIB)
    assert kl.phases["old_logprobs"] == pytest.approx(fwd)
    assert kl.step == pytest.approx(p.step + fwd)


# test_cost_model_by_hand's floors, which the tests below build on: N in matmuls, the matmuls'
# FLOPs of a sequence (the output layer's over its 5 response columns), attention's, one forward
# over the 4 samples, Adam, the weights' bytes (fp32, at 1e9).
N, ATT = 5712, 4 * 2 * 16 * 12 ** 2
MATMUL = 2 * (N - 64 * 16) * 12 + 2 * 64 * 16 * 5
# the same on the last of two stages (layer 1, the final norm, the output layer: 3376 of N)
LAST = 2 * (3376 - 64 * 16) * 12 + 2 * 64 * 16 * 5
FWD = (MATMUL + ATT) * 4 / 1e9
ADAM = 28 * (N + 64 * 16) / 1e9
WEIGHTS = 4 * (N + 64 * 16) / 1e9


# LoRA of rank 4 on every target of SHAPE, per layer: adapted weights qkv 32x16, proj 16x16,
# fc1 64x16, fc2 16x32; adapters 4 x (in + out) each: 4*(16+32) + 4*(16+16) + 4*(16+64) +
# 4*(32+16).
ADAPTED, ADAPTERS = 2 * (512 + 256 + 1024 + 512), 2 * (192 + 128 + 320 + 192)


def test_cost_model_with_lora_by_hand():
    from hybridflow.training.lora import lora_param_counts
    cfg = config("actor.lora.rank=4")
    assert lora_param_counts(SHAPE, cfg.actor.lora) == (ADAPTED, ADAPTERS) == (4608, 1664)
    p = predict(cfg, {"model": SHAPE}, CALIB)
    n, a, att, fwd = N, ADAPTERS, ATT, FWD
    # The frozen base's matmuls: forward + input gradients, twice the forward's; attention's
    # backward (no weights) still twice its forward; the adapters 6 A a token.
    update = (2 * MATMUL + 3 * att + 6 * a * 12) * 4 / 1e9
    u = p.terms["update_actor"]
    assert u["compute"] == pytest.approx(update, rel=1e-12)
    assert u["compute"] < 3 * fwd  # below the full fine-tuning's three forwards
    # Adam over the adapters only (28 bytes each), zeroed grad buffers of the adapters only.
    assert u["optimizer"] == pytest.approx(28 * a / 1e9, rel=1e-12)
    assert p.terms["back_to_train"] == pytest.approx({"zero_grads": 4 * a / 1e9}, rel=1e-12)
    # The switch merges W + scaling B A per adapted weight in fp32: 2 r rows cols FLOPs at the
    # fp32 rate, 24 bytes of fp32 traffic and W's own read and write (2 x 4) per element at B.
    merge = 2 * 4 * ADAPTED / 1e9 + (24 + 2 * 4) * ADAPTED / 1e9
    assert p.terms["reshard"] == pytest.approx({"all_gather": 0.0, "merge": merge}, rel=1e-12)
    # The reference is the actor with its adapters off: the base's forward, as without LoRA.
    assert p.terms["ref_logprobs"]["compute"] == pytest.approx(fwd, rel=1e-12)
    assert p.phases == pytest.approx({
        "reshard": merge, "weight_load": 4 * (n + 64 * 16) / 1e9,
        "generate": predict(config(), {"model": SHAPE}, CALIB).phases["generate"],
        "back_to_train": 4 * a / 1e9, "ref_logprobs": fwd,
        "update_actor": update + 28 * a / 1e9}, rel=1e-12)
    # The old log-probs are the actor's forward with the adapters on: 2 A a token more.
    kl = predict(config("actor.lora.rank=4", "algorithm.kl_in_reward=true"), {"model": SHAPE},
                 CALIB)
    assert kl.phases["old_logprobs"] == pytest.approx((MATMUL + att + 2 * a * 12) * 4 / 1e9,
                                                      rel=1e-12)


def test_lora_merged_in_place_restores_the_base_from_host_memory():
    calib = dataclasses.replace(CALIB, host_to_device=2e8)
    copy = predict(config("actor.lora.rank=4"), {"model": SHAPE}, calib)
    in_place = predict(config("actor.lora.rank=4", "hybrid_engine.lora_merge=in_place"),
                       {"model": SHAPE}, calib)
    # the adapted base shards (fp32) written back at the host-to-device rate, nothing else moves
    restore = 4 * ADAPTED / 2e8
    assert "restore_base" not in copy.terms["back_to_train"]
    assert in_place.terms["back_to_train"] == pytest.approx(
        copy.terms["back_to_train"] | {"restore_base": restore}, rel=1e-12)
    assert in_place.step == pytest.approx(copy.step + restore, rel=1e-12)
    # On CPU (no host-to-device rate) the host copy is one of host memory: at the copy bandwidth.
    cpu = predict(config("actor.lora.rank=4", "hybrid_engine.lora_merge=in_place"),
                  {"model": SHAPE}, CALIB)
    assert cpu.terms["back_to_train"]["restore_base"] == pytest.approx(4 * ADAPTED / 1e9,
                                                                       rel=1e-12)


def test_offload_moves_the_estimated_bytes_at_the_host_rate():
    calib = dataclasses.replace(CALIB, host_to_device=2e8)
    base = predict(config(), {"model": SHAPE}, calib)
    off = predict(config("ref.offload=true", "hybrid_engine.offload_optimizer=true"),
                  {"model": SHAPE}, calib)
    # The reference's fp32 weights (6736 parameters) stream in once per forward micro-batch (4
    # samples, 2 a micro-batch) and nothing goes back; Adam's two fp32 moments (8 bytes a
    # parameter) go out for generation and come back.
    weights, moments = 4 * (N + 64 * 16), 8 * (N + 64 * 16)
    assert off.terms["ref_logprobs"] == pytest.approx(
        base.terms["ref_logprobs"] | {"host_stream": 2 * weights / 2e8}, rel=1e-12)
    assert off.terms["reshard"] == pytest.approx(
        base.terms["reshard"] | {"optimizer_out": moments / 2e8}, rel=1e-12)
    assert off.terms["back_to_train"] == pytest.approx(
        base.terms["back_to_train"] | {"optimizer_in": moments / 2e8}, rel=1e-12)
    assert off.step == pytest.approx(base.step + (2 * weights + 2 * moments) / 2e8, rel=1e-12)
    # one sequence a forward micro-batch: four copies of the weights
    one = predict(config("ref.offload=true", "actor.engine.forward_micro_batch_size=1"),
                  {"model": SHAPE}, calib)
    assert one.terms["ref_logprobs"]["host_stream"] == pytest.approx(4 * weights / 2e8,
                                                                     rel=1e-12)


def test_lora_terms_split_over_the_stages_and_take_the_training_efficiency():
    one = predict(config("actor.lora.rank=4"), {"model": SHAPE}, CALIB)
    pp = predict(config("actor.lora.rank=4", "actor.layout.pp=2"), {"model": SHAPE}, CALIB)
    # pp=2: a rank merges and zeroes half the adapted weights and adapters; the busiest stage
    # (the last: 3376 parameters in matmuls, one layer's attention and adapters) trains its
    # 4 samples of 12 tokens in two micro-batches, the bubble half of that.
    assert pp.terms["reshard"]["merge"] == pytest.approx(one.terms["reshard"]["merge"] / 2,
                                                         rel=1e-12)
    assert pp.terms["back_to_train"]["zero_grads"] == pytest.approx(
        one.terms["back_to_train"]["zero_grads"] / 2, rel=1e-12)
    u = pp.terms["update_actor"]
    compute = (2 * LAST + 3 * 4 * 16 * 12 ** 2 + 6 * ADAPTERS // 2 * 12) * 4 / 1e9
    assert u["compute"] == pytest.approx(compute, rel=1e-12)
    assert u["bubble"] == pytest.approx(compute / 2, rel=1e-12)
    # With the model's (full fine-tuning) pass profile, the LoRA floor over the training
    # efficiency at the micro-batch of 2 (0.25), Adam's over the optimizer's.
    calib = dataclasses.replace(CALIB, passes=[PassProfile(**HAND)])
    prof = predict(config("actor.lora.rank=4"), {"model": SHAPE}, calib)
    assert prof.terms["update_actor"]["compute"] == pytest.approx(
        one.terms["update_actor"]["compute"] / 0.25, rel=1e-12)
    assert prof.terms["update_actor"]["optimizer"] == pytest.approx(
        one.terms["update_actor"]["optimizer"] / 0.5, rel=1e-12)


def test_a_token_budget_packs_its_full_length_sequences():
    # 12 tokens a sequence: a budget of 24 packs 2 (micro-batches of 2, as micro_batch_size=2),
    # of 35 still 2, of 59 four, of 12 one, and one even where the budget is below it.
    budget = "actor.engine.max_tokens_per_micro_batch="
    layout = ("actor.layout.pp=2", "rollout.tp=1")
    sized = {b: predict(config(f"actor.engine.micro_batch_size={b}", *layout), {"model": SHAPE},
                        FIXED_CALIB) for b in (1, 2, 4)}
    # the sizes predict apart, so a budget's equality with one of them is its own
    assert len({s.phases["update_actor"] for s in sized.values()}) == 3
    for tokens, rows in ((24, 2), (35, 2), (59, 4), (12, 1), (8, 1)):
        p = predict(config(budget + str(tokens), *layout), {"model": SHAPE}, FIXED_CALIB)
        assert p.terms == sized[rows].terms, tokens
    # The planner keeps the budget: no micro-batch sizes searched, none in the overrides.
    cfg = config(budget + "24", "actor.layout.dp=2", "rollout.tp=1")
    found = candidates(cfg, SHAPE)
    assert found and all("actor.engine.micro_batch_size" not in o for o in found)
    assert len(found) == len(candidates(config("actor.layout.dp=2", "rollout.tp=1"), SHAPE)) \
        // len(MICRO_BATCHES)
    fits, _ = search(cfg, {"model": SHAPE}, FIXED_CALIB)
    assert fits and fits[0].describe().endswith("the configured token budget")
    assert apply(cfg, fits[0].overrides).actor.engine.max_tokens_per_micro_batch == 24
    # PPO: each role's budget keeps that role's micro-batches; the other's sizes are searched.
    for with_budget, searched in (("critic", "actor"), ("actor", "critic")):
        found = candidates(config("algorithm.name=ppo", "rollout.tp=1",
                                  f"{with_budget}.engine.max_tokens_per_micro_batch=24"), SHAPE)
        assert all(f"{with_budget}.engine.micro_batch_size" not in o for o in found)
        assert {o[f"{searched}.engine.micro_batch_size"] for o in found} == set(MICRO_BATCHES)


def test_layout_terms_act():
    one = predict(config(), {"model": SHAPE}, CALIB)
    # The switch gathers the stages.
    pp = predict(config("actor.layout.pp=2"), {"model": SHAPE}, CALIB)
    # pp=2: the busiest stage is the last (layer 1, the final norm, the output layer: 3376 of
    # the 5712 parameters in matmuls, one layer's attention) over 4 samples of 12 tokens;
    # two forward micro-batches: the 1F1B bubble adds (p - 1) / m = 1/2 of that.
    assert pp.terms["ref_logprobs"]["compute"] == pytest.approx(
        (LAST + 4 * 16 * 12 ** 2) * 4 / 1e9)
    assert pp.terms["ref_logprobs"]["bubble"] == pytest.approx(
        pp.terms["ref_logprobs"]["compute"] / 2)
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
    # LoRA runs are planned too: every mapping's switch merges the adapters.
    assert main(["plan", "model=tiny-llama", "actor.layout.dp=2", "actor.lora.rank=4",
                 f"cluster.calibration={calib}", f"tracking.out_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "1. actor tp=" in out and "configured" in out and "the fastest: actor.layout.tp=" in out
    assert main(["plan", "model=tiny-llama", f"tracking.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "cluster.calibration" in err and "hybridflow calibrate" in err


def hand_profile(cfg, shape, efficiency, tp=1, fixed=None, adapters=None):
    """The seconds the profile's passes would take at ``tp`` if every pass ran at
    ``efficiency[kind][b]`` of its floor at micro-batch size b plus ``fixed[kind]`` seconds a
    pass (default ``FIXED``), and Adam at ``efficiency["optimizer"]`` of its. ``adapters``: the
    LoRA adapters' parameters of ``cfg.actor.lora`` (their floors: the frozen base's matmuls
    twice the forward's, attention three times, the adapters' forward 2 A a token, their
    training 6 A; Adam over A)."""
    from hybridflow.planner.memory import param_count
    from hybridflow.planner.cost import ADAM_BYTES, forward_flops, generation_floor, weights_bytes
    fixed = FIXED if fixed is None else fixed
    forward = forward_flops(shape, "lm", 12, response=4)  # as profile_passes runs
    floors = {"forward": forward / 1e9 / tp, "train": 3 * forward / 1e9 / tp}
    if adapters is not None:
        matmuls = forward - ATT  # a layer's attention 4 h s^2, as ATT counts it
        floors = {"forward": (forward + 2 * adapters * 12) / 1e9 / tp,
                  "train": (2 * matmuls + 3 * ATT + 6 * adapters * 12) / 1e9 / tp}
    trained = param_count(shape) if adapters is None else adapters
    adam = ADAM_BYTES * trained / 1e9 / efficiency["optimizer"] / tp
    times = {"optimizer": adam}
    for kind in ("forward", "train"):
        extra = fixed[kind] + (adam if kind == "train" else 0.0)
        times[kind] = {}
        for b, e in efficiency[kind].items():
            one = floors[kind] * b / e  # one micro-batch of b sequences
            times[kind][b] = (one + extra, 2 * one + extra)
    from hybridflow.planner.profile import _share  # one replica's samples, as measured
    gen = sum(generation_floor(shape, "fp32", CALIB, _share(cfg), 8, 4, tg=1).values())
    times["generate"] = gen / efficiency["generate"]
    times["weight_load"] = weights_bytes(shape, "fp32", 1) / 1e9 / efficiency["weight_load"]
    return times


# by micro-batch size: small ones run further below the floor
EFFICIENCY = {"forward": {1: 0.2, 2: 0.4, 4: 0.5}, "train": {1: 0.1, 2: 0.25, 4: 0.3},
              "optimizer": 0.5, "generate": 0.2, "weight_load": 2.0}
# seconds a pass costs however many micro-batches it has (the training step's without Adam's)
FIXED = {"forward": 0.003, "train": 0.011}


def test_profile_fit_recovers_the_efficiencies():
    import math

    from hybridflow.planner.profile import efficiencies, micro_batch_sizes
    cfg = config()
    assert micro_batch_sizes(cfg) == [1, 2, 4]  # the search's sizes up to the 4 samples
    # --configured-sizes: only the config's (training and forward micro-batch)
    assert micro_batch_sizes(cfg, configured_only=True) == sorted(
        {cfg.actor.engine.micro_batch_size} | ({cfg.actor.engine.forward_micro_batch_size}
                                               - {None}))
    profile = efficiencies(cfg, SHAPE, CALIB, hand_profile(cfg, SHAPE, EFFICIENCY))
    assert (profile.seq, profile.micro_batches, profile.backend) == (12, [1, 2, 4], "megatron")
    for kind in ("forward", "train"):
        assert profile.__dict__[kind] == pytest.approx(list(EFFICIENCY[kind].values())), kind
    for kind in ("optimizer", "generate", "weight_load"):
        assert getattr(profile, kind) == pytest.approx(EFFICIENCY[kind]), kind
    # the optimizer's step, timed on its own, is taken out of the training step's fixed part
    assert profile.forward_fixed_s == pytest.approx(FIXED["forward"])
    assert profile.train_fixed_s == pytest.approx(FIXED["train"])
    # Between the measured sizes linear in log2(b); outside them the nearest one's.
    assert profile.efficiency("forward", 2) == pytest.approx(0.4)
    assert profile.efficiency("forward", 3) == pytest.approx(0.4 + math.log2(1.5) * 0.1)
    assert profile.efficiency("train", 0.5) == profile.train[0] == pytest.approx(0.1)
    assert profile.efficiency("train", 16) == profile.train[-1] == pytest.approx(0.3)
    # The same seconds measured by an engine that recomputes its layers did the recompute's
    # FLOPs too: a higher training efficiency, by the floors' ratio; the forward's unchanged.
    from hybridflow.planner.cost import train_flops
    again = efficiencies(config("actor.engine.recompute=true"), SHAPE, CALIB,
                         hand_profile(cfg, SHAPE, EFFICIENCY))
    ratio = (train_flops(SHAPE, "lm", 12, response=4, recompute=True)
             / train_flops(SHAPE, "lm", 12, response=4))
    assert ratio > 1.2
    assert again.train == pytest.approx([e * ratio for e in profile.train])
    assert again.forward == profile.forward


def test_a_lora_profile_is_kept_under_its_adapters_and_read_for_them(tmp_path):
    from hybridflow.planner.profile import efficiencies
    cfg = config("actor.lora.rank=4")
    # The seconds a LoRA engine would take at half full fine-tuning's training efficiency (the
    # host's work per micro-batch does not shrink with the floor): recovered against LoRA's
    # floors, not full fine-tuning's.
    lora_eff = EFFICIENCY | {"train": {b: e / 2 for b, e in EFFICIENCY["train"].items()},
                             "optimizer": 0.05}
    lora = efficiencies(cfg, SHAPE, CALIB, hand_profile(cfg, SHAPE, lora_eff,
                                                        adapters=ADAPTERS))
    assert lora.lora == {"rank": 4, "target_modules": list(cfg.actor.lora.target_modules)}
    assert lora.train == pytest.approx([0.05, 0.125, 0.15])
    assert lora.forward == pytest.approx([0.2, 0.4, 0.5])
    assert lora.optimizer == pytest.approx(0.05)
    assert lora.train_fixed_s == pytest.approx(FIXED["train"])
    assert "LoRA rank 4 on linear_qkv/" in lora.describe()
    full = PassProfile(**HAND)
    calib = dataclasses.replace(CALIB, passes=[lora, full])
    # Each run reads its own: full fine-tuning the full profile (though the LoRA one is newer),
    # LoRA the LoRA one; LoRA of another rank full fine-tuning's (no profile of its adapters).
    assert calib.profile(SHAPE, "fp32") is full
    assert calib.profile(SHAPE, "fp32", lora=cfg.actor.lora) is lora
    assert calib.profile(SHAPE, "fp32", lora=config("actor.lora.rank=8").actor.lora) is full
    assert dataclasses.replace(CALIB, passes=[lora]).profile(SHAPE, "fp32") is None
    floors = predict(cfg, {"model": SHAPE}, CALIB)
    p = predict(cfg, {"model": SHAPE}, calib)
    # micro-batches of 2: the LoRA training efficiency there (0.125), not full's (0.25)
    assert p.terms["update_actor"]["compute"] == pytest.approx(
        floors.terms["update_actor"]["compute"] / 0.125, rel=1e-12)
    assert p.terms["update_actor"]["optimizer"] == pytest.approx(
        floors.terms["update_actor"]["optimizer"] / 0.05, rel=1e-12)
    assert p.terms["ref_logprobs"]["compute"] == pytest.approx(
        floors.terms["ref_logprobs"]["compute"] / 0.4, rel=1e-12)
    assert predict(config(), {"model": SHAPE}, calib).terms["update_actor"]["compute"] == \
        pytest.approx(predict(config(), {"model": SHAPE}, CALIB).terms["update_actor"]["compute"]
                      / 0.25, rel=1e-12)
    # The file keeps the adapters' key; a bad one is named.
    calib.to_json(tmp_path / "c.json")
    assert Calibration.from_json(tmp_path / "c.json").passes == [lora, full]
    with pytest.raises(ArgumentError, match="^lora: must be null or"):
        PassProfile(**HAND, lora={"rank": 4})
    with pytest.raises(ConfigError, match="rank"):
        PassProfile(**HAND, lora={"rank": -1, "target_modules": ["linear_qkv"]})


def test_profile_scales_the_prediction_of_its_model_only(tmp_path):
    from hybridflow.planner.profile import efficiencies
    cfg = config("actor.layout.dp=2", "rollout.tp=1")
    profile = efficiencies(cfg, SHAPE, CALIB, hand_profile(cfg, SHAPE, EFFICIENCY))
    calib = dataclasses.replace(CALIB, passes=[profile])
    floors, p = predict(cfg, {"model": SHAPE}, CALIB), predict(cfg, {"model": SHAPE}, calib)
    assert not floors.profiled and p.profiled and "measured efficiencies" in p.describe("f")
    # dp=2: one micro-batch of 2 per rank (4 samples / 2 ranks): the efficiencies at 2
    assert p.terms["ref_logprobs"]["compute"] == pytest.approx(
        floors.terms["ref_logprobs"]["compute"] / 0.4)
    assert p.terms["update_actor"]["compute"] == pytest.approx(
        floors.terms["update_actor"]["compute"] / 0.25)
    assert p.terms["update_actor"]["optimizer"] == pytest.approx(
        floors.terms["update_actor"]["optimizer"] / 0.5)
    # micro-batches of 1: the same FLOPs at the lower efficiency of size 1
    small = predict(config("actor.layout.dp=2", "rollout.tp=1", "actor.engine.micro_batch_size=1"),
                    {"model": SHAPE}, calib)
    assert small.terms["update_actor"]["compute"] == pytest.approx(
        floors.terms["update_actor"]["compute"] / 0.1)
    assert p.phases["generate"] == pytest.approx(floors.phases["generate"] / 0.2)
    assert p.phases["weight_load"] == pytest.approx(floors.phases["weight_load"] / 2.0)
    # The file keeps it; another model's shape (or dtype) gets the floors.
    calib.to_json(tmp_path / "c.json")
    again = Calibration.from_json(tmp_path / "c.json")
    assert again.passes == [profile]
    other = dataclasses.replace(SHAPE, num_layers=4)
    assert again.profile(other, "fp32") is None and again.profile(SHAPE, "bf16") is None
    assert not predict(cfg, {"model": other}, again).profiled


def test_a_profile_at_the_layouts_tp_replaces_its_tp_communication(tmp_path):
    import json

    from hybridflow.planner.profile import efficiencies
    cfg = config("actor.layout.tp=2", "rollout.tp=1", "actor.layout.dp=1")
    at_1 = efficiencies(cfg, SHAPE, CALIB, hand_profile(cfg, SHAPE, EFFICIENCY))
    at_2 = efficiencies(cfg, SHAPE, CALIB, hand_profile(cfg, SHAPE, EFFICIENCY, tp=2), tp=2)
    assert at_2.tp == 2 and at_2.train == pytest.approx(at_1.train)
    floors = predict(cfg, {"model": SHAPE}, CALIB)
    one = predict(cfg, {"model": SHAPE}, dataclasses.replace(CALIB, passes=[at_1]))
    both = dataclasses.replace(CALIB, passes=[at_2, at_1])
    two = predict(cfg, {"model": SHAPE}, both)
    u0, u1, u2 = (x.terms["update_actor"] for x in (floors, one, two))
    assert u0["tp_comm"] > 0 and u1["tp_comm"] == u0["tp_comm"] and u2["tp_comm"] == 0
    # a pass's fixed seconds count from a profile of either tp (tp=1's as a lower bound), none
    # without a profile
    assert at_1.train_fixed_s == at_2.train_fixed_s == pytest.approx(FIXED["train"])
    assert u0["fixed"] == 0
    assert u1["fixed"] == at_1.train_fixed_s and u2["fixed"] == at_2.train_fixed_s
    assert one.terms["ref_logprobs"]["fixed"] == at_1.forward_fixed_s
    assert two.terms["ref_logprobs"]["fixed"] == at_2.forward_fixed_s
    # tp=1's profile is read at b/tp = 1 sequence a rank (4 samples, micro-batches of 2), tp=2's
    # at the rank's micro-batch of 2 itself
    assert u1["compute"] == pytest.approx(u0["compute"] / 0.1)
    assert u2["compute"] == pytest.approx(u0["compute"] / 0.25)
    # the profile of the layout's tp is preferred, the tp=1 one serves the others; a file
    # written before profiles had a tp reads as tp=1
    assert both.profile(SHAPE, "fp32", 2) is at_2 and both.profile(SHAPE, "fp32", 4) is at_1
    assert CALIB.profile(SHAPE, "fp32", 2) is None
    dataclasses.replace(CALIB, passes=[at_1]).to_json(tmp_path / "c.json")
    data = json.loads((tmp_path / "c.json").read_text())
    del data["passes"][0]["tp"]
    (tmp_path / "c.json").write_text(json.dumps(data))
    assert Calibration.from_json(tmp_path / "c.json").passes == [at_1]


# A profile written by hand: the efficiencies of EFFICIENCY, the fixed seconds of FIXED.
HAND = dict(shape=dataclasses.asdict(SHAPE), dtype="fp32", seq=12, micro_batches=[1, 2, 4],
            backend="megatron", forward=[0.2, 0.4, 0.5], train=[0.1, 0.25, 0.3], optimizer=0.5,
            generate=0.2, weight_load=2.0)
# The same profile with fixed seconds a pass: 3 ms a forward-only pass, 11 ms a training step.
FIXED_CALIB = dataclasses.replace(CALIB, passes=[PassProfile(**HAND, forward_fixed_s=0.003,
                                                             train_fixed_s=0.011)])


def test_fixed_seconds_of_a_pass_by_hand():
    p = predict(config(), {"model": SHAPE}, FIXED_CALIB)
    fwd, adam, load, zero = FWD, ADAM, WEIGHTS, WEIGHTS
    gen = 2 * N * 4 * 8 / 1e9 + 3 * 2 * N * 4 / 1e9  # test_cost_model_by_hand's generation
    # micro-batches of 2: the forward's efficiency 0.4, the training's 0.25; each pass once its
    # fixed seconds: the reference pass, and the one optimizer step of the update
    assert p.phases == pytest.approx({"reshard": 0.0, "weight_load": load / 2.0,
                                      "generate": gen / 0.2, "back_to_train": zero,
                                      "ref_logprobs": fwd / 0.4 + 0.003,
                                      "update_actor": 3 * fwd / 0.25 + adam / 0.5 + 0.011},
                                     rel=1e-12)


@pytest.mark.parametrize("epochs, mini_batches", [(1, 2), (2, 2)])
def test_fixed_seconds_count_once_per_pass(epochs, mini_batches):
    one = predict(config(), {"model": SHAPE}, FIXED_CALIB)
    more = predict(config(f"actor.ppo_epochs={epochs}", f"actor.mini_batches={mini_batches}"),
                   {"model": SHAPE}, FIXED_CALIB)
    steps = epochs * mini_batches
    assert one.terms["update_actor"]["fixed"] == 0.011
    assert more.terms["update_actor"]["fixed"] == pytest.approx(steps * 0.011)
    # the same micro-batches of 2 over the samples, so the compute moves with the epochs only;
    # every optimizer step adds Adam's step and the training pass's fixed seconds
    u1, u = one.phases["update_actor"], more.phases["update_actor"]
    adam = one.terms["update_actor"]["optimizer"]
    assert u == pytest.approx(epochs * (u1 - adam - 0.011) + steps * (adam + 0.011))
    # several updates: the old log-probs are a pass of their own, with its fixed seconds
    assert more.phases["old_logprobs"] == more.phases["ref_logprobs"] == pytest.approx(
        one.phases["ref_logprobs"])
    assert more.terms["old_logprobs"]["fixed"] == 0.003


def test_a_profile_without_fixed_seconds_loads_and_predicts_as_before(tmp_path):
    import json
    old = PassProfile(**HAND)  # a profile of a file written before the fixed seconds
    path = tmp_path / "c.json"
    dataclasses.replace(CALIB, passes=[old]).to_json(path)
    data = json.loads(path.read_text())
    for key in ("forward_fixed_s", "train_fixed_s"):
        del data["passes"][0][key]
    path.write_text(json.dumps(data))
    calib = Calibration.from_json(path)
    assert calib.passes == [old] and old.forward_fixed_s == old.train_fixed_s == 0
    p = predict(config(), {"model": SHAPE}, calib)
    # its optimizer efficiency holds the training step's fixed part, as it always did
    assert p.phases["ref_logprobs"] == pytest.approx(FWD / 0.4, rel=1e-12)
    assert p.phases["update_actor"] == pytest.approx(3 * FWD / 0.25 + ADAM / 0.5, rel=1e-12)
    with_fixed = predict(config(), {"model": SHAPE}, FIXED_CALIB)
    assert with_fixed.step == pytest.approx(p.step + 0.003 + 0.011, rel=1e-12)


def test_calibration_without_passes_loads_and_a_bad_profile_is_named(tmp_path):
    import json
    path = tmp_path / "c.json"
    CALIB.to_json(path)
    data = json.loads(path.read_text())
    del data["passes"]  # files written before profiles existed
    path.write_text(json.dumps(data))
    assert Calibration.from_json(path).passes == []
    data["passes"] = [{"forward": 0.5}]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        Calibration.from_json(path)
    assert e.value.field == "cluster.calibration" and "passes" in e.value.message


def test_layout_auto_takes_the_fastest_mapping(tmp_path):
    from hybridflow.planner.search import resolve_auto
    calib = tmp_path / "c.json"
    AUTO_CALIB.to_json(calib)
    base = ("actor.layout.dp=2", "actor.layout.pp=2", "train_batch_size=4",
            f"cluster.calibration={calib}")
    cfg = config(*base, "layout=auto")
    chosen, mapping = resolve_auto(cfg, {"model": SHAPE})
    fits, _ = search(cfg, {"model": SHAPE}, AUTO_CALIB)
    assert mapping.overrides == fits[0].overrides
    assert chosen.layout == "manual" and chosen.auto == []
    assert chosen.actor.layout.world_size == 4  # the configured world, re-mapped
    assert (chosen.actor.layout.pp, chosen.actor.layout.dp) == (
        fits[0].overrides["actor.layout.pp"], fits[0].overrides["actor.layout.dp"])
    # One key left to the planner: the others stay as configured.
    one = config(*base, "actor.engine.micro_batch_size=auto")
    assert one.auto == ["actor.engine.micro_batch_size"]
    chosen, mapping = resolve_auto(one, {"model": SHAPE})
    assert (chosen.actor.layout.pp, chosen.actor.layout.dp) == (2, 2)
    best_pp2 = min((m for m in fits if m.overrides["actor.layout.pp"] == 2
                    and m.overrides["actor.layout.dp"] == 2), key=lambda m: m.prediction.step)
    assert mapping.overrides == best_pp2.overrides
    # A manual layout is left alone.
    assert resolve_auto(config(*base), {"model": SHAPE}) == (config(*base), None)
    # With LoRA: the fastest mapping by the LoRA cost model.
    lora = config(*base, "layout=auto", "actor.lora.rank=4")
    chosen, mapping = resolve_auto(lora, {"model": SHAPE})
    fits, _ = search(lora, {"model": SHAPE}, AUTO_CALIB)
    assert mapping.overrides == fits[0].overrides and chosen.actor.lora.rank == 4
    assert mapping.prediction.step == pytest.approx(
        predict(chosen, {"model": SHAPE}, AUTO_CALIB).step, rel=1e-12)
    assert mapping.prediction.terms["reshard"]["merge"] > 0


def test_auto_in_a_file_and_its_refusals(tmp_path):
    calib = tmp_path / "c.json"
    AUTO_CALIB.to_json(calib)
    f = tmp_path / "run.yaml"
    f.write_text(f"rollout: {{tp: auto}}\nactor: {{engine: {{micro_batch_size: auto}}}}\n"
                 f"cluster: {{calibration: {calib}}}\n")
    cfg = load_config(RLConfig, f, ["algorithm.name=grpo"])
    assert sorted(cfg.auto) == ["actor.engine.micro_batch_size", "rollout.tp"]
    # An override with a value takes the key back from the planner.
    cfg = load_config(RLConfig, f, ["algorithm.name=grpo", "rollout.tp=1"])
    assert cfg.auto == ["actor.engine.micro_batch_size"]
    with pytest.raises(ConfigError) as e:  # no rates, no plan
        config("layout=auto")
    assert e.value.field == "cluster.calibration" and "layout: auto" in e.value.message
    with pytest.raises(ConfigError) as e:  # a world-size key needs the devices
        config("actor.layout.tp=auto", f"cluster.calibration={calib}")
    assert e.value.field == "actor.layout.tp" and "cluster.nodes" in e.value.message
    with pytest.raises(ConfigError) as e:
        config("layout=everything")
    assert e.value.field == "layout"
    assert main(["check", "model=tiny-llama", "layout=auto", "actor.layout.dp=2",
                 "rollout.backend=megatron", f"cluster.calibration={calib}",
                 f"tracking.out_dir={tmp_path}"]) == 0


# Micro-batch costs by hand: a forward micro-batch's host work 1 ms + 0.5 ms a layer, a
# training one's 3 ms + 2 ms a layer; a stage boundary 4 ms forward, 10 ms training; 1e8 B/s
# between stages.
COSTS = MicroBatchCosts(forward_base_s=0.001, forward_layer_s=0.0005, train_base_s=0.003,
                        train_layer_s=0.002, forward_stage_s=0.004, train_stage_s=0.01, p2p=1e8)
COSTS_CALIB = dataclasses.replace(CALIB, micro_batches=COSTS)


def test_host_work_a_micro_batch_makes_micro_batch_1_cost_more_at_equal_tokens():
    steps = {mb: predict(config(f"actor.engine.micro_batch_size={mb}"), {"model": SHAPE},
                         COSTS_CALIB) for mb in (1, 2, 4)}
    # the 4 samples in 4, 2 or 1 micro-batches of SHAPE's 2 layers: host work 2 ms a forward
    # micro-batch, 7 ms a training one; each micro-batch streams the N = 5712 fp32 weights at
    # 1e9 B/s, twice in training, and reads and writes their fp32 grads; the FLOPs the same
    fwd, train = 0.002 + 4 * N / 1e9, 0.007 + (2 * 4 + 8) * N / 1e9
    for mb, p in steps.items():
        assert p.terms["ref_logprobs"]["host"] == pytest.approx(4 // mb * 0.002)
        assert p.terms["update_actor"]["host"] == pytest.approx(4 // mb * 0.007)
        assert p.terms["ref_logprobs"]["weights"] == pytest.approx(4 // mb * 4 * N / 1e9)
        assert p.terms["update_actor"]["weights"] == pytest.approx(4 // mb * 16 * N / 1e9)
        assert p.terms["update_actor"]["compute"] == pytest.approx(3 * FWD)
    assert steps[1].step - steps[2].step == pytest.approx(2 * fwd + 2 * train)
    assert steps[1].step > steps[2].step > steps[4].step
    # LoRA: the frozen base's weights read twice, the fp32 grads the adapters' alone
    lora = predict(config("actor.lora.rank=4"), {"model": SHAPE}, COSTS_CALIB)
    assert lora.terms["update_actor"]["weights"] == pytest.approx(
        2 * (2 * 4 * N + 8 * ADAPTERS) / 1e9)
    # floors alone tie them: what made micro-batch 1 come first
    floors = [predict(config(f"actor.engine.micro_batch_size={mb}"), {"model": SHAPE},
                      CALIB).step for mb in (1, 2, 4)]
    assert floors[0] == floors[1] == floors[2]
    # a pass profile holds the host's work and the weights' traffic in its efficiencies
    profiled = dataclasses.replace(FIXED_CALIB, micro_batches=COSTS)
    update = predict(config(), {"model": SHAPE}, profiled).terms["update_actor"]
    assert update["host"] == update["weights"] == 0


def test_a_pipeline_stage_costs_its_transfers_and_its_bubble():
    # gloo-like: slow all-gathers make DP=2's gradient all-reduce dear, so floors put PP=2 first
    slow = dataclasses.replace(CALIB, all_gather={2: 2e7})
    pp, dp = (predict(config(f"actor.layout.{k}=2"), {"model": SHAPE}, slow) for k in ("pp", "dp"))
    assert pp.step < dp.step
    priced = dataclasses.replace(slow, micro_batches=COSTS)
    pp, dp = (predict(config(f"actor.layout.{k}=2"), {"model": SHAPE}, priced)
              for k in ("pp", "dp"))
    # PP=2: 2 micro-batches of 2 sequences, each 2 x 12 x 16 fp32 activations (1536 bytes) over
    # the stage boundary: 4 ms + 1536 B at 1e8 B/s forward; training 10 ms + both directions.
    # The busiest stage holds 1 layer: host 1.5 ms forward, 5 ms training a micro-batch.
    ref, upd = pp.terms["ref_logprobs"], pp.terms["update_actor"]
    assert ref["pipeline"] == pytest.approx(2 * (0.004 + 1536 / 1e8))
    assert upd["pipeline"] == pytest.approx(2 * (0.01 + 2 * 1536 / 1e8))
    assert ref["host"] == pytest.approx(2 * 0.0015) and upd["host"] == pytest.approx(2 * 0.005)
    # its 3376 weights streamed a micro-batch (fp32 at 1e9 B/s): once forward, in training
    # twice and the grads read and written
    assert ref["weights"] == pytest.approx(2 * 4 * 3376 / 1e9)
    assert upd["weights"] == pytest.approx(2 * 16 * 3376 / 1e9)
    # 1F1B: (p - 1) / m of the busiest stage's whole micro-batch work idles
    for t in (ref, upd):
        assert t["bubble"] == pytest.approx(
            (t["compute"] + t["host"] + t["weights"] + t["pipeline"]) / 2)
    assert dp.terms["update_actor"]["pipeline"] == 0 and dp.terms["update_actor"]["bubble"] == 0
    assert pp.step > dp.step
    # calibrated on one device: no pipeline costs, and a plan at pp > 1 says what to do
    one = dataclasses.replace(priced, micro_batches=dataclasses.replace(
        COSTS, forward_stage_s=None, train_stage_s=None, p2p=None))
    assert predict(config("actor.layout.dp=2"), {"model": SHAPE}, one).step == pytest.approx(
        dp.step)
    with pytest.raises(ConfigError) as e:
        predict(config("actor.layout.pp=2"), {"model": SHAPE}, one)
    assert e.value.field == "cluster.calibration" and "two devices" in e.value.message


def test_recompute_prices_the_layers_forward_once_more():
    # SHAPE's 2 layers hold 4672 of the N = 5712 matmul parameters (the final norm's 16 and the
    # output layer's 1024 are not recomputed): their forward, matmuls and attention, once more
    off, on = (predict(config(*args), {"model": SHAPE}, CALIB).terms["update_actor"]
               for args in ([], ["actor.engine.recompute=true"]))
    layers = (2 * 4672 * 12 + ATT) * 4 / 1e9
    assert off["compute"] == pytest.approx(3 * FWD)
    assert on["compute"] == pytest.approx(3 * FWD + layers)
    # the rest of the update (Adam) unchanged; the forward-only passes unchanged
    assert on["optimizer"] == off["optimizer"]
    ref = predict(config("actor.engine.recompute=true"), {"model": SHAPE}, CALIB)
    assert ref.phases["ref_logprobs"] == pytest.approx(FWD)
    # LoRA: the frozen base's layers and the adapters' forward once more
    lora = predict(config("actor.lora.rank=4", "actor.engine.recompute=true"), {"model": SHAPE},
                   CALIB).terms["update_actor"]
    assert lora["compute"] == pytest.approx(
        (2 * MATMUL + 3 * ATT + 6 * ADAPTERS * 12) * 4 / 1e9
        + (2 * 4672 * 12 + ATT + 2 * ADAPTERS * 12) * 4 / 1e9)
    # per micro-batch (2 of them): the layers' weights read once more, a forward's host work of
    # the 2 layers (0.5 ms each); the TP all-reduces a third time at tp=2
    off, on = (predict(config(*args), {"model": SHAPE}, COSTS_CALIB).terms["update_actor"]
               for args in ([], ["actor.engine.recompute=true"]))
    assert on["weights"] - off["weights"] == pytest.approx(2 * 4 * 4672 / 1e9)
    assert on["host"] - off["host"] == pytest.approx(2 * 2 * 0.0005)
    off, on = (predict(config("actor.layout.tp=2", *args), {"model": SHAPE}, CALIB)
               .terms["update_actor"] for args in ([], ["actor.engine.recompute=true"]))
    assert off["tp_comm"] > 0 and on["tp_comm"] == pytest.approx(1.5 * off["tp_comm"])
    # at 7B the layers are nearly every FLOP: the update's compute is nearly 4/3 of before
    from hybridflow.models.presets import SHAPES
    seven = {"model": SHAPES["llama2-7b"]}
    off, on = (predict(config("data.max_prompt_tokens=512", "rollout.sampling.max_tokens=512",
                              *args), seven, CALIB).terms["update_actor"]["compute"]
               for args in ([], ["actor.engine.recompute=true"]))
    assert 1.32 < on / off < 4 / 3


@pytest.mark.parametrize("auto", ["layout=auto", "actor.engine.micro_batch_size=auto"])
def test_auto_refuses_a_calibration_without_micro_batch_costs(tmp_path, capsys, auto):
    from hybridflow.planner.search import resolve_auto
    calib = tmp_path / "c.json"
    CALIB.to_json(calib)  # as a file written before the costs were measured: none in it
    assert Calibration.from_json(calib).micro_batches is None
    cfg = config("actor.layout.dp=2", f"cluster.calibration={calib}", auto)
    with pytest.raises(ConfigError) as e:
        resolve_auto(cfg, {"model": SHAPE})
    assert e.value.field == "cluster.calibration"
    assert "floors alone" in e.value.message
    assert f"rerun `hybridflow calibrate --out {calib}`" in e.value.message
    # hybridflow check: one line, exit 2; hybridflow plan still ranks, and says on what
    run = ["model=tiny-llama", "actor.layout.dp=2", "rollout.backend=megatron",
           f"cluster.calibration={calib}", f"tracking.out_dir={tmp_path}"]
    assert main(["check", *run, auto]) == 2
    assert "has no micro-batch costs" in capsys.readouterr().err
    assert main(["plan", *run]) == 0
    out = capsys.readouterr().out
    assert "1. actor tp=" in out and "FLOORS ALONE" in out and "`auto` refuses" in out
    # with the costs, the same file plans
    AUTO_CALIB.to_json(calib)
    assert main(["check", *run, auto]) == 0


def test_auto_placement_refuses_a_calibration_without_micro_batch_costs(tmp_path):
    from hybridflow.planner.placements import choose_placement
    cfg = config("cluster.nodes=1", "cluster.gpus_per_node=4", "ray.gpus_per_worker=1",
                 "placement=auto", f"cluster.calibration={tmp_path / 'c.json'}")
    with pytest.raises(ConfigError) as e:
        choose_placement(cfg, {"model": SHAPE}, CALIB)
    assert e.value.field == "cluster.calibration" and "floors alone" in e.value.message

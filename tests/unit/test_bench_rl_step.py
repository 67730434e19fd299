"""bench_rl_step's memory pairs: the GPU's measured peak per phase of the memory estimate, beside
the estimate (the measured side comes from the workers' ``memory/`` meta, faked here: there is no
GPU allocator on the CPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_rl_step  # noqa: E402
from hybridflow.errors import ConfigError  # noqa: E402
from hybridflow.planner.memory import GIB, estimate_memory  # noqa: E402
from hybridflow.workers.group import max_memory_meta, memory_meta  # noqa: E402
from hybridflow.models.tiny import tiny_llama_config  # noqa: E402


def _ppo_config(tmp_path, placement="colocate"):
    extra = ["--placement", placement]
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu", "--algorithm", "ppo",
                                     "--micro-batch", "2", *extra])
    return bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")


def _row(**gib):
    """One iteration's metrics: call -> (peak, resident) GiB."""
    row = {}
    for call, (peak, resident) in gib.items():
        row.update(memory_meta(call, int(peak * GIB), int(resident * GIB)))
    return row


def test_memory_pairs_add_the_colocated_workers_resident_bytes(tmp_path):
    cfg = _ppo_config(tmp_path)
    rows = [_row(generation=(3.0, 1.0), compute_ref_log_prob=(2.0, 1.5), compute_values=(0.8, 0.5),
                 update_critic=(1.2, 0.6), update_actor=(4.0, 1.5)),
            _row(generation=(3.5, 1.0), compute_ref_log_prob=(2.0, 1.5), compute_values=(0.8, 0.5),
                 update_critic=(1.2, 0.7), update_actor=(4.0, 1.5))]
    result = {}
    bench_rl_step.memory_pairs(result, rows, cfg, tiny_llama_config())
    (pool,) = estimate_memory(cfg, {"model": tiny_llama_config()}).pools
    m = result["memory_gib"]
    assert set(m) == {"generation", "inference", "actor update", "critic update"}
    # the fullest iteration's actor peak plus what the critic's process keeps between calls
    assert m["generation"]["measured"] == pytest.approx(3.5 + 0.7, abs=1e-3)
    assert m["generation"]["workers"] == {"actor": {"measured": 3.5, "predicted": pytest.approx(
        sum(pool.role_bytes("generation", r) for r in ("actor", "rollout", "ref")) / GIB,
        abs=1e-3)}, "critic": {"measured": 0.7, "predicted": pytest.approx(
            pool.role_bytes("generation", "critic") / GIB, abs=1e-3)}}
    # inference: the fullest pass is the actor's reference pass, plus the critic's resident
    assert m["inference"]["call"] == "compute_ref_log_prob"
    assert m["inference"]["measured"] == pytest.approx(2.0 + 0.7, abs=1e-3)
    # the critic's update: its peak plus the actor's process after its last pass
    assert m["critic update"]["measured"] == pytest.approx(1.2 + 1.5, abs=1e-3)
    for phase, pair in m.items():
        assert pair["predicted"] == pytest.approx(pool.total(phase) / GIB, abs=1e-3)
        assert pair["error"] == pytest.approx(pair["predicted"] / pair["measured"] - 1, abs=1e-3)
    assert result["peak_memory_gib"]["phase"] == "actor update"
    assert result["peak_memory_gib"]["measured"] == pytest.approx(4.0 + 0.7, abs=1e-3)


def test_memory_pairs_without_colocation_count_one_process(tmp_path):
    cfg = _ppo_config(tmp_path, placement="split")
    rows = [_row(generation=(3.0, 1.0), compute_ref_log_prob=(2.0, 1.5), compute_values=(0.8, 0.5),
                 update_critic=(1.2, 0.6), update_actor=(4.0, 1.5))]
    result = {}
    bench_rl_step.memory_pairs(result, rows, cfg, tiny_llama_config())
    m = result["memory_gib"]
    assert set(m) == {"actor: generation", "actor: inference", "actor: actor update",
                      "critic: inference", "critic: critic update"}
    assert m["actor: generation"]["measured"] == pytest.approx(3.0, abs=1e-3)
    assert m["critic: critic update"]["measured"] == pytest.approx(1.2, abs=1e-3)
    assert m["critic: inference"]["call"] == "compute_values"
    assert m["critic: inference"]["workers"] == {"critic": {"measured": 0.8, "predicted":
                                                            m["critic: inference"]["predicted"]}}


def test_memory_pairs_need_the_workers_figures(tmp_path):
    result = {}  # on the CPU the workers report none
    bench_rl_step.memory_pairs(result, [{"step_s": 1.0}], _ppo_config(tmp_path),
                               tiny_llama_config())
    assert "memory_gib" not in result


def test_max_memory_meta_takes_the_fullest_rank_and_leaves_the_rest():
    metas = [{"memory/generate_peak_gib": 2.0, "timing/generate_s": 1.0},
             {"memory/generate_peak_gib": 3.0, "memory/generate_resident_gib": 1.0},
             {}]
    assert max_memory_meta(metas) == {"memory/generate_peak_gib": 3.0,
                                      "memory/generate_resident_gib": 1.0}


def test_sampling_rounds_sum_their_timings_and_keep_the_largest_memory():
    """Dynamic sampling's rounds (driver.step.take_groups): seconds add up, a peak does not."""
    from hybridflow.batch import Batch
    from hybridflow.driver.step import take_groups
    rounds = [Batch({"x": torch.zeros(2)}, {"group": [0, 1]},
                    {"timing/generate_s": 1.0, "memory/generation_peak_gib": 5.0}),
              Batch({"x": torch.ones(2)}, {"group": [0, 1]},
                    {"timing/generate_s": 2.0, "memory/generation_peak_gib": 4.0})]
    batch = take_groups(rounds, [(0, 1), (1, 0)])
    assert batch["x"].tolist() == [0.0, 1.0] and batch["group"] == [0, 1]
    assert batch.meta == {"timing/generate_s": 3.0, "memory/generation_peak_gib": 5.0}


def test_bench_layout_backend_and_budget_options_reach_the_run_config(tmp_path):
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu", "--algorithm", "ppo",
                                     "--tp", "1", "--pp", "2", "--dp", "2", "--backend", "vllm",
                                     "--max-tokens-per-micro-batch", "64"])
    cfg = bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")
    for part in (cfg.actor, cfg.critic):
        assert (part.layout.tp, part.layout.pp, part.layout.dp) == (1, 2, 2)
        # the budget forms every micro-batch: the sizes are left unset, not passed and refused
        assert part.engine.max_tokens_per_micro_batch == 64
        assert part.engine.forward_micro_batch_size is None
    assert cfg.rollout.backend == "vllm"
    assert args.micro_batch is None and args.forward_micro_batch is None


def test_a_token_budget_run_is_predicted(tmp_path):
    # The cost model counts a budget's micro-batches (cost.micro_batch_rows): --calibration
    # with --max-tokens-per-micro-batch is a run to predict, no longer refused.
    import copy

    from hybridflow.planner.rates import Calibration
    from hybridflow.planner.cost import predict
    from hybridflow.models.config import ModelConfig
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu", "--calibration",
                                     str(tmp_path / "c.json"), "--max-tokens-per-micro-batch",
                                     "128"])
    cfg = bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")
    assert cfg.actor.engine.max_tokens_per_micro_batch == 128
    seq = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_tokens
    assert 1 < 128 // seq < cfg.train_batch_size * cfg.rollout.sampling.n
    shape = ModelConfig(vocab_size=64, hidden_size=16, ffn_hidden_size=32, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=8)
    calib = Calibration(device="test", devices=2, matmul_flops={"fp32": 1e9},
                        memory_bandwidth=1e9, all_gather={2: 1e8}, broadcast={2: 1e8},
                        host_to_device=None, torch="test", measured_at="2026-12-01T00:00:00")
    # the same prediction as micro-batches of the budget's 128 // seq full-length sequences
    sized = copy.deepcopy(cfg)
    sized.actor.engine.max_tokens_per_micro_batch = None
    sized.actor.engine.micro_batch_size = 128 // seq
    assert predict(cfg, {"model": shape}, calib).terms == predict(sized, {"model": shape},
                                                                  calib).terms


def test_bench_lora_and_memory_cap_options_reach_the_run_config(tmp_path):
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu", "--lora-rank", "8",
                                     "--lora-merge", "in_place", "--gpus-per-worker", "1",
                                     "--gpu-memory-gib", "24"])
    cfg = bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")
    assert cfg.actor.lora.rank == 8 and cfg.hybrid_engine.lora_merge == "in_place"
    assert cfg.ray.gpu_memory_gib == 24
    # without --lora-merge the config's default (copy) stands
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu", "--lora-rank", "8"])
    cfg = bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")
    assert cfg.hybrid_engine.lora_merge == "copy" and cfg.ray.gpu_memory_gib is None
    assert not cfg.rollout.keep_cache


def test_bench_recompute_reaches_the_trained_roles_engines(tmp_path):
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu", "--algorithm", "ppo",
                                     "--recompute"])
    cfg = bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")
    assert cfg.actor.engine.recompute and cfg.critic.engine.recompute
    # GRPO trains no critic: its engine is left as it was (set there, it would be refused)
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu", "--recompute"])
    cfg = bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")
    assert cfg.actor.engine.recompute and not cfg.critic.engine.recompute
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu"])
    cfg = bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")
    assert not cfg.actor.engine.recompute


def test_bench_host_optimizer_reaches_the_actor_and_is_refused_beside_tp(tmp_path):
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu", "--tp", "1",
                                     "--host-optimizer"])
    cfg = bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")
    assert cfg.actor.engine.optim.offload and not cfg.critic.engine.optim.offload
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu", "--tp", "1"])
    cfg = bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")
    assert not cfg.actor.engine.optim.offload
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu", "--host-optimizer"])
    with pytest.raises(ConfigError, match="actor.engine.optim.offload.*tp, pp and dp to 1"):
        bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")


def test_bench_keep_cache_reaches_the_run_config(tmp_path):
    args = bench_rl_step.parse_args(["--model", "tiny", "--device", "cpu", "--backend",
                                     "megatron", "--gpus-per-worker", "1", "--keep-cache"])
    cfg = bench_rl_step.run_config(args, tmp_path / "model", tmp_path / "prompts.jsonl")
    assert cfg.rollout.keep_cache and cfg.rollout.backend == "megatron"


def test_a_refused_setting_ends_the_bench_in_one_line_with_exit_2():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_rl_step.py"), "--model",
                          "tiny", "--device", "cpu", "--gpu-memory-gib", "1"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "bench_rl_step: error: ray.gpu_memory_gib: has no effect in this run; remove it or set "
        "ray.gpus_per_worker > 0 (it caps each worker's GPU)"]

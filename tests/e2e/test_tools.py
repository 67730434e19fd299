"""The benchmark tools run on the CPU and keep their JSON contract (speed is never asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 600) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_bench_rollout_profiles_a_call_after_sleep():
    r = _run("tools/bench_rollout.py", "--model", "tiny", "--batch", "4", "--prompt-len", "8",
             "--new-tokens", "8", "--fast-decode", "on", "--repeats", "1", "--profile", "3")
    assert r["fast_decode"] and r["after_sleep_seconds"] > 0
    prof = r["after_sleep_profile"]
    assert prof["wall_s"] == r["after_sleep_seconds"] and prof["busy_s"] > 0
    assert len(prof["top"]) == 3 and "aten::mm" in [op["name"] for op in prof["top"]]
    assert "after_sleep_roofline_fraction" not in r  # no roofline on CPU


def test_bench_engine_times_each_micro_batch_and_counts_lora_memory():
    from hybridflow.models.params import llama_param_metas
    from hybridflow.models.tiny import tiny_llama_config
    from hybridflow.training.lora import LoraConfig, lora_metas
    r = _run("tools/bench_engine.py", "--model", "tiny", "--batch", "8", "--seq", "16",
             "--micro-batch", "2", "8", "--repeats", "1", "--lora-rank", "0", "4",
             "--profile", "3")
    assert r["matmul_tflops"] > 0
    full, lora = r["engines"]
    for run in (full, lora):
        assert [s["micro_batch"] for s in run["sizes"]] == [2, 8] and run["optimizer_s"] > 0
        for s in run["sizes"]:
            assert s["forward_s"] > 0 and s["train_s"] > 0 and 0 < s["train_mfu"] < 1
            # the profiled step: its three costliest operations, the matmuls among them
            prof = s["profile"]
            assert len(prof["top"]) == 3 and prof["busy_s"] > 0 and prof["idle"] is None
            assert "aten::mm" in [op["name"] for op in prof["top"]]
            assert all(op["calls"] > 0 and op["s"] > 0 for op in prof["top"])
    cfg = tiny_llama_config()  # fp32 on CPU: grads fp32, Adam's two fp32 moments
    params = sum(m.numel for m in llama_param_metas(cfg)) + (
        cfg.vocab_size * cfg.hidden_size if cfg.tie_embeddings else 0)  # the last stage's copy
    adapters = sum(m.numel for m in lora_metas(cfg, LoraConfig(rank=4)))
    assert full["memory"] == {"weights": 4 * params, "trainable": params, "grads": 4 * params,
                              "optimizer": 8 * params}
    assert lora["memory"] == {"weights": 4 * (params + adapters), "trainable": adapters,
                              "grads": 4 * adapters, "optimizer": 8 * adapters}


def test_bench_mb_cost_times_the_workers_passes_and_profiles_the_extra():
    r = _run("tools/bench_mb_cost.py", "--model", "tiny", "--batch", "4", "--prompt", "8",
             "--response", "4", "--micro-batch", "1", "4", "--repeats", "1", "--kl-coef", "0.04",
             "--profile", "3")
    passes = ["bare_s", "loss_only_s", "actor_loss_s", "update_s", "ref_s", "loss_fn_s"]
    assert [s["micro_batch"] for s in r["sizes"]] == [1, 4] and r["kl_coef"] == 0.04
    assert all(s[k] > 0 for s in r["sizes"] for k in passes)
    assert list(r["per_micro_batch_s"]) == passes  # over 4 - 1 = 3 more micro-batches
    for growth in (r["profile_micro_batches"], r["profile_loss"]):  # the 3 that grew most
        assert len(growth) == 3 and all(set(op) == {"name", "extra_s", "extra_calls"}
                                        for op in growth)


def test_bench_rl_step_ppo_reports_every_phase(tmp_path):
    from tests.unit.test_planner import CALIB
    CALIB.to_json(tmp_path / "calibration.json")
    r = _run("tools/bench_rl_step.py", "--model", "tiny", "--device", "cpu", "--algorithm",
             "ppo", "--warmup", "0", "--iters", "1", "--batch", "2", "--n", "2",
             "--max-tokens", "4", "--micro-batch", "2", "--forward-micro-batch", "4",
             "--workdir", str(tmp_path), "--calibration", str(tmp_path / "calibration.json"),
             "--profile-passes", "--profile", "3")
    # the model's passes profiled first and kept in the calibration file
    from hybridflow.planner.rates import Calibration
    (profile,) = Calibration.from_json(tmp_path / "calibration.json").passes
    assert r["profile"]["forward"] == profile.forward and profile.backend == "megatron"
    # the cost model's seconds for the measured phases, and their sum; one on-policy update
    # computes the old log-probs in its own forward, so they are no phase
    assert set(r["predicted_s"]) == {"reshard", "weight_load", "generate", "back_to_train",
                                     "ref_logprobs", "values", "update_critic", "update_actor",
                                     "step"}
    assert "old_logprobs" not in r["phases_s"]
    assert r["predicted_s"]["step"] == pytest.approx(sum(
        v for k, v in r["predicted_s"].items() if k != "step"), abs=1e-3)
    for phase in ("reshard", "generate", "rollout_sleep", "ref_logprobs", "values",
                  "update_critic", "update_actor", "step"):
        assert r["phases_s"][phase] >= 0, phase
    assert r["forward_micro_batch_size"] == 4 and r["placement"] == "colocate"
    # the CPU rate sampled at the start and after the timed iteration; the floors use the mean
    samples = r["matmul_tflops_samples"]
    assert len(samples) == 2 and r["matmul_tflops"] == pytest.approx(sum(samples) / 2, abs=1e-4)
    # each phase's floor at this run's rates (the switch's from the calibration file), the
    # step's ratio to their sum
    assert set(r["floor_s"]) == {"generate", "reshard", "ref_logprobs", "values",
                                 "update_critic", "update_actor", "step"}
    assert r["floor_s"]["step"] == pytest.approx(sum(
        v for k, v in r["floor_s"].items() if k != "step"), abs=1e-4)
    assert r["floor_s"]["reshard"] > 0  # tp 2 -> generation tp 1: the switch gathers
    assert r["floor_ratio"] == pytest.approx(r["phases_s"]["step"] / r["floor_s"]["step"],
                                             rel=1e-2)
    assert r["floor_ratio"] > r["floor_ratio_phases"] > 1
    assert 0 < r["mfu_update_critic"] < 1 and 0 < r["mfu_training"] < 1
    assert r["response_tokens"] > 0
    # --profile: one more iteration, rank 0's actor calls under torch.profiler; on-policy, the
    # step makes no compute_log_prob call, so it has no profile
    assert set(r["call_profiles"]) == {"generate", "update_actor", "compute_ref_log_prob"}
    assert r["call_profiles"]["generate"]["busy_s"] > 0
    update = r["call_profiles"]["update_actor"]
    assert 0 < update["busy_s"] and 1 <= len(update["top"]) <= 3
    assert any("mm" in op["name"] or "Linear" in op["name"] for op in update["top"])

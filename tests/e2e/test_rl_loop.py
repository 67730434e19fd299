"""The RL loop end to end on Ray with tiny models: PPO (critic + GAE), Safe-RLHF (critic and cost
critic, Lagrange multiplier) and GRPO, the switch between every generation and update, the Python
API in both hybrid-engine modes, and the step-wise API."""

import math

import pytest
import torch

from hybridflow.config import RLConfig, load_config
from hybridflow.tracking import CLOCK_KEYS
from hybridflow.trainer import RLTrainer

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("cache")]

PROMPTS = [{"prompt": p} for p in ("hello there", "what is 2+2", "name a color", "count to 3",
                                   "say yes", "a b c")]


def length_reward(response: str) -> float:
    return len(response) / 10.0


def length_cost(response: str) -> float:
    """Above Safe-RLHF's default cost_limit of 0 whatever the response: lambda must rise."""
    return 1.0 + len(response) / 20.0


def config(tmp_path, *overrides):
    return load_config(RLConfig, None, [
        "model=tiny-llama", "actor.layout.tp=2", "rollout.sampling.max_tokens=8",
        "rollout.sampling.n=2", "train_batch_size=2", "steps=2", "actor.engine.micro_batch_size=1",
        "actor.engine.optim.lr=1e-3", "data.max_prompt_tokens=32", "ray.num_cpus=2", f"tracking.out_dir={tmp_path}", *overrides])


CRITIC = ("critic.layout.tp=2", "critic.engine.micro_batch_size=1")


def untimed(row):
    """A metrics row without what the machine decides (timings, device memory)."""
    return {k: v for k, v in row.items() if not k.startswith((*CLOCK_KEYS, "memory/"))}


def run(cfg, reward_fn=length_reward):
    trainer = RLTrainer(cfg, reward_fn=reward_fn)
    try:
        before = trainer.actor_weights()
        history = trainer.train(PROMPTS)
        after = trainer.actor_weights()
    finally:
        trainer.close()
    return history, before, after


def check_run(history, before, after, expected_keys):
    assert len(history) == 2
    for row in history:
        for key in expected_keys:
            assert key in row, key
            assert math.isfinite(row[key]), (key, row[key])
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-6, "the actor's weights did not change"


def test_grpo_vllm(tmp_path):
    history, before, after = run(config(tmp_path, "algorithm.name=grpo", "rollout.backend=vllm",
                                        "name=grpo"))
    check_run(history, before, after, ["reward/mean", "kl", "rollout/neg_logprob", "actor/clip_frac",
                                       "actor/grad_norm", "timing/reshard_s",
                                       "response_length/mean"])
    assert (tmp_path / "grpo" / "reward_curve.png").stat().st_size > 0


def test_ppo_megatron_backend_reward_model_layout_auto(tmp_path, capsys):
    # The reward comes from a (random, tiny, Qwen2-shaped) reward model scoring the last token.
    # layout=auto: the planner maps the run onto its 2 ranks at start-up, from the cost model;
    # with cluster.calibration every step also logs the cost model's seconds per phase.
    from hybridflow.config.sources import model_sources
    from hybridflow.planner.search import resolve_auto
    from tests.unit.test_planner import AUTO_CALIB
    AUTO_CALIB.to_json(tmp_path / "calibration.json")
    # Configured at pp=2 (a pipeline bubble), which the planner moves off: to tp=2 at these rates.
    cfg = config(tmp_path, "algorithm.name=ppo", "rollout.backend=megatron",
                 "algorithm.kl_in_reward=true", "name=ppo", "reward_model=tiny-qwen2", *CRITIC,
                 "actor.layout.tp=1", "actor.layout.pp=2", "critic.layout.tp=1",
                 "critic.layout.pp=2", f"cluster.calibration={tmp_path / 'calibration.json'}",
                 "layout=auto")
    planned, mapping = resolve_auto(cfg, model_sources(cfg)[1])
    assert (planned.actor.layout.tp, planned.critic.layout.tp, planned.rollout.tp) == (2, 2, 2)
    history, before, after = run(cfg, reward_fn=None)
    assert "planner (actor.layout.tp, " in capsys.readouterr().out
    saved = load_config(RLConfig, tmp_path / "ppo" / "config.yaml")  # what a resume reads
    assert saved.layout == "manual" and saved.actor.layout == planned.actor.layout
    check_run(history, before, after, ["reward/mean", "critic/vf_loss", "critic/grad_norm",
                                       "actor/pg_loss", "timing/values_s", "timing/reshard_s"])
    assert history[0]["reward/std"] > 0  # model scores, not the constant of a missing head
    phases = ("reshard", "weight_load", "generate", "back_to_train", "old_logprobs",
              "ref_logprobs", "values", "reward", "update_critic", "update_actor")
    for row in history:  # beside each measured phase, its prediction
        assert all(f"timing/{p}_s" in row for p in phases)
        # At generation tp = training tp the switch gathers nothing: the planner's pick costs 0.
        assert row["predicted/reshard_s"] == 0
        assert all(row[f"predicted/{p}_s"] > 0 for p in phases if p != "reshard")
        assert row["predicted/step_s"] == pytest.approx(sum(row[f"predicted/{p}_s"]
                                                            for p in phases))


def test_safe_rlhf_trains_both_critics_and_moves_lambda_and_resumes(tmp_path):
    # One sample per prompt (Dai et al.'s n = 1): GAE from a critic and a cost critic.
    overrides = ("algorithm.name=safe_rlhf", "rollout.backend=megatron", "rollout.sampling.n=1",
                 "train_batch_size=4", "algorithm.kl_in_reward=true", "algorithm.kl_coef=0.05",
                 "actor.layout.tp=1", "critic.layout.tp=1", "critic.engine.micro_batch_size=1",
                 "critic.engine.optim.lr=1e-3", "checkpoint.every=1",
                 f"cost={__name__}:length_cost")
    cfg = config(tmp_path, *overrides, "name=safe")
    trainer = RLTrainer(cfg, reward_fn=length_reward, cost_fn=length_cost)
    try:
        before = trainer.actor_weights()
        history = trainer.train(PROMPTS)
        after = trainer.actor_weights()
        # The cost critic trains: after one more update its values of the same samples move.
        batch = trainer.generate(["hello there", "say yes"])
        first = trainer.score(batch)
        trainer.update_actor(first)
        second = trainer.score(batch)
    finally:
        trainer.close()
    check_run(history, before, after, ["critic/vf_loss", "critic/grad_norm", "cost_critic/vf_loss",
                                       "cost_critic/grad_norm", "cost/mean", "lagrange",
                                       "timing/cost_values_s", "timing/update_cost_critic_s"])
    mask = first["response_mask"].bool()
    assert not torch.equal(first["cost_values"][mask], second["cost_values"][mask])
    assert not torch.equal(first["cost_values"][mask], first["values"][mask])  # two models
    # lambda from 1 (lagrange_init), lr 0.1, limit 0, before each step's advantages:
    # log lambda += 0.1 * (cost/mean - 0) * lambda, every cost above the limit: it rises.
    lam1 = math.exp(0.1 * history[0]["cost/mean"])
    lam2 = lam1 * math.exp(0.1 * history[1]["cost/mean"] * lam1)
    assert history[0]["lagrange"] == pytest.approx(lam1) and lam1 > 1
    assert history[1]["lagrange"] == pytest.approx(lam2) and lam2 > lam1
    # The checkpoint holds the cost critic; a run resumed from step 1 logs step 2 exactly.
    step1 = tmp_path / "safe" / "checkpoints" / "step_000001"
    assert (step1 / "cost_critic").is_dir() and (step1 / "cost_critic-rank0000.pt").is_file()
    resumed = RLTrainer(config(tmp_path, *overrides, "name=safe-resumed", f"resume={step1}"),
                        reward_fn=length_reward, cost_fn=length_cost)
    try:
        (row,) = resumed.train(PROMPTS)
    finally:
        resumed.close()
    assert untimed(row) == untimed(history[1])


def test_grpo_lora_and_its_export(tmp_path):
    # LoRA adapters alone train; the reference is the base (the adapters off), so the KL to it is
    # 0 before the first update (B starts at zero) and not after; the merged policy moves.
    from hybridflow.models.hf import hf_to_megatron, load_hf_config, load_hf_state_dict
    from hybridflow.training.megatron_ckpt import megatron_to_hf_checkpoint
    history, before, after = run(config(tmp_path, "algorithm.name=grpo", "name=grpo-lora",
                                        "rollout.backend=megatron", "actor.lora.rank=4",
                                        "actor.kl_loss_coef=0.1", "checkpoint.every=2"))
    check_run(history, before, after, ["reward/mean", "actor/kl_loss", "actor/grad_norm"])
    assert history[0]["actor/kl_loss"] == pytest.approx(0, abs=1e-6)
    assert history[1]["actor/kl_loss"] > 1e-8
    # The run's checkpoint exports as the merged policy, with its adapters in PEFT's format.
    out = megatron_to_hf_checkpoint(tmp_path / "grpo-lora", tmp_path / "hf", verbose=False)
    exported = hf_to_megatron(load_hf_state_dict(out), load_hf_config(out))
    for name, w in after.items():
        torch.testing.assert_close(exported[name], w, atol=1e-6, rtol=0, msg=name)
    assert (out / "lora" / "adapter_model.safetensors").is_file()
    # Merged in place (and so with the resident switch, the megatron backend's default): the
    # generation weights are the same bits, the base comes back after every switch, so the run
    # logs the same rows and ends with the same weights.
    same, _, after_in_place = run(config(tmp_path, "algorithm.name=grpo", "name=grpo-lora-ip",
                                         "rollout.backend=megatron", "actor.lora.rank=4",
                                         "actor.kl_loss_coef=0.1",
                                         "hybrid_engine.lora_merge=in_place"))
    for row, got in zip(history, same):
        assert {k: v for k, v in got.items() if not k.startswith((*CLOCK_KEYS, "memory/"))} == \
            {k: v for k, v in row.items() if not k.startswith((*CLOCK_KEYS, "memory/"))}
    for name, w in after.items():
        assert torch.equal(after_in_place[name], w), name


@pytest.mark.parametrize("use_3d_hybrid", [True, False], ids=["3d", "naive"])
def test_python_api_and_stepwise(tmp_path, capsys, use_3d_hybrid):
    from hybridflow.hybrid_engine.switch import generation_metas, naive_recv_bytes
    from hybridflow.hybrid_engine.plan import copied_own_bytes, plan_reshard
    from hybridflow.models.tiny import tiny_llama_config
    from hybridflow.models.params import llama_param_metas
    from hybridflow.parallel.layout import GenLayout, TrainLayout

    # ReMax in the naive mode: its greedy baseline is one more generation (and switch) per step.
    # The 3d mode at PP=2 with resident parameters (the hf backend's default is off): every shard
    # lives in the generation storage, none is copied; the naive mode at TP=2 copies them all.
    algorithm = "grpo" if use_3d_hybrid else "remax"
    t, p = (1, 2) if use_3d_hybrid else (2, 1)
    resident = {"hybrid_engine.resident": True} if use_3d_hybrid else {}
    trainer = RLTrainer(model="tiny-llama", reward_fn=length_reward, algorithm=algorithm,
                        max_steps=2, per_device_train_batch_size=1,
                        gradient_accumulation_steps=2, learning_rate=1e-3,
                        use_3d_hybrid=use_3d_hybrid, num_generations=2, max_new_tokens=8,
                        config=None, **{"actor.layout.tp": t, "actor.layout.pp": p,
                                        "rollout.backend": "hf",
                                        "train_batch_size": 2, "data.max_prompt_tokens": 32,
                                        "ray.num_cpus": 2, "tracking.out_dir": str(tmp_path),
                                        **resident})
    try:
        assert trainer.config.actor.mini_batches == 2  # 4 samples / (1 x 2 x dp 1)
        history = trainer.train([{"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "hello"}]},
                                 {"messages": [{"role": "user", "content": "2+2?"}]}])
        assert (f"train view (tp={t}, pp={p}, dp=1) -> generation view (tp=1, pp=1, micro-dp=2)"
                in capsys.readouterr().out)
        # The bytes each switch moved, beside the naive path's, as the plan says.
        gen = GenLayout(train=TrainLayout(tp=t, pp=p), tp=1)
        metas = generation_metas(llama_param_metas(tiny_llama_config()), False, gen)
        plan = plan_reshard(gen, metas, 4, 64 << 20)
        planned = plan.ranks[0].recv_bytes
        naive = naive_recv_bytes(gen, metas, 0, 4)
        copied = copied_own_bytes(plan, 0, resident=use_3d_hybrid)
        assert (copied == 0) is use_3d_hybrid and copied_own_bytes(plan, 0, resident=False) > 0
        for row in history:
            assert row["reshard/bytes_received"] == (planned if use_3d_hybrid else naive)
            assert row["reshard/naive_bytes"] == naive
            assert row["reshard/redundant_bytes"] == copied
        # Step-wise on the same controller and workers.
        batch = trainer.generate(["tell me a story", "2+2?"])
        assert len(batch) == 4 and len(batch["response_text"]) == 4
        batch = trainer.score(batch)
        assert torch.isfinite(batch["advantages"]).all()
        metrics = trainer.update_actor(batch)
        assert math.isfinite(metrics["actor/grad_norm"])
    finally:
        trainer.close()

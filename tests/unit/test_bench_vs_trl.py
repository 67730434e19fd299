"""tools/bench_vs_trl.py without TRL: both sides' configs describe the same work (the hybridflow
overrides load into an RLConfig of WORKLOAD's values; the TRL arguments make one optimizer step of
8 prompts x 4 completions by TRL 1.x's counting), and the arguments are checked."""

import importlib.util
import sys
from pathlib import Path

import pytest

from hybridflow.config import RLConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_vs_trl",
                                                  ROOT / "tools" / "bench_vs_trl.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_vs_trl"] = module
    spec.loader.exec_module(module)
    return module


bench = _load_tool()
W = bench.WORKLOAD


@pytest.mark.parametrize("layout,pp,dp", [("pp2", 2, 1), ("dp2", 1, 2)])
def test_hybridflow_overrides_give_the_workload(tmp_path, layout, pp, dp):
    cfg = load_config(RLConfig, bench.BASE_CONFIG,
                      bench.hybridflow_overrides(layout, 3, 4, str(tmp_path), "b"))
    assert (cfg.actor.layout.tp, cfg.actor.layout.pp, cfg.actor.layout.dp) == (1, pp, dp)
    assert cfg.rollout.tp == 1 and cfg.rollout.backend == "vllm"
    assert cfg.algorithm.name == "grpo" and cfg.steps == 3
    assert cfg.data.tasks == [W["task"]] and cfg.data.task_kwargs == {W["task"]: W["task_kwargs"]}
    assert cfg.data.system_prompt == W["system_prompt"]
    s = cfg.rollout.sampling
    assert (cfg.train_batch_size, s.n, s.max_tokens, s.temperature, s.top_p, s.top_k) == \
        (8, 4, 64, 1.0, 1.0, 0)
    a = cfg.actor
    assert (a.engine.optim.lr, a.engine.optim.clip_grad, a.kl_loss_coef, a.kl_loss_type,
            a.loss_agg_mode, a.engine.dtype) == (5e-6, 1.0, 0.04, "k3", "token-mean", "fp32")
    assert cfg.checkpoint.every == 0 and not cfg.validation.enabled
    assert cfg.tracking.out_dir == str(tmp_path)


@pytest.mark.parametrize("micro_batch", [1, 4, 8, 32])
def test_trl_step_is_eight_prompts_of_four(tmp_path, micro_batch):
    kwargs = bench.trl_config_kwargs(3, micro_batch, str(tmp_path))
    assert bench.completions_per_step(kwargs) == (32, 8)
    assert kwargs["per_device_train_batch_size"] == micro_batch
    assert (kwargs["num_generations"], kwargs["max_completion_length"], kwargs["temperature"],
            kwargs["learning_rate"], kwargs["beta"], kwargs["max_grad_norm"]) == \
        (4, 64, 1.0, 5e-6, 0.04, 1.0)
    # dapo: TRL's token-mean over the whole accumulated batch; the same prompts in hybridflow's
    # order, a constant lr as hybridflow's.
    assert kwargs["loss_type"] == "dapo" and kwargs["shuffle_dataset"] is False
    assert kwargs["lr_scheduler_type"] == "constant" and kwargs["bf16"] is False


def test_trl_micro_batch_must_divide_the_step(tmp_path):
    with pytest.raises(ValueError, match="must divide the 32 completions"):
        bench.trl_config_kwargs(3, 5, str(tmp_path))


def test_arguments():
    assert bench.median_after_warmup([100.0, 3.0, 1.0, 2.0]) == 2.0
    assert bench.median_after_warmup([100.0]) is None
    args = bench.parse_args(["--sides", "hybridflow", "--layout", "dp2", "--steps", "2"])
    assert (args.sides, args.layout, args.steps, args.micro_batch) == (["hybridflow"], "dp2", 2, 4)
    for bad in (["--steps", "1", "--sides", "hybridflow"],  # no step after the warm-up
                ["--sides", "trl"],  # no --trl-python
                ["--sides", "vllm"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_set_changes_the_layout_only(tmp_path):
    args = bench.parse_args(["--sides", "hybridflow", "--set", "actor.layout.last_stage_layers=13"])
    assert args.set == ["actor.layout.last_stage_layers=13"]
    overrides = bench.hybridflow_overrides("pp2", 3, 4, str(tmp_path), "b") + args.set
    cfg = load_config(RLConfig, bench.BASE_CONFIG, overrides)
    assert (cfg.actor.layout.pp, cfg.actor.layout.last_stage_layers) == (2, 13)
    # A token budget replaces the micro-batch size, which the run config refuses beside it
    budget = ["actor.engine.max_tokens_per_micro_batch=400"]
    config, sized = bench.hybridflow_config(tmp_path, budget)
    assert not sized and config.parent == tmp_path
    cfg = load_config(RLConfig, config, bench.hybridflow_overrides("dp2", 3, None, str(tmp_path),
                                                                   "b") + budget)
    assert cfg.actor.engine.max_tokens_per_micro_batch == 400
    assert cfg.actor.engine.optim.lr == bench.WORKLOAD["lr"] and cfg.actor.layout.dp == 2
    assert bench.hybridflow_config(tmp_path, args.set) == (bench.BASE_CONFIG, True)
    # The work compared with TRL's is not --set's to change.
    for bad in ("actor.kl_loss_coef=0", "rollout.sampling.max_tokens=8", "train_batch_size=4",
                "actor.layout.pp"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--sides", "hybridflow", "--set", bad])

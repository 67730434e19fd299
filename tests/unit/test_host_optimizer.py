"""The host optimizer (``engine.optim.offload``, ``training/host_optimizer.py``) against
Megatron's: the same steps give the same weights, grad norms and metrics, with gradients
accumulated over micro-batches, clipped, decayed by Megatron's groups, in fp32 and bf16; a
nonfinite step is skipped; its state checkpoints and resumes exactly; and the engine holds no
gradient buffer. On CPU the host is the device (the copies are plain copies); on a GPU the same
test runs the streams, the page-locked buffers and the GPU's memory check."""

import math

import pytest
import torch

from hybridflow.errors import ConfigError
from hybridflow.models.config import ModelConfig
from hybridflow.parallel.layout import TrainLayout
from hybridflow.parallel.spawn import spawn
from hybridflow.training.config import EngineConfig, OptimConfig
from tests.distributed.update_common import GRAD_MODEL, weighted_logprob_batch


def engine_config(dtype: str, offload: bool, clip: float, **kw) -> EngineConfig:
    # micro-batches of 1 over the 4 sequences: each gradient arrives 4 times a step
    return EngineConfig(dtype=dtype, optim=OptimConfig(
        lr=1e-2, weight_decay=0.1, clip_grad=clip, offload=offload),
        **{"micro_batch_size": 1, **kw})


def run(rank, world, ckpt_dir):
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.training import host_optimizer
    from hybridflow.training.engine import TrainEngine
    from hybridflow.training.megatron_ckpt import load_train_state, save_train_state

    host_optimizer.CHUNK = 1000  # Adam over several chunks of each group (the small one: 1)
    batch, loss_fn = weighted_logprob_batch()
    model = ModelConfig(**GRAD_MODEL)
    full = init_full_weights(llama_param_metas(model), seed=3, std=0.3)
    cuda = torch.cuda.is_available()
    out = {"initial": {n: t.float() for n, t in full.items()}}
    for dtype in ("fp32", "bf16"):
        # clip 0.5 clips every step here (norms ~1-3); 0 never does
        for clip in (0.5, 0.0):
            for offload in (False, True):
                engine = TrainEngine(model, TrainLayout(), engine_config(dtype, offload, clip))
                engine.load_full_weights(full)
                before = torch.cuda.memory_allocated() if cuda else 0
                steps = [engine.train_step(batch, loss_fn) for _ in range(3)]
                run_out = {"steps": steps, "weights": {
                    n: p.detach().float().cpu().clone() for n, p in engine.named_local_params()}}
                if not offload:  # Megatron's decay groups: 1-D parameters exempt
                    from hybridflow.training.engine import _torch_param_groups
                    run_out["decay"] = sorted({(p.dim(), g["weight_decay"])
                                               for g in _torch_param_groups(engine.optimizer)
                                               for p in g["params"]})
                else:
                    run_out["grads_left"] = [n for n, p in engine.named_local_params()
                                             if p.grad is not None]
                    run_out["buffers"] = sum(len(c.buffers) for c in engine.chunks)
                    if cuda:
                        run_out["memory_growth"] = torch.cuda.memory_allocated() - before
                out[dtype, clip, offload] = run_out
                del engine
    # one micro-batch of the 4 sequences (each gradient arrives once), its layers recomputed:
    # the gradients then come out of Megatron's checkpoint's own backward
    # (bf16: kept in bf16 on the host, widened to fp32 by Adam's chunks)
    for dtype in ("fp32", "bf16"):
        for offload in (False, True):
            engine = TrainEngine(model, TrainLayout(), engine_config(
                dtype, offload, 0.5, micro_batch_size=4, recompute=offload))
            engine.load_full_weights(full)
            out["one micro-batch", dtype, offload] = {
                "steps": [engine.train_step(batch, loss_fn) for _ in range(3)],
                "weights": {n: p.detach().float().cpu().clone()
                            for n, p in engine.named_local_params()}}
            if offload:  # then a step of two micro-batches: summed in fp32 from then on
                kept = engine.optimizer.grad[0].dtype
                engine.config.micro_batch_size = 2
                engine.train_step(batch, loss_fn)
                out["grad dtypes", dtype] = (kept, engine.optimizer.grad[0].dtype)
            del engine
    # resume: 2 steps, save, a new engine loads and takes the third
    config = engine_config("bf16", True, 0.5)
    engine = TrainEngine(model, TrainLayout(), config)
    engine.load_full_weights(full)
    for _ in range(2):
        engine.train_step(batch, loss_fn)
    save_train_state(engine, ckpt_dir)
    del engine
    resumed = TrainEngine(model, TrainLayout(), config)
    load_train_state(resumed, ckpt_dir)
    out["resumed"] = {"step": resumed.train_step(batch, loss_fn), "weights": {
        n: p.detach().float().cpu().clone() for n, p in resumed.named_local_params()}}
    # a nonfinite gradient: no step, weights unchanged
    engine = TrainEngine(model, TrainLayout(), engine_config("fp32", True, 1.0))
    engine.load_full_weights(full)
    w0 = {n: p.detach().cpu().clone() for n, p in engine.named_local_params()}
    metrics = engine.train_step(batch, lambda lp, mb: (lp.sum() * math.inf, {}))
    out["threads"] = torch.get_num_threads()
    out["nonfinite"] = (metrics["nonfinite"], all(
        torch.equal(p.detach().cpu(), w0[n]) for n, p in engine.named_local_params()))
    return out


def test_host_optimizer_matches_megatron(tmp_path):
    out = spawn(run, 1, str(tmp_path / "ckpt"),
                backend="nccl" if torch.cuda.is_available() else "gloo")[0]
    for clip in (0.5, 0.0):
        for dtype in ("fp32", "bf16"):
            host = out[dtype, clip, True]
            assert host["grads_left"] == [] and host["buffers"] == 0
            assert out[dtype, clip, False]["decay"] == [(1, 0.0), (2, 0.1)]
            if "memory_growth" in host:  # no gradient or state left on the GPU
                assert host["memory_growth"] <= 1 << 20, host["memory_growth"]
        # fp32: Megatron's arithmetic, to rounding
        ref, host = out["fp32", clip, False], out["fp32", clip, True]
        for r, h in zip(ref["steps"], host["steps"]):
            assert h["nonfinite"] == r["nonfinite"] == 0.0
            assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
            assert h["loss"] == pytest.approx(r["loss"], rel=1e-5)
            if clip:
                assert r["grad_norm"] > clip  # the clip acted
        for name, w in ref["weights"].items():
            torch.testing.assert_close(host["weights"][name], w, rtol=1e-4, atol=2e-5, msg=name)
        # bf16: each gradient arrives rounded to bf16, where Megatron adds the embedding's (and on
        # a GPU every GEMM's) in fp32, and Adam's normalised steps amplify a rounding into a
        # whole step for the smallest gradients; so each bf16 run is compared with the fp32 one:
        # the host optimizer's no further from it than Megatron's, but for noise. A lost
        # gradient, decay or clip is off by a whole step everywhere.
        for name, w in ref["weights"].items():
            moved = float((w - out["initial"][name]).norm())
            errors = [float((out["bf16", clip, offload]["weights"][name] - w).norm()) / moved
                      for offload in (False, True)]
            assert errors[1] < 1.5 * errors[0] + 0.05, (name, errors)
    # the runs moved the weights: three steps of lr 1e-2
    ref, host = out["one micro-batch", "fp32", False], out["one micro-batch", "fp32", True]
    for r, h in zip(ref["steps"], host["steps"]):
        assert h["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    for name, w in ref["weights"].items():
        torch.testing.assert_close(host["weights"][name], w, rtol=1e-4, atol=2e-5, msg=name)
        moved = float((w - out["initial"][name]).norm())
        errors = [float((out["one micro-batch", "bf16", offload]["weights"][name] - w).norm())
                  / moved for offload in (False, True)]
        assert errors[1] < 1.5 * errors[0] + 0.05, (name, errors)
    assert out["grad dtypes", "bf16"] == (torch.bfloat16, torch.float32)
    assert out["grad dtypes", "fp32"] == (torch.float32, torch.float32)
    for name, w in out["fp32", 0.0, True]["weights"].items():
        assert (w - out["initial"][name]).abs().max() > 1e-3, name
    # resume: the third step after a checkpoint equals the third step of one run
    continuous = out["bf16", 0.5, True]
    assert out["resumed"]["step"]["loss"] == continuous["steps"][2]["loss"]
    assert out["resumed"]["step"]["grad_norm"] == continuous["steps"][2]["grad_norm"]
    for name, w in continuous["weights"].items():
        assert torch.equal(out["resumed"]["weights"][name], w), name
    assert out["nonfinite"] == (1.0, True)
    if torch.cuda.is_available():  # the worker's one thread (spawn's, as Ray's) widened
        import os
        assert out["threads"] == len(os.sched_getaffinity(0))


def test_refusals():
    from hybridflow.training.engine import TrainEngine

    with pytest.raises(ConfigError, match="offload.*Adam only"):
        OptimConfig(name="sgd", offload=True)
    with pytest.raises(ConfigError, match="offload.*distributed=false"):
        OptimConfig(offload=True, distributed=True)
    with pytest.raises(ConfigError, match="engine.optim.offload.*tp = pp = dp = 1"):
        TrainEngine._checked_model(ModelConfig(**GRAD_MODEL), TrainLayout(tp=2),
                                   EngineConfig(optim=OptimConfig(offload=True)), "lm")


# ------------------------------------------------------------------------------------------------
# the planner: what the GPU holds and what the step costs

RUN_7B = ["model=llama2-7b", "reward=math", "data.max_prompt_tokens=128",
          "rollout.sampling.max_tokens=128", "rollout.backend=megatron", "actor.engine.dtype=bf16",
          "ray.gpus_per_worker=1", "actor.engine.micro_batch_size=4", "train_batch_size=8",
          "ref.offload=true"]


def _predict(*overrides, calib=None):
    import dataclasses

    from hybridflow.config.loader import load_config
    from hybridflow.config.rl import RLConfig
    from hybridflow.config.sources import model_sources
    from hybridflow.planner.cost import predict
    from tests.unit.test_planner import CALIB

    cfg = load_config(RLConfig, None, [*RUN_7B, *overrides])
    calib = calib or dataclasses.replace(CALIB, matmul_flops={"bf16": 1e14},
                                         host_to_device=5e10, host_adam=4e9)
    return cfg, predict(cfg, model_sources(cfg)[1], calib)


def test_the_gpu_holds_the_weights_alone_and_the_step_is_priced_on_the_host():
    from hybridflow.config.sources import model_sources
    from hybridflow.planner.memory import param_count

    cfg, megatron = _predict()
    n = param_count(model_sources(cfg)[1]["model"])
    cfg, host = _predict("actor.engine.optim.offload=true")
    update = {k: p.phases["actor update"]["actor"] for k, p in
              (("megatron", megatron.memory.pools[0]), ("host", host.memory.pools[0]))}
    assert update["megatron"]["grads"] == 4 * n and update["megatron"]["optimizer"] == 12 * n
    # two fp32 gradients of the 32000 x 4096 embedding in flight; no state
    assert update["host"]["grads"] == 2 * 4 * 32000 * 4096 and update["host"]["optimizer"] == 0
    assert update["host"]["weights"] == update["megatron"]["weights"] == 2 * n
    # one step: n parameters at host_adam, their fp32 main weights up at host_to_device; with m
    # micro-batches, m - 1 host adds of the fp32 gradients and a norm of them, 12 and 4 bytes a
    # parameter against Adam's 28
    m = cfg.train_batch_size * cfg.rollout.sampling.n // 4
    assert m == 8
    assert host.terms["update_actor"]["optimizer"] == pytest.approx(
        (1 + 7 * 12 / 28 + 4 / 28) * n / 4e9 + 4 * n / 5e10)
    _, one = _predict("actor.engine.optim.offload=true", "actor.engine.micro_batch_size=32")
    assert one.terms["update_actor"]["optimizer"] == pytest.approx(n / 4e9 + 4 * n / 5e10)


def test_a_calibration_without_the_host_rate_is_refused():
    import dataclasses

    from tests.unit.test_planner import CALIB
    with pytest.raises(ConfigError, match="^cluster.calibration.*host_adam.*hybridflow calibrate"):
        _predict("actor.engine.optim.offload=true", calib=dataclasses.replace(
            CALIB, matmul_flops={"bf16": 1e14}, host_to_device=5e10))


def test_a_run_over_the_gpu_is_told_the_host_optimizer_fits(capsys, tmp_path):
    from hybridflow.cli import main

    run = ["check", *RUN_7B[:-1], f"tracking.out_dir={tmp_path}"]  # the reference resident
    # Megatron's grads and Adam state are 100 of the update's 130 GiB; without them 30.8
    assert main([*run, "ray.gpu_memory_gib=80"]) == 2
    assert capsys.readouterr().err.rstrip().endswith(
        "predicted to fit with any one of: actor.engine.optim.offload=true (30.8 GiB), "
        "actor.lora.rank=16 (29.2 GiB)")
    # at two training ranks the host optimizer is refused: not offered
    assert main([*run, "ray.gpu_memory_gib=48", "actor.layout.tp=2", "rollout.tp=2",
                 "cluster.nodes=1", "cluster.gpus_per_node=2"]) == 2
    err = capsys.readouterr().err
    assert "predicted to fit with any one of: " in err and "optim.offload" not in err

"""A run predicted not to fit its GPU's memory is refused before any process starts, where the
GPU's size is known (``cluster.nodes`` with ``cluster.gpu_memory_gb``, or ``ray.gpu_memory_gib``):
one line naming the phase, the estimate against the memory, and the changes predicted to fit."""

import pytest

from hybridflow.cli import main

# A 7B LoRA actor beside a 7B reward model, one GPU each: the update's stored activations of
# 16 sequences of 1024 tokens are most of its 101.2 GiB; 8 sequences need 63.3 GiB (the
# generation phase's 70.7 is then the peak).
RUN = ["model=llama2-7b", "reward_model=llama2-7b", "data.source=synthetic",
       "data.max_prompt_tokens=512", "rollout.sampling.max_tokens=512", "rollout.backend=megatron",
       "actor.engine.dtype=bf16", "critic.engine.dtype=bf16", "ray.gpus_per_worker=1",
       "actor.lora.rank=16", "actor.engine.micro_batch_size=16", "train_batch_size=16"]


@pytest.mark.parametrize("command", ["check", "train"])
def test_a_run_over_the_gpu_cap_is_refused_in_one_line(command, tmp_path, capsys):
    out = tmp_path / "runs"
    assert main([command, *RUN, "ray.gpu_memory_gib=75", f"tracking.out_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "hybridflow: error: actor.engine.micro_batch_size: the actor update phase needs an "
        "estimated 101.2 GiB per GPU on the GPUs of actor + reward_model"), err
    assert "more than ray.gpu_memory_gib=75 GiB" in err
    # (full recompute at 16 sequences: the update needs 31.9 GiB, generation's 70.7 the peak)
    assert err.rstrip().endswith("predicted to fit with any one of: "
                                 "actor.engine.micro_batch_size=8 (70.7 GiB), "
                                 "actor.engine.recompute=true (70.7 GiB)"), err
    assert not out.exists()


def test_the_smaller_of_the_cap_and_the_declared_gpu_counts(capsys, tmp_path):
    out = f"tracking.out_dir={tmp_path}"
    # 80 GiB GPUs declared, each worker capped at 75: the cap is the limit
    assert main(["check", *RUN, "cluster.nodes=1", "cluster.gpus_per_node=1",
                 "ray.gpu_memory_gib=75", out]) == 2
    assert "more than ray.gpu_memory_gib=75 GiB" in capsys.readouterr().err
    # no cap: the declared GPU's 80; a micro-batch of 8 fits it, and the check prints the
    # estimate against it
    assert main(["check", *RUN, "cluster.nodes=1", "cluster.gpus_per_node=1",
                 "actor.engine.micro_batch_size=8", out]) == 0
    assert "estimate in GiB of cluster.gpu_memory_gb=80" in capsys.readouterr().out


def test_no_single_change_that_fits_is_said(capsys, tmp_path):
    # At 40 GiB the generation phase (the KV cache of 16 sequences beside both models' weights)
    # does not fit whatever the micro-batch, and LoRA leaves no reference to offload.
    assert main(["check", *RUN, "ray.gpu_memory_gib=40", f"tracking.out_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err.rstrip().endswith(
        "no single change of micro-batch, token budget, recompute, offload, LoRA or layout is "
        "predicted to fit")


def test_the_notes_a_cuda_out_of_memory_error_names():
    # what WorkerGroup adds to a CUDA out-of-memory error of each worker method: the phase,
    # the estimate against the GPU's memory and the key (tests/unit/test_worker_oom.py)
    from hybridflow.config.loader import load_config
    from hybridflow.config.rl import RLConfig
    from hybridflow.config.sources import model_sources
    from hybridflow.planner.memory import estimate_memory, out_of_memory_notes

    cfg = load_config(RLConfig, None, [*RUN, "actor.engine.micro_batch_size=8",
                                       "ray.gpu_memory_gib=75"])
    notes = out_of_memory_notes(cfg, estimate_memory(cfg, model_sources(cfg)[1]))
    assert sorted(notes) == ["actor", "reward_model"]
    assert notes["actor"]["update_actor"] == (
        "the actor update phase, estimated at 63.3 GiB per GPU of ray.gpu_memory_gib=75 "
        "(actor's the largest part); actor.engine.micro_batch_size: lower it: the stored "
        "activations grow with it")
    assert notes["actor"]["generate"].startswith("the generation phase, estimated at 70.7 GiB")
    assert notes["reward_model"]["compute_scores"].startswith("the inference phase")
    assert "update_critic" not in notes["reward_model"]  # no critic update phase: not trained
    # one sequence a micro-batch, tp = 1: recompute is what is left to turn
    cfg = load_config(RLConfig, None, [*RUN, "actor.engine.micro_batch_size=1",
                                       "data.max_prompt_tokens=3584"])
    notes = out_of_memory_notes(cfg, estimate_memory(cfg, model_sources(cfg)[1]))
    assert notes["actor"]["update_actor"].endswith(
        "(actor's the largest part); actor.engine.recompute: set it to true: each layer then "
        "keeps only its input for the backward"), notes["actor"]["update_actor"]
    cfg = load_config(RLConfig, None, [*RUN, "actor.engine.micro_batch_size=1",
                                       "data.max_prompt_tokens=3584",
                                       "actor.engine.recompute=true"])
    notes = out_of_memory_notes(cfg, estimate_memory(cfg, model_sources(cfg)[1]))
    assert "actor.engine.recompute" not in notes["actor"]["update_actor"]


def test_the_notes_of_a_streamed_reference_in_a_group_of_its_own():
    # ref.offload: outside its pass the reference holds nothing on its GPU (its generation phase
    # is empty); its pass's note names the inference phase: its two largest units (2 layers of
    # 7B, 0.75 GiB) beside the pass's transient
    from hybridflow.config.loader import load_config
    from hybridflow.config.rl import RLConfig
    from hybridflow.config.sources import model_sources
    from hybridflow.planner.memory import estimate_memory, out_of_memory_notes

    run = [a for a in RUN if not a.startswith("actor.lora")]
    cfg = load_config(RLConfig, None, [*run, "actor.engine.micro_batch_size=8",
                                       "placement.preset=standalone", "ref.offload=true",
                                       "ray.gpu_memory_gib=75"])
    estimate = estimate_memory(cfg, model_sources(cfg)[1])
    (pool,) = [p for p in estimate.pools if p.groups == ("reference",)]
    assert pool.total("generation") == 0
    assert pool.phases["inference"]["ref"]["streamed units"] == 2 * 202383360 * 2
    note = out_of_memory_notes(cfg, estimate)["reference"]["compute_ref_log_prob"]
    assert note.startswith("the inference phase, estimated at 1.5 GiB per GPU"), note


# ------------------------------------------------------------------------------------------------
# micro_batch_size: auto and max_tokens_per_micro_batch: auto, sized to the GPU's memory


@pytest.mark.parametrize("key, line", [
    # 16 sequences of 1024 tokens need 101.2 GiB, over 90% of 80; the generation phase (70.7
    # GiB: the 32 GiB KV cache of 64 sequences beside both models' weights, and the fast
    # decoder's prefill of the 16 prompts of 512 tokens, 1.3 GiB) is the peak at 8 and below
    ("actor.engine.micro_batch_size", "actor.engine.micro_batch_size auto -> 8: predicted peak "
     "70.7 GiB of ray.gpu_memory_gib=80 GiB, the largest of 1-64 within 90% of it (no "
     "cluster.calibration to rank them by time)"),
    ("actor.engine.max_tokens_per_micro_batch", "actor.engine.max_tokens_per_micro_batch auto "
     "-> 8192: predicted peak 70.7 GiB of ray.gpu_memory_gib=80 GiB, the largest of 1024-65536 "
     "within 90% of it")])
def test_auto_takes_the_largest_setting_that_fits(key, line, capsys, tmp_path):
    from hybridflow.config.loader import load_config
    from hybridflow.config.rl import RLConfig
    from hybridflow.planner.search import plan_layout

    run = [o for o in RUN if not o.startswith("actor.engine.micro_batch_size")]
    cfg = load_config(RLConfig, None, [*run, "ray.gpu_memory_gib=80", f"{key}=auto"])
    assert cfg.auto == [key]
    logged = []
    chosen = plan_layout(cfg, log=logged.append)
    assert logged == [line]
    assert chosen.auto == [] and str(chosen.actor.engine.__dict__[key.split(".")[-1]]) in line
    # hybridflow check logs the same line and passes the chosen setting's memory check
    assert main(["check", *run, "ray.gpu_memory_gib=80", f"{key}=auto",
                 f"tracking.out_dir={tmp_path}"]) == 0
    assert line in capsys.readouterr().out


@pytest.mark.parametrize("overrides, message", [
    (["actor.engine.micro_batch_size=auto"], "auto chooses the largest setting that fits the "
     "GPU's memory, which is unknown: set ray.gpu_memory_gib, or cluster.nodes and "
     "cluster.gpu_memory_gb"),
    (["actor.engine.micro_batch_size=auto", "ray.gpu_memory_gib=75"], "auto: even 1 is "
     "estimated at 70.7 GiB per GPU (the generation phase), above 90% of ray.gpu_memory_gib=75 "
     "GiB"),
    (["actor.engine.micro_batch_size=auto", "actor.engine.max_tokens_per_micro_batch=auto",
      "ray.gpu_memory_gib=80"], "set one of the two to auto"),
    # RUN sets micro_batch_size=16, which a budget leaves unread
    (["actor.engine.max_tokens_per_micro_batch=auto", "ray.gpu_memory_gib=80"],
     "actor.engine.micro_batch_size: has no effect beside max_tokens_per_micro_batch: auto")])
def test_auto_refusals(overrides, message, capsys, tmp_path):
    assert main(["check", *RUN, *overrides, f"tracking.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err

"""vLLM rollout on CPU, one in-process engine for the whole module: the same greedy tokens as the
Megatron-Core and transformers backends, log-probs equal to the training engine's (mismatch
metrics ~0, moving once the rollout's weights are perturbed), in-place weight updates equal to a
model loaded with those weights, and failed updates that leave a usable engine.
"""

import logging

import pytest
import torch

from hybridflow.errors import ArgumentError, ConfigError
from hybridflow.parallel.spawn import spawn
from tests.distributed.rollout_common import (CFG, GREEDY, MAX_MODEL_LEN, PROMPTS, SAMPLED,
                                              assert_generates_like, assert_mismatch_moves,
                                              logprob_pairs, mismatch_metrics, perturbed,
                                              samples_off_policy, summary, train_engine)

pytest.importorskip("vllm")


def recompute(rank, world, ckpt, outputs_by_key, off_policy):
    """In a fresh process: the training engine's log-probs for the given outputs, the Megatron
    backend's greedy generation, and the mismatch metrics of ``off_policy``'s outputs (by
    perturbation scale) against the unperturbed training engine."""
    from hybridflow.models.hf import load_hf_state_dict
    from hybridflow.rollout.megatron import MegatronRollout

    engine = train_engine(load_hf_state_dict(ckpt))
    pairs = {key: logprob_pairs(engine, outs) for key, outs in outputs_by_key.items()}
    mismatch = {scale: mismatch_metrics(engine, outs) for scale, outs in off_policy.items()}
    megatron = MegatronRollout(ckpt, max_model_len=MAX_MODEL_LEN)
    return pairs, summary(megatron.generate(PROMPTS, GREEDY)), mismatch


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_checkpoint
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", CFG, seed=0))


@pytest.fixture(scope="module")
def hf_sd(ckpt):
    from hybridflow.models.hf import load_hf_state_dict
    return load_hf_state_dict(ckpt)


@pytest.fixture(scope="module")
def rollout(ckpt):
    from hybridflow.rollout.vllm import VLLMRollout
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: starts in seconds
        # 1 MiB payloads: an update of the tiny model takes several RPCs.
        engine = VLLMRollout(ckpt, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=16 << 20,
                             bucket_bytes=1 << 20)
        yield engine
        engine.close()


@pytest.fixture(scope="module")
def reference(ckpt):
    from hybridflow.rollout.hf import HFRollout
    return HFRollout(ckpt)


@pytest.fixture(scope="module")
def first_outputs(rollout):
    return {"greedy": rollout.generate(PROMPTS, GREEDY),
            "sampled": rollout.generate(PROMPTS, SAMPLED)}


@pytest.fixture(scope="module")
def off_policy(rollout, hf_sd, first_outputs):
    """After first_outputs: the rollout holds hf_sd again when this returns."""
    return samples_off_policy(rollout, hf_sd)


@pytest.fixture(scope="module")
def recomputed(ckpt, first_outputs, off_policy):
    return spawn(recompute, 1, ckpt, first_outputs, off_policy)[0]


def test_greedy_same_in_vllm_megatron_transformers(first_outputs, recomputed, reference):
    ours = summary(first_outputs["greedy"])
    assert ours == summary(reference.generate(PROMPTS, GREEDY))
    assert ours == recomputed[1]


def test_logprobs_equal_training_engine(first_outputs, recomputed):
    for key in first_outputs:
        rollout_lp, train_lp = recomputed[0][key]
        assert rollout_lp.numel() > 20
        torch.testing.assert_close(rollout_lp, train_lp, atol=1e-4, rtol=0, msg=key)


def test_mismatch_metrics_are_zero_on_same_weights_and_grow_with_perturbation(recomputed):
    assert_mismatch_moves(recomputed[2], identical_bound=1e-5)


def test_sampling_is_seeded(rollout, first_outputs):
    sampled = summary(first_outputs["sampled"])
    assert [(i, j) for i, j, _, _ in sampled] == [(i, j) for i in range(3) for j in range(2)]
    assert summary(rollout.generate(PROMPTS, SAMPLED)) == sampled
    assert sampled[0][2] != sampled[1][2]


@pytest.mark.parametrize("transport", ["direct", "bytes"])
def test_weight_update_in_place(rollout, reference, hf_sd, first_outputs, monkeypatch, transport):
    from hybridflow.models.hf import hf_to_megatron, megatron_to_hf

    assert rollout.transport == "direct"  # "auto" with the engine in this process
    monkeypatch.setattr(rollout, "transport", transport)
    new = perturbed(hf_sd)
    # As the hybrid engine hands them over: split from Megatron's fused tensors (views).
    rollout.update_weights_hf(megatron_to_hf(hf_to_megatron(new, CFG), CFG).items())
    updated = assert_generates_like(rollout, reference, new)
    assert updated != summary(first_outputs["greedy"])
    # NaN weights poison the KV cache; the update after them zeroes it and nothing leaks.
    rollout.update_weights_hf({n: torch.full_like(t, float("nan")) for n, t in new.items()}.items())
    rollout.generate(PROMPTS, GREEDY)
    rollout.update_weights_hf(new.items())
    assert summary(rollout.generate(PROMPTS, GREEDY)) == updated
    # A subset (one whole layer) updates only that layer.
    layer0 = {n: t for n, t in hf_sd.items() if n.startswith("model.layers.0.")}
    rollout.update_weights_hf(layer0.items())
    assert_generates_like(rollout, reference, {**new, **layer0})
    rollout.update_weights_hf(hf_sd.items())
    reference.update_weights_hf(hf_sd.items())
    assert summary(rollout.generate(PROMPTS, GREEDY)) == summary(first_outputs["greedy"])
    assert rollout.restarts == 0


def test_invalid_update_is_refused_before_sending(rollout, hf_sd, first_outputs):
    bad_shape = {**hf_sd, "model.layers.1.self_attn.q_proj.weight": torch.zeros(3, 128)}
    with pytest.raises(ArgumentError, match=r"q_proj\.weight.*shape \[3, 128\]"):
        rollout.update_weights_hf(bad_shape.items())
    no_partner = {n: t for n, t in hf_sd.items() if n != "model.layers.2.self_attn.v_proj.weight"}
    with pytest.raises(ArgumentError, match=r"v_proj\.weight.*together"):
        rollout.update_weights_hf(no_partner.items())
    assert summary(rollout.generate(PROMPTS, GREEDY)) == summary(first_outputs["greedy"])
    assert rollout.restarts == 0


def test_failed_rpc_restarts_and_pushes_again(rollout, reference, hf_sd, monkeypatch, caplog):
    import hybridflow.rollout.vllm as mod

    monkeypatch.setattr(rollout, "transport", "bytes")  # a payload that can arrive corrupt
    real, calls = mod._serialize, []

    def flaky(tensors):  # the first payload arrives corrupt, as from a broken transport
        calls.append(len(tensors))
        return b"not safetensors" if len(calls) == 1 else real(tensors)

    monkeypatch.setattr(mod, "_serialize", flaky)
    new = perturbed(hf_sd, seed=3)
    before = rollout.restarts
    with caplog.at_level(logging.ERROR, logger="hybridflow.rollout.vllm"):
        rollout.update_weights_hf(new.items())
    assert rollout.restarts == before + 1
    assert "weight update failed in payload 1/" in caplog.text
    assert "restarting the vLLM engine" in caplog.text
    assert_generates_like(rollout, reference, new)
    rollout.update_weights_hf(hf_sd.items())
    reference.update_weights_hf(hf_sd.items())


def test_persistent_rpc_failure_raises_and_leaves_initial_weights(rollout, hf_sd, first_outputs,
                                                                  monkeypatch):
    import hybridflow.rollout.vllm as mod

    # Past our checks (which would refuse it), vLLM itself fails on a wrong shape every time.
    monkeypatch.setattr(mod, "group_hf_weights", lambda weights, cfg: {"all": dict(weights)})
    qkv = {n: hf_sd[n] for n in hf_sd if n.startswith("model.layers.1.self_attn.")
           and n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")}
    qkv["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(3, 128)
    before = rollout.restarts
    with pytest.raises(mod.RolloutWeightsError, match=r"while loading model\.layers\.1\.self_attn"
                       r"\.q_proj\.weight of shape \[3, 128\].*failed again.*holds the weights"):
        rollout.update_weights_hf(qkv.items())
    assert rollout.restarts == before + 2
    assert summary(rollout.generate(PROMPTS, GREEDY)) == summary(first_outputs["greedy"])


def test_sleep_is_a_logged_noop_on_cpu(rollout, caplog, first_outputs):
    if rollout.sleep_supported:
        pytest.skip("this platform supports vLLM sleep mode")
    with caplog.at_level(logging.INFO, logger="hybridflow.rollout.vllm"):
        rollout.sleep()
        rollout.wake()
    assert caplog.text.count("sleep mode is not available") <= 1
    assert summary(rollout.generate(PROMPTS, GREEDY)) == summary(first_outputs["greedy"])

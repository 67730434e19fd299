"""Megatron-Core rollout on CPU: the same tokens as transformers, log-probs equal to the training
engine's, in-place weight updates, failed updates that change nothing, TP=2 equal to TP=1.

All checks of one world size run in one spawned process (Megatron's groups are process state);
the tests below read its results.
"""

import pytest
import torch

from hybridflow.parallel.spawn import spawn
from tests.distributed.rollout_common import (CFG, GREEDY, MAX_MODEL_LEN, PROMPTS, SAMPLED,
                                              logprob_pairs, perturbed, summary, train_engine)


def _errors(fn) -> str:
    from hybridflow.config.errors import ConfigError
    try:
        fn()
    except ConfigError as e:
        return str(e)
    return "no error"


def megatron_checks(rank, world, ckpt):
    from hybridflow.models.hf import hf_to_megatron, load_hf_state_dict
    from hybridflow.rollout.base import SamplingConfig
    from hybridflow.rollout.hf import HFRollout
    from hybridflow.rollout.megatron import MegatronRollout

    hf_sd = load_hf_state_dict(ckpt)
    engine = train_engine(hf_sd)  # first: it sets up Megatron's groups, the rollout reuses them
    rollout = MegatronRollout(ckpt, max_model_len=MAX_MODEL_LEN)
    ref = HFRollout(ckpt)
    r = {}
    greedy = rollout.generate(PROMPTS, GREEDY)
    r["greedy"] = summary(greedy), summary(ref.generate(PROMPTS, GREEDY))
    r["greedy_logprobs"] = logprob_pairs(engine, greedy)
    sampled = rollout.generate(PROMPTS, SAMPLED)
    r["sampled"], r["sampled_again"] = summary(sampled), summary(rollout.generate(PROMPTS, SAMPLED))
    r["sampled_logprobs"] = logprob_pairs(engine, sampled)

    # A token that some greedy response first produces at step k >= 2: stopping there ends it.
    i, k, stop_token = next((o.prompt_index, k, t) for o in greedy
                            for k, t in enumerate(o.response_token_ids)
                            if k >= 2 and t not in o.response_token_ids[:k])
    stop = SamplingConfig(temperature=0, max_tokens=12, stop_token_ids=[stop_token])
    r["stop"] = (summary(rollout.generate(PROMPTS, stop)), summary(ref.generate(PROMPTS, stop)),
                 (i, k, stop_token))

    new = perturbed(hf_sd)
    rollout.update_weights_hf(new.items())
    ref.update_weights_hf(new.items())
    updated = rollout.generate(PROMPTS, GREEDY)
    r["updated"] = summary(updated), summary(ref.generate(PROMPTS, GREEDY)), summary(greedy)
    engine.load_full_weights(hf_to_megatron(new, CFG))
    r["updated_logprobs"] = logprob_pairs(engine, updated)

    # The hybrid engine's path: Megatron-named generation shards become the parameters.
    shards = {n: t.to(rollout.device) for n, t in hf_to_megatron(perturbed(hf_sd, seed=2),
                                                                CFG).items()}
    rollout.load_generation_weights(shards)
    r["aliased"] = all(rollout.params[n].data_ptr() == t.data_ptr() for n, t in shards.items())
    rollout.load_generation_weights(hf_to_megatron(new, CFG))

    bad_shape = {**new, "model.layers.1.self_attn.q_proj.weight": torch.zeros(3, CFG.hidden_size)}
    no_partner = {n: t for n, t in new.items() if n != "model.layers.0.mlp.up_proj.weight"}
    bad_shard = {"decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(2, 2)}
    r["errors"] = [_errors(lambda: rollout.update_weights_hf(bad_shape.items())),
                   _errors(lambda: rollout.update_weights_hf(no_partner.items())),
                   _errors(lambda: rollout.load_generation_weights(bad_shard))]
    r["after_errors"] = summary(rollout.generate(PROMPTS, GREEDY))
    return r


def megatron_tp2(rank, world, ckpt):
    from hybridflow.rollout.megatron import MegatronRollout

    rollout = MegatronRollout(ckpt, max_model_len=MAX_MODEL_LEN)  # tp = world size
    greedy = rollout.generate(PROMPTS, GREEDY)
    sampled = rollout.generate(PROMPTS, SAMPLED)
    return (rollout.tp, summary(greedy), [o.logprobs for o in greedy], summary(sampled))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_checkpoint
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", CFG, seed=0))


@pytest.fixture(scope="module")
def results(ckpt):
    return spawn(megatron_checks, 1, ckpt)[0]


def test_greedy_matches_transformers(results):
    ours, ref = results["greedy"]
    assert ours == ref
    assert all(len(tokens) == GREEDY.max_tokens for _, _, tokens, _ in ours)


def test_logprobs_equal_training_engine(results):
    for key in ("greedy_logprobs", "sampled_logprobs", "updated_logprobs"):
        rollout, train = results[key]
        assert rollout.numel() > 20
        torch.testing.assert_close(rollout, train, atol=1e-4, rtol=0, msg=key)


def test_sampling_is_seeded_and_samples_differ(results):
    sampled = results["sampled"]
    assert sampled == results["sampled_again"]
    assert [(i, j) for i, j, _, _ in sampled] == [(i, j) for i in range(3) for j in range(2)]
    assert sampled[0][2] != sampled[1][2]  # two samples of one prompt


def test_stop_token_ends_the_response(results):
    ours, ref, (i, k, stop_token) = results["stop"]
    assert ours == ref
    assert ours[i][2] == results["greedy"][0][i][2][:k + 1] and ours[i][3] == "stop"


def test_weight_update_matches_transformers(results):
    ours, ref, before = results["updated"]
    assert ours == ref
    assert ours != before


def test_generation_weights_are_used_without_copy(results):
    assert results["aliased"]


def test_failed_update_names_the_tensor_and_changes_nothing(results):
    shape, partner, shard = results["errors"]
    assert "model.layers.1.self_attn.q_proj.weight" in shape and "shape [3, 128]" in shape
    assert "model.layers.0.mlp.up_proj.weight" in partner and "together" in partner
    assert "decoder.layers.0.mlp.linear_fc2.weight" in shard and "tp=1" in shard
    assert results["after_errors"] == results["updated"][0]


def test_tp2_matches_tp1(ckpt, results):
    ranks = spawn(megatron_tp2, 2, ckpt)
    assert [r[0] for r in ranks] == [2, 2]
    assert ranks[0][1:] == ranks[1][1:]  # every TP rank samples the same tokens
    tp, greedy, logprobs, sampled = ranks[0]
    assert greedy == results["greedy"][0]
    assert sampled == results["sampled"]

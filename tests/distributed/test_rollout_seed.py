"""vLLM's samples, like the other backends', are decided by the backend's seed and its count of
calls when sampling.seed is None (a per-request seed, never vLLM's draws from the global RNG), and
its ``generate`` leaves the caller's global RNG alone (the engine runs in this process). The other
backends' checks: tests/unit/test_rollout_seed.py, tests/distributed/test_rollout_megatron.py."""

from dataclasses import replace

import pytest
import torch

from hybridflow.rollout.base import call_seed
from tests.distributed.rollout_common import CFG, MAX_MODEL_LEN, PROMPTS, UNSEEDED, summary

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from hybridflow.models.tiny import save_tiny_checkpoint
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", CFG, seed=0))


def test_vllm_unseeded_sampling_is_decided_by_the_rollout_seed(ckpt, monkeypatch):
    from hybridflow.rollout.vllm import VLLMRollout

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine
    with VLLMRollout(ckpt, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=16 << 20, seed=7) as rollout:
        torch.manual_seed(100)
        state = torch.get_rng_state()
        unseeded = [summary(rollout.generate(PROMPTS, UNSEEDED)) for _ in range(2)]
        kept = torch.equal(state, torch.get_rng_state())
        torch.manual_seed(200)
        # Calls 0 and 1 of a backend built with seed 7.
        seeded = [summary(rollout.generate(PROMPTS, replace(UNSEEDED, seed=call_seed(7, k))))
                  for k in range(2)]
    assert unseeded == seeded
    assert unseeded[0] != unseeded[1]
    assert kept

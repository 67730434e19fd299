"""vLLM on CPU with tied embeddings (SmolLM2, Qwen2-small): after an in-place weight update the
output head uses the new embedding. vLLM packs the head's GEMM weight when it loads a model;
a reload that brings only ``model.embed_tokens.weight`` (a tied checkpoint has no lm_head)
re-packs the embedding module alone, and the head kept computing logits with the initial
weights (found by the mismatch metrics: 0.02-0.1 nats per token after a few quickstart steps)."""

import dataclasses

import pytest

from tests.distributed.rollout_common import (CFG, MAX_MODEL_LEN, assert_generates_like,
                                              perturbed)

pytest.importorskip("vllm")

TIED = dataclasses.replace(CFG, tie_embeddings=True)


def test_a_tied_head_follows_the_updated_embedding(tmp_path, monkeypatch):
    from hybridflow.models.hf import load_hf_state_dict
    from hybridflow.models.tiny import save_tiny_checkpoint
    from hybridflow.rollout.hf import HFRollout
    from hybridflow.rollout.vllm import VLLMRollout

    ckpt = str(save_tiny_checkpoint(tmp_path / "ckpt", TIED, seed=0))
    new = perturbed(load_hf_state_dict(ckpt), scale=0.05)
    assert "lm_head.weight" not in new  # the head is the embedding
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    rollout = VLLMRollout(ckpt, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=16 << 20)
    try:
        rollout.update_weights_hf(new.items())
        assert_generates_like(rollout, HFRollout(ckpt), new)
    finally:
        rollout.close()

"""vLLM at TP=2 inside our own processes (``external_launcher``, as when generation is colocated
with training): the same tokens as transformers, in-place updates on both ranks, a failure on one
rank restarting both, and the caller's process group surviving the engine's shutdown.
"""

import pytest
import torch

from hybridflow.parallel.spawn import spawn
from tests.distributed.rollout_common import (CFG, GREEDY, MAX_MODEL_LEN, PROMPTS, SAMPLED,
                                              perturbed, summary)

pytest.importorskip("vllm")


def external_launcher_checks(rank, world, ckpt):
    import torch.distributed as dist

    import hybridflow.rollout.vllm as mod
    from hybridflow.models.hf import load_hf_state_dict

    hf_sd = load_hf_state_dict(ckpt)
    rollout = mod.VLLMRollout(ckpt, tp=world, max_model_len=MAX_MODEL_LEN,
                              kv_cache_bytes=16 << 20, external_launcher=True)
    r = {"greedy": summary(rollout.generate(PROMPTS, GREEDY)),
         "sampled": summary(rollout.generate(PROMPTS, SAMPLED))}
    rollout.update_weights_hf(perturbed(hf_sd).items())
    r["updated"] = summary(rollout.generate(PROMPTS, GREEDY))

    if rank == 0:  # only rank 0's payload arrives corrupt; both ranks must restart
        real, calls = mod._serialize, []

        def flaky(tensors):
            calls.append(1)
            return b"not safetensors" if len(calls) == 1 else real(tensors)
        mod._serialize = flaky
    rollout.update_weights_hf(perturbed(hf_sd, seed=3).items())
    r["restarts"] = rollout.restarts
    r["after_restart"] = summary(rollout.generate(PROMPTS, GREEDY))
    rollout.close()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # the world group outlives the engine
    r["all_reduce"] = total.item()
    return r


@pytest.mark.slow
def test_vllm_tp2_external_launcher(tmp_path):
    from hybridflow.models.hf import load_hf_state_dict
    from hybridflow.models.tiny import save_tiny_checkpoint
    from hybridflow.rollout.hf import HFRollout

    ckpt = str(save_tiny_checkpoint(tmp_path / "ckpt", CFG, seed=0))
    ranks = spawn(external_launcher_checks, 2, ckpt)
    assert ranks[0] == ranks[1]
    r = ranks[0]
    hf_sd = load_hf_state_dict(ckpt)
    reference = HFRollout(ckpt)
    assert r["greedy"] == summary(reference.generate(PROMPTS, GREEDY))
    assert [(i, j) for i, j, _, _ in r["sampled"]] == [(i, j) for i in range(3) for j in range(2)]
    reference.update_weights_hf(perturbed(hf_sd).items())
    assert r["updated"] == summary(reference.generate(PROMPTS, GREEDY))
    reference.update_weights_hf(perturbed(hf_sd, seed=3).items())
    assert r["restarts"] == 1
    assert r["after_restart"] == summary(reference.generate(PROMPTS, GREEDY))
    assert r["all_reduce"] == 3.0

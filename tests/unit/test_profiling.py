"""hybridflow.profiling: what a --profile summary counts as the device's work. A
``record_function`` range (the optimizer's ``Optimizer.step#AdamW.step``) appears on the device
timeline spanning the kernels it launched; counted as a kernel it doubled the optimizer's time
and hid that much idle time in the 7B update's profile."""

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from hybridflow.profiling import profile_step, self_us


def _event(device_type, annotation, device_us=0.0, cpu_us=0.0):
    return SimpleNamespace(device_type=device_type, is_user_annotation=annotation,
                           self_device_time_total=device_us, self_cpu_time_total=cpu_us)


def test_a_range_on_the_device_timeline_is_not_a_kernel():
    kernel = _event(DeviceType.CUDA, False, device_us=50.0)
    annotation = _event(DeviceType.CUDA, True, device_us=50.0)
    cpu_op = _event(DeviceType.CPU, False, device_us=50.0, cpu_us=7.0)
    assert [self_us(e, gpu=True) for e in (kernel, annotation, cpu_op)] == [50.0, 0.0, 0.0]
    assert self_us(cpu_op, gpu=False) == 7.0  # on CPU: the operation's own time


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU summary (a GPU's: the next test)")
def test_cpu_profile_names_the_costliest_operations():
    a = torch.randn(256, 256)
    prof = profile_step(lambda: [a @ a for _ in range(4)], None, top=3)
    assert prof["idle"] is None and prof["busy_s"] > 0
    assert any("mm" in op["name"] for op in prof["top"])


@pytest.mark.gpu
def test_gpu_busy_time_counts_each_kernel_once():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def step():
        with torch.profiler.record_function("range_around_the_matmuls"):
            for _ in range(8):
                a @ a

    step()
    prof = profile_step(step, None, top=10)
    names = [op["name"] for op in prof["top"]]
    assert "range_around_the_matmuls" not in names, names
    assert prof["busy_s"] <= prof["wall_s"]  # the range counted too would be ~2x the kernels

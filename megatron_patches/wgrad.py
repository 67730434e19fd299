"""The weight gradient accumulated into Megatron's fp32 ``main_grad`` by its own GEMM.

Target: megatron-core 0.16.1 (``megatron.core.tensor_parallel.layers``).

Reason: Megatron fuses the accumulation (``TransformerConfig.gradient_accumulation_fusion``) only
through APEX's ``fused_weight_gradient_mlp_cuda`` extension, which is compiled against a CUDA
toolkit and which we do not install. Without it every linear layer's bf16 weight gradient is
written out, and DDP's hook then reads it and ``main_grad`` and writes ``main_grad`` back: per
micro-batch, 10 bytes per parameter of traffic that is not the GEMM's. Profiled in a 7B GRPO update
on one H200 (micro-batch 4, 8 micro-batches): that add was the costliest kernel, 0.20 s of 1.25 s.
``torch.addmm(main_grad, dY^T, X, out_dtype=float32, out=main_grad)`` has cuBLAS multiply the bf16
operands and add the product into the fp32 buffer in one kernel (beta = 1), which is what the
extension's ``wgrad_gemm_accum_fp32`` does; this module stands in for the extension. On CPU (an
fp32 engine) it is ``main_grad.addmm_``, one BLAS call with beta = 1: no weight gradient tensor
per linear and micro-batch (SmolLM2-135M's output layer alone: 113 MB), and no separate add.

What Megatron does with it (unchanged): the linear's backward calls the stand-in, marks the weight
``grad_added_to_main_grad``, and hands autograd a dummy gradient that DDP's hook then skips. A
weight that also receives an ordinary gradient (the input embedding tied to the output layer) must
be marked ``zero_out_wgrad``, so the dummy is zeros and the hook adds the other gradient;
``TrainEngine`` does that where the lookup is Megatron's (``hybridflow/training/embedding.py``
adds its gradient by row instead, and the dummy need not be zeroed).

``tests/unit/test_wgrad_fusion.py`` fails if Megatron's call site or its availability flag changes,
and checks the gradients equal the unfused path's (fp32 on CPU, bf16 on a GPU).
"""

from __future__ import annotations

import sys

from megatron_patches._source import PatchError

ENABLED = True
"""False: leave Megatron's unfused path (the tests compare the two)."""

# the text of Megatron's backward that calls the extension, and its module-level flag
CALL_SITE = "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32("
FLAG = "_grad_accum_fusion_available"


def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad) -> None:
    """``main_grad += grad_output^T total_input`` (2-D operands: tokens x features) into an fp32
    ``main_grad``, in one cuBLAS call; bf16/fp16 operands are multiplied as such."""
    import torch
    if grad_output.dtype == main_grad.dtype:  # an fp32 engine
        main_grad.addmm_(grad_output.t(), total_input)
    elif main_grad.device.type == "cpu":  # no mixed-dtype addmm on CPU: the operands in fp32
        main_grad.addmm_(grad_output.t().float(), total_input.float())
    else:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32,
                    out=main_grad)


def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad) -> None:
    """The same into a ``main_grad`` of the operands' dtype."""
    main_grad.addmm_(grad_output.t(), total_input)


def apply() -> bool:
    """Make this module Megatron's ``fused_weight_gradient_mlp_cuda`` (unless the real extension
    is installed); returns whether ``gradient_accumulation_fusion`` can be switched on (False with
    ``ENABLED`` False). On CPU, Megatron's fused branch allocates its dummy gradient on the CUDA
    device: the CPU patch of that backward (megatron_patches.PATCHES) moves it to the CPU."""
    import inspect

    from megatron.core.tensor_parallel import layers
    if CALL_SITE not in inspect.getsource(layers) or not hasattr(layers, FLAG):
        raise PatchError("megatron.core.tensor_parallel.layers no longer calls "
                         f"{CALL_SITE!r} behind {FLAG}; megatron_patches.wgrad targets "
                         "megatron-core 0.16.1")
    if not ENABLED:
        return False
    if not getattr(layers, FLAG):
        layers.fused_weight_gradient_mlp_cuda = sys.modules[__name__]
        setattr(layers, FLAG, True)
    return True

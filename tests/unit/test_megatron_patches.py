"""Every megatron patch still applies to the installed megatron-core, and is still needed.

A patch replaces CUDA-only text (``torch.cuda.current_device()``, ``device='cuda'``, ...) inside one
function. If upstream changes that function, the text is gone: either the patch no longer applies
or upstream fixed it and the patch is no longer needed -- both fail here, naming the patch.
"""

import inspect

import pytest
import torch

import megatron_patches
from megatron_patches import PATCHES, SourcePatch
from megatron_patches._source import PatchError


@pytest.mark.parametrize("patch", PATCHES, ids=[p.target.split(":")[1] for p in PATCHES])
def test_patch_still_matches_and_is_still_needed(patch):
    assert patch.missing() == [], f"{patch.target}: {patch.reason}"
    assert patch.reason


def test_targets_the_installed_version():
    from importlib.metadata import version
    assert version("megatron-core") == megatron_patches.TARGET_VERSION


def test_apply_changes_the_running_code_and_is_idempotent():
    megatron_patches.apply()
    megatron_patches.apply()
    if torch.cuda.is_available():
        pytest.skip("patches are applied only without CUDA")
    from megatron.core.pipeline_parallel import schedules
    # The patched code no longer contains the CUDA literal ...
    fn = schedules.forward_backward_no_pipelining
    assert fn.__hybridflow_patched__
    assert '"cuda"' not in fn.__code__.co_consts and '"cpu"' not in fn.__code__.co_consts
    assert "cuda" not in [c for c in fn.__code__.co_consts if isinstance(c, str)]
    assert "cpu" in [c for c in fn.__code__.co_consts if isinstance(c, str)]
    # ... while inspect still shows the file's (unpatched) source, the reason the check above
    # looks at the code object.
    assert 'device="cuda"' in inspect.getsource(fn)


def test_a_patch_whose_text_is_gone_raises():
    stale = SourcePatch("megatron.core.utils:local_multi_tensor_l2_norm",
                        (("no such text", "x"),), "test")
    assert stale.missing() == ["no such text"]
    with pytest.raises(PatchError, match="no longer contains 'no such text'"):
        stale.apply()


def test_patch_keeps_zero_argument_super_working():
    # Methods calling super() close over __class__; the patch recompiles them inside a class.
    patch = next(p for p in PATCHES if p.target.endswith("MixedPrecisionOptimizer.__init__"))
    fn = patch.function()
    assert "__class__" in fn.__code__.co_freevars or "super()" not in inspect.getsource(fn)


def test_the_fallback_scale_is_in_place_for_one_tensor():
    # The clip by the total norm scales every gradient into itself: no scaled copy any more.
    # Another destination (a copy between dtypes) still gets Megatron's src * scale, rounded
    # as before.
    megatron_patches.apply()
    if torch.cuda.is_available():
        pytest.skip("patches are applied only without CUDA")
    from megatron.core.utils import local_multi_tensor_scale
    grads = [torch.randn(64, 8), torch.randn(5)]
    expected = [g * 0.37 for g in grads]
    before = [g.data_ptr() for g in grads]
    with torch.profiler.profile(record_shapes=True) as prof:
        local_multi_tensor_scale(2048, None, [grads, grads], 0.37)
    assert [g.data_ptr() for g in grads] == before
    # (a 0-dim copy of the Python scale may remain; no gradient-sized product or copy)
    sized = [(e.key, e.input_shapes[0]) for e in prof.key_averages(group_by_input_shape=True)
             if e.key in ("aten::mul", "aten::copy_") and e.input_shapes and e.input_shapes[0]]
    assert sized == []
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    half = torch.randn(16).bfloat16()
    out = torch.empty(16)
    local_multi_tensor_scale(2048, None, [[half], [out]], 0.5)
    torch.testing.assert_close(out, (half * 0.5).float(), atol=0, rtol=0)

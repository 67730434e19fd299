"""No module of the engine's model, or of the Megatron rollout's, runs code that megatron_patches
changes in meaning: on a GPU (no patches) they are the modules the CPU tests ran.

megatron_patches is applied only without CUDA. A patch that only moves a tensor from the current
CUDA device to the CPU is harmless there: on a GPU Megatron's own text puts it on the GPU. A patch
that changes what the code does (issue 39: the one that let Megatron's local norm run under
sequence parallelism) leaves the GPU with code the tests never ran. The check walks every module
of the built models (each class in its MRO) and every class or function their block spec names
(a norm factory such as WrappedTorchNorm builds an instance of another class, so only the spec
shows it), and looks each method up among the PATCHES targets. Two processes: an engine at TP=2
with sequence parallelism, and a rollout at TP=2.
"""

import dataclasses
import inspect

import pytest

from hybridflow.parallel.spawn import spawn
from megatron_patches import PATCHES

MODEL = dict(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=16, max_position_embeddings=32)


def only_moves_tensors(patch) -> bool:
    """Every replacement turns text that names CUDA (a device, a tensor type, a ``.cuda()`` or
    synchronize call) into text that does not: what the GPU runs instead differs in where
    tensors live. (A heuristic: it reads the replaced text, not what the code means.)"""
    return all("cuda" in old and "cuda" not in new for old, new in patch.replacements)


def spec_callables(spec):
    """Every class and function a (nested) Megatron spec names."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    if isinstance(spec, ModuleSpec):
        yield spec.module
        yield from spec_callables(spec.submodules)
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            yield from spec_callables(getattr(spec, field.name))
    elif isinstance(spec, (list, tuple)):
        for item in spec:
            yield from spec_callables(item)
    elif callable(spec):
        yield spec


def qualified_names(obj):
    """``module:qualname`` of a function, or of every method of a class and its bases."""
    if not inspect.isclass(obj):
        return {f"{obj.__module__}:{obj.__qualname__}"}
    return {f"{klass.__module__}:{klass.__qualname__}.{name}"
            for klass in obj.__mro__ for name in vars(klass)}


def patched_code_in(model) -> dict[str, set[str]]:
    """PATCHES targets among the methods of ``model``'s modules and of what its blocks' specs
    name, by the patches' kind: "moves tensors" or "changes code"."""
    from megatron.core.transformer.transformer_block import TransformerBlock
    kinds = {p.target: "moves tensors" if only_moves_tensors(p) else "changes code"
             for p in PATCHES}
    objs = {type(m) for m in model.modules()}
    for block in (m for m in model.modules() if isinstance(m, TransformerBlock)):
        objs.update(spec_callables(block.submodules))
    found: dict[str, set[str]] = {}
    for obj in objs:
        for target in qualified_names(obj) & set(kinds):
            found.setdefault(kinds[target], set()).add(target)
    return found


def norms(model) -> list:
    """The modules in the norm slots of ``model`` (the q/k slots hold IdentityOp: no qk norm)."""
    from megatron.core.transformer.identity_op import IdentityOp
    return [m for n, m in model.named_modules()
            if n.endswith("layernorm") and not isinstance(m, IdentityOp)]


def run(rank, world):
    import megatron_patches
    from hybridflow.models.config import ModelConfig
    from hybridflow.parallel.layout import TrainLayout
    from hybridflow.rollout.megatron import MegatronRollout
    from hybridflow.training.config import EngineConfig
    from hybridflow.training.engine import TrainEngine

    megatron_patches.apply()
    model = ModelConfig(**MODEL)
    engine = TrainEngine(model, TrainLayout(tp=2), EngineConfig(sequence_parallel=True))
    rollout = MegatronRollout(model)
    out = {}
    for name, built in (("engine", engine.chunks[0].module), ("rollout", rollout.model)):
        out[name] = {"patched": patched_code_in(built),
                     "norms": [f"{type(m).__module__}.{type(m).__name__}" for m in norms(built)],
                     "flags": {getattr(p, "sequence_parallel", None)
                               for m in norms(built) for p in m.parameters()}}
    return out


@pytest.fixture(scope="module")
def built():
    return spawn(run, 2)


def test_the_models_run_no_code_a_patch_changes(built):
    for rank in built:
        for name in ("engine", "rollout"):
            patched = rank[name]["patched"]
            assert "changes code" not in patched, (name, patched)
            # the walk sees patched methods: Megatron's RoPE, moved off the CUDA device
            assert any("RotaryEmbedding" in t for t in patched["moves tensors"]), patched


def test_every_norm_is_ours_and_flagged_as_the_config_says(built):
    for rank in built:
        for name, flag in (("engine", True), ("rollout", False)):
            # two a layer and the final one
            assert rank[name]["norms"] == (["hybridflow.training.norm.RMSNorm"]
                                           * (2 * MODEL["num_layers"] + 1)), rank[name]
            assert rank[name]["flags"] == {flag}, rank[name]

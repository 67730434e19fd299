"""Source patches: replace exact text inside one function of an installed package, in place.

A patch recompiles the function from its own source with a few literal replacements and swaps the
new code object into the existing function object, so every reference to it (including names
imported elsewhere with ``from x import f``) runs the patched code. A patch whose text is no longer
in the source raises PatchError: the package changed and the patch must be looked at again.
"""

from __future__ import annotations

import importlib
import inspect
import textwrap
from dataclasses import dataclass


class PatchError(RuntimeError):
    """A patch no longer matches the installed source."""


@dataclass(frozen=True)
class SourcePatch:
    """Literal replacements inside one function."""

    target: str
    """"module:Qualified.name" of the function or method."""
    replacements: tuple[tuple[str, str], ...]
    """(old, new) pairs; each old text must occur in the function's source."""
    reason: str
    """Why the upstream code fails without CUDA."""

    def function(self):
        module_name, qualname = self.target.split(":")
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = inspect.getattr_static(obj, part)
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        return inspect.unwrap(obj)

    def missing(self) -> list[str]:
        """The old texts that are not in the installed source (empty when the patch applies)."""
        source = inspect.getsource(self.function())
        return [old for old, _ in self.replacements if old not in source]

    def apply(self) -> None:
        fn = self.function()
        lines, first_line = inspect.getsourcelines(fn)
        source = textwrap.dedent("".join(lines))
        for old, new in self.replacements:
            if old not in source:
                raise PatchError(f"megatron_patches: {self.target} no longer contains {old!r}; "
                                 f"the installed megatron-core differs from the patched version")
            source = source.replace(old, new)
        if getattr(fn, "__hybridflow_patched__", False):
            return
        # Drop decorators: they already wrap the function object whose code we replace.
        source = source[source.index("def ") if source.startswith("@") else 0:]
        first_line += "".join(lines).count("\n", 0, "".join(lines).find("def "))
        # A method using zero-argument super() closes over __class__; compile it inside a class so
        # the new code object has the same free variables as the old one.
        in_class = "__class__" in fn.__code__.co_freevars
        if in_class:
            source = "class _Patched:\n" + textwrap.indent(source, "    ")
            first_line -= 1
        code = compile("\n" * (first_line - 1) + source, inspect.getsourcefile(fn), "exec")
        namespace: dict = {}
        exec(code, fn.__globals__, namespace)  # noqa: S102 - the source is the package's own
        new = namespace["_Patched"].__dict__[fn.__name__] if in_class else namespace[fn.__name__]
        new = inspect.unwrap(new.__func__ if isinstance(new, (staticmethod, classmethod)) else new)
        if new.__code__.co_freevars != fn.__code__.co_freevars:
            raise PatchError(f"megatron_patches: cannot patch {self.target}: it is a closure")
        fn.__code__ = new.__code__
        fn.__hybridflow_patched__ = True

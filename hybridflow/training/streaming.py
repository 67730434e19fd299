"""A frozen model's weights kept in host memory and streamed to the device unit by unit during its
forward passes (the reference with ``ref.offload``: ``TrainEngine.stream_weights``).

A unit is what runs in one piece of a GPTModel chunk's forward: its embedding, each transformer
layer, and its final norm with the output layer (which, tied at pp = 1, reads the embedding's
table: that table is then in both units). A unit's weights come to the device in a forward
pre-hook of its first module and are dropped in a forward post-hook of its last: the host copy is
the truth, nothing writes the weights. Between uses a parameter's ``.data`` is an empty
placeholder, so a unit that ran without its hook fails at its first weight instead of computing
with stale memory.

On CUDA the host copies are pinned and a side stream copies: the pre-hook of unit i makes the
compute stream wait for i's copy and starts the copy of unit i + 1 (the next unit of the same
chunk), which then overlaps i's kernels; at most two units are on the device at a time. A
micro-batch's first unit has no predecessor to overlap with; each micro-batch streams the whole
chunk again (Megatron runs one micro-batch through every unit before the next). The device
copies are allocated on the compute stream and the side stream waits for the compute stream
before writing into them, so a block the compute stream freed is rewritten only after its last
reader; the compute stream waits for the copy before any kernel reads it, so a copy freed there
needs no ``record_stream``. On CPU the "copy" is the host tensor itself: the hooks swap it in and
out, which is what the tests observe.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow.training.host_memory import locked_copies


@dataclass(eq=False)
class Unit:
    """Parameters that run together: fetched before ``first`` runs, dropped after ``last`` ran."""

    params: list[torch.nn.Parameter]
    first: torch.nn.Module
    last: torch.nn.Module
    host: list[torch.Tensor] = field(default_factory=list)
    """The weights, in host memory (pinned on CUDA)."""
    next: "Unit | None" = None
    """The unit after it in its chunk's forward: prefetched while it runs."""
    device: list[torch.Tensor] | None = None
    """Its device copies while fetched."""
    ready: torch.cuda.Event | None = None
    """Recorded on the copy stream after its copies (CUDA)."""


def chunk_units(chunk) -> list[Unit]:
    """The units of GPTModel ``chunk`` (module docstring) in the order its forward runs them."""
    units = []
    if chunk.pre_process:
        units.append(Unit(list(chunk.embedding.parameters()), chunk.embedding, chunk.embedding))
    for layer in chunk.decoder.layers:
        units.append(Unit(list(layer.parameters()), layer, layer))
    if chunk.post_process:
        modules = [m for m in (chunk.decoder.final_layernorm, chunk.output_layer) if m is not None]
        params = [p for m in modules for p in m.parameters()]
        if chunk.share_embeddings_and_output_weights:  # the output layer reads the table
            shared = chunk.shared_embedding_or_output_weight()
            params += [shared] if all(p is not shared for p in params) else []
        units.append(Unit(params, modules[0], modules[-1]))
    for unit, after in zip(units, units[1:]):
        unit.next = after
    return units


class StreamedWeights:
    """The weights of ``chunks`` (GPTModels, unwrapped) in host memory, streamed unit by unit in
    their forwards (module docstring). Every parameter must belong to a unit."""

    def __init__(self, chunks, device: torch.device):
        self.device = device
        self.units = [unit for chunk in chunks for unit in chunk_units(chunk)]
        owned = {id(p) for unit in self.units for p in unit.params}
        stray = [n for chunk in chunks for n, p in chunk.named_parameters() if id(p) not in owned]
        if stray:
            raise ValueError(f"parameters outside every streamed unit: {stray}")
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        homes = self._homes(list({id(p): p for u in self.units for p in u.params}.values()))
        for unit in self.units:
            unit.host = [homes[id(p)] for p in unit.params]  # a tied table has one home
        for unit in self.units:
            self._drop(unit)
            unit.first.register_forward_pre_hook(lambda *_, unit=unit: self._before(unit))
            unit.last.register_forward_hook(lambda *_, unit=unit: self._drop(unit))

    def _homes(self, params: list[torch.nn.Parameter]) -> dict[int, torch.Tensor]:
        """Each parameter's host copy: on CUDA in page-locked memory (``locked_copies``), on
        CPU the tensor itself."""
        if self.copy_stream is None:
            return {id(p): p.data for p in params}
        copies = locked_copies([p.data for p in params], self)
        torch.cuda.current_stream(self.device).synchronize()  # complete before any use
        return {id(p): c for p, c in zip(params, copies)}

    def _before(self, unit: Unit) -> None:
        if unit.device is None:
            self._fetch(unit)
        if unit.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(unit.ready)
        for p, t in zip(unit.params, unit.device):
            p.data = t
        if unit.next is not None and unit.next.device is None:
            self._fetch(unit.next)

    def _fetch(self, unit: Unit) -> None:
        """Start copying ``unit``'s weights to the device (module docstring)."""
        if self.copy_stream is None:
            unit.device = unit.host
            return
        compute = torch.cuda.current_stream(self.device)
        unit.device = [torch.empty_like(h, device=self.device) for h in unit.host]
        self.copy_stream.wait_stream(compute)
        with torch.cuda.stream(self.copy_stream):
            for t, h in zip(unit.device, unit.host):
                t.copy_(h, non_blocking=True)
            unit.ready = self.copy_stream.record_event()

    def _drop(self, unit: Unit) -> None:
        for p in unit.params:
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        unit.device = unit.ready = None

    def release(self) -> None:
        """Drop every unit still on the device (a pass that stopped part-way)."""
        for unit in self.units:
            if unit.device is not None:
                self._drop(unit)

    def fetched(self) -> int:
        """Parameters whose weights are on the device now (between passes: 0)."""
        return sum(p.numel() > 0 for unit in self.units for p in unit.params)

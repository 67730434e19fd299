"""The data passed between the controller and the workers: per-sample tensors, per-sample Python
values, and batch-level metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Batch:
    """B samples. ``tensors`` and ``lists`` are indexed by sample (leading dim / list index B);
    ``meta`` is shared by the whole batch and copied into every split."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    lists: dict[str, list] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.lists.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the number of samples: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.lists.values():
            return len(v)
        return 0

    def __getitem__(self, key: str):
        return self.tensors[key] if key in self.tensors else self.lists[key]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.lists

    def index(self, idx: slice | list[int] | torch.Tensor) -> Batch:
        """The samples at ``idx`` (a slice or a list of sample indices)."""
        if isinstance(idx, slice):
            return Batch({k: v[idx] for k, v in self.tensors.items()},
                         {k: v[idx] for k, v in self.lists.items()}, dict(self.meta))
        idx = [int(i) for i in idx]
        return Batch({k: v[idx] for k, v in self.tensors.items()},
                     {k: [v[i] for i in idx] for k, v in self.lists.items()}, dict(self.meta))

    def split(self, parts: int) -> list[Batch]:
        """``parts`` equal consecutive pieces (the controller's dispatch by data-parallel rank)."""
        n = len(self)
        if n % parts:
            raise ValueError(f"cannot split {n} samples into {parts} equal parts; make the batch "
                             f"size a multiple of {parts}")
        k = n // parts
        return [self.index(slice(i * k, (i + 1) * k)) for i in range(parts)]

    @staticmethod
    def concat(batches: list[Batch]) -> Batch:
        """Samples of all ``batches`` in order; meta from the first."""
        first = batches[0]
        return Batch({k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
                     {k: [x for b in batches for x in b.lists[k]] for k in first.lists},
                     dict(first.meta))

    def update(self, other: Batch) -> Batch:
        """This batch with ``other``'s fields added (same samples)."""
        if len(other) and len(self) and len(other) != len(self):
            raise ValueError(f"cannot merge a batch of {len(other)} into one of {len(self)}")
        return Batch({**self.tensors, **other.tensors}, {**self.lists, **other.lists},
                     {**self.meta, **other.meta})

"""The paged KV pool: preallocated K and V tensors for every layer, addressed by flat slot ids.

Slot layout (shared by every layer and every layer group):

    slot = page * page_size + offset        0 <= offset < page_size
    k[l][slot] -> [num_kv_heads_l, head_dim_l]

Model code only sees these tensors and slot ids; which pages a sequence owns is decided by the
bookkeeping in `allocator.py` / `prefix.py` / `manager.py`. Several layer groups (the target's
layers, then e.g. a drafter's context K/V layers added with `add_layers`) share one page geometry,
so a page id means the same token positions in every group and `copy_page` copies all of them.
"""

from __future__ import annotations

from typing import Sequence

import torch


class KVPool:
    """`num_pages * page_size` slots of K and V per layer; per-layer head count and head_dim."""

    def __init__(
        self,
        page_size: int,
        num_pages: int,
        layer_shapes: Sequence[tuple[int, int]],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if page_size < 1 or num_pages < 1:
            raise ValueError("page_size and num_pages must be >= 1")
        self.page_size = page_size
        self.num_pages = num_pages
        self.dtype = dtype
        self.device = torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.add_layers(layer_shapes)

    @property
    def num_slots(self) -> int:
        return self.page_size * self.num_pages

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def add_layers(self, layer_shapes: Sequence[tuple[int, int]]) -> range:
        """Append layers of (num_kv_heads, head_dim) with this pool's page geometry; returns
        their indices into `k` / `v`."""
        first = len(self.k)
        for heads, head_dim in layer_shapes:
            if heads < 1 or head_dim < 1:
                raise ValueError(f"invalid layer shape ({heads}, {head_dim})")
            shape = (self.num_slots, heads, head_dim)
            self.k.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            self.v.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
        return range(first, len(self.k))

    def copy_page(self, src: int, dst: int, num_slots: int) -> None:
        """Copy slots [0, num_slots) of page `src` into page `dst`, K and V, in every layer."""
        if not (0 <= src < self.num_pages and 0 <= dst < self.num_pages):
            raise ValueError(f"page id out of range: {src} -> {dst}")
        if not 0 <= num_slots <= self.page_size:
            raise ValueError(f"num_slots {num_slots} outside [0, {self.page_size}]")
        s, d = src * self.page_size, dst * self.page_size
        for cache in (*self.k, *self.v):
            cache[d : d + num_slots] = cache[s : s + num_slots]

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

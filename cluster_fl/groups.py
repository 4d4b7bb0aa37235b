"""Trainable groups: the unit that clipping policies allocate budget to.

A group is one trainable tensor (a LoRA A or B matrix, a connector weight or bias) with the model
component it belongs to. Models list their groups in a stable order; privacy code sees only these
descriptions and tensors keyed by group name, never the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping


@dataclass(frozen=True)
class GroupSpec:
    """One trainable group: ``name`` (stable key), ``component`` and parameter count ``numel``."""

    name: str
    component: str
    numel: int
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.numel < 1:
            raise ValueError(f"group {self.name!r}: numel must be >= 1, got {self.numel}")


def groups_from_layout(layout: Iterable[Mapping[str, Any]]) -> list[GroupSpec]:
    """Groups from a config layout ``[{name, component, numel}, ...]`` (order kept)."""
    return [GroupSpec(str(g["name"]), str(g["component"]), int(g["numel"]),
                      tuple(g.get("shape", ()))) for g in layout]

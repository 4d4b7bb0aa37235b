"""Trainable groups, and the clipping units that policies allocate budget to.

A group is one trainable tensor (a LoRA A or B matrix, a connector weight or bias) with the model
component it belongs to. Models list their groups in a stable order; privacy code sees only these
descriptions and tensors keyed by group name, never the model.

A clipping unit is what one per-layer threshold covers (``privacy.grouping``): one group
(``matrix``, the default) or every group of one transformer layer of one component (``layer``,
the paper's per-layer clipping). Units are derived from group names and components alone, so
anything holding the group list (a run folder's ``groups.json``, the audit) rebuilds them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence


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


# ---- clipping units ------------------------------------------------------------------------------
# The transformer layer of a group: the ``layers.<i>`` segment of its name, as models/lora.py
# names LoRA groups (``encoder.layers.3.self_attn.q_proj.lora_A``, ``decoder.model.layers.3...``).
_LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")


@dataclass(frozen=True)
class ClipUnit:
    """What one clipping threshold covers: ``members`` (group names, in group order) of one
    ``component``, with their total parameter count ``numel``. Under ``matrix`` grouping a unit
    is one group (same name); under ``layer`` grouping it is one transformer layer."""

    name: str
    component: str
    numel: int
    members: tuple[str, ...]


def layer_of(group: GroupSpec) -> str:
    """The layer a group belongs to: the name up to ``layers.<i>``, or, for a group without a
    layer index (the connector's weight and bias), its component: the connector is one layer."""
    m = _LAYER.match(group.name)
    return m.group(1) if m else group.component


def clipping_units(groups: Sequence[GroupSpec], grouping: str = "matrix") -> list[ClipUnit]:
    """The clipping units over ``groups`` for ``privacy.grouping``, in order of first member.

    * ``matrix``: one unit per group (each LoRA A / B matrix, each connector weight / bias).
    * ``layer``: one unit per (component, :func:`layer_of`): all LoRA matrices of one encoder or
      decoder layer together, and all of a component's groups without a layer index (the
      connector) together -- the paper's per-layer clipping.
    """
    if grouping == "matrix":
        return [ClipUnit(g.name, g.component, g.numel, (g.name,)) for g in groups]
    if grouping != "layer":
        raise ValueError(f"unknown grouping {grouping!r}; allowed: matrix, layer")
    members: dict[tuple[str, str], list[GroupSpec]] = {}
    for g in groups:
        members.setdefault((g.component, layer_of(g)), []).append(g)
    names = [layer for _, layer in members]
    return [ClipUnit(layer if names.count(layer) == 1 else f"{component}:{layer}", component,
                     sum(g.numel for g in gs), tuple(g.name for g in gs))
            for (component, layer), gs in members.items()]

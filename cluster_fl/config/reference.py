"""The config reference (``docs/config.md``), generated from the schema so it cannot drift.

Every key of :mod:`cluster_fl.config.schema` with its type, default and the docstring written
under it; tests/config/test_reference.py fails when ``docs/config.md`` differs from what this
module prints. Regenerate it with::

    python -m cluster_fl.config.reference > docs/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
from typing import Any

from cluster_fl.config import schema

HEADER = """\
# Config reference

Generated from `cluster_fl/config/schema.py` by `python -m cluster_fl.config.reference >
docs/config.md`; a test fails when this file and the schema differ. Set a key in a YAML preset
(`configs/`; `base: other.yaml` inherits one) or on the command line as `section.key=value`
(`fl.rounds=12`, `data.languages=[en,de]`); `cluster-fl dump-config CONFIG [key=value ...]`
prints the resolved config. An unknown key or a value out of range is an error that names the
key and what is allowed.
"""


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass whose fields are followed by a string literal."""
    body = _body(cls)
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def _body(cls: type) -> list[ast.stmt]:
    """The statements of ``cls``'s body, from its source."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef)
    return node.body


def _default(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    return "`" + json.dumps(value, default=str) + "`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def sections() -> list[tuple[str, type]]:
    """``(section, its dataclass)`` in the order of :class:`~cluster_fl.config.schema.Config`."""
    hints = {f.name: f for f in dataclasses.fields(schema.Config)}
    return [(name, type(f.default_factory())) for name, f in hints.items()  # type: ignore[misc]
            if f.default_factory is not dataclasses.MISSING]


def config_reference() -> str:
    """The text of ``docs/config.md``."""
    out = [HEADER]
    for name, cls in sections():
        docs = field_docs(cls)
        out += [f"## `{name}`", "", _cell(inspect.cleandoc(cls.__doc__ or "")), "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        annotations = {n.target.id: ast.unparse(n.annotation) for n in _body(cls)
                       if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        instance = cls()
        for f in dataclasses.fields(cls):
            out.append(f"| `{name}.{f.name}` | `{annotations.get(f.name, '')}` | "
                       f"{_default(getattr(instance, f.name))} | {_cell(docs.get(f.name, ''))} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(config_reference(), end="")

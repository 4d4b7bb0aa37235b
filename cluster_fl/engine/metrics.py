"""Per-round metric rows and the Parquet files of a run folder.

``rounds.parquet`` is rewritten atomically after every round (it is small), so a crash never
loses a finished round; on resume the rows after the checkpointed round are dropped.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from cluster_fl.engine.rundir import atomic_write_bytes


def write_rows(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Write dict rows as one Parquet table (columns = union of keys, missing → null)."""
    rows = [dict(r) for r in rows]
    columns: list[str] = []
    for r in rows:
        for k in r:
            if k not in columns:
                columns.append(k)
    table = pa.table({c: [_clean(r.get(c)) for r in rows] for c in columns}) if rows else pa.table({})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    atomic_write_bytes(Path(path), buf.getvalue())


def _clean(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a Parquet file written by :func:`write_rows` (empty when missing)."""
    path = Path(path)
    if not path.is_file():
        return []
    return pq.read_table(path).to_pylist()

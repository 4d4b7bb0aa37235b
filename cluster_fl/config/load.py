"""Reading configs: YAML presets with ``base:`` inheritance, ``key=value`` overrides, the seed
rule of secure mode, validation into a :class:`~cluster_fl.config.Config`, and the way back
(``to_dict``, ``dump_config``, ``override``).

The schema -- every section, key, default and check -- lives in :mod:`cluster_fl.config.schema`;
:mod:`cluster_fl.config` re-exports both, so ``from cluster_fl.config import load_config`` is the
API.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from cluster_fl.config.checks import ConfigError
from cluster_fl.config.schema import SECTIONS, Config


def valid_keys() -> list[str]:
    """Every ``section.field`` key a config accepts."""
    return [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in fields(cls)]


def _unknown(key: str) -> ConfigError:
    near = difflib.get_close_matches(key, valid_keys(), n=3, cutoff=0.5)
    if not near:  # fall back to matching the field name alone
        tail = key.rsplit(".", 1)[-1]
        near = [k for k in valid_keys()
                if difflib.SequenceMatcher(None, tail, k.rsplit(".", 1)[-1]).ratio() > 0.7][:3]
    hint = f"; did you mean {', '.join(near)}?" if near else ""
    return ConfigError(key, f"unknown key{hint}")


def _deep_update(base: dict, new: Mapping) -> dict:
    for k, v in new.items():
        if isinstance(v, Mapping) and isinstance(base.get(k), dict) and k in SECTIONS:
            base[k] = _deep_update(dict(base[k]), v)
        else:
            base[k] = v
    return base


class _Loader(yaml.SafeLoader):
    """YAML 1.1 as ``safe_load`` reads it, except that ``1e-3``, ``1e-5`` and ``5E-4`` are
    floats (YAML 1.1 wants a dot in the mantissa and reads them as strings)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


# Bounds on what a config may hold: a config is a few hundred short values, so
# anything far past these is a mistake or an attack -- an alias bomb (9 aliases of 9 aliases ...
# expand to 9^9 items when the config is copied), brackets nested 100,000 deep (the parser's
# recursion), a value of megabytes, a folder name longer than the file system allows.
MAX_CONFIG_BYTES = 1 << 20
MAX_ITEMS = 100_000  # values and containers, counting each alias's expansion
MAX_DEPTH = 32
MAX_VALUE_CHARS = 4096


def yaml_load(text: str, where: str = "CONFIG") -> Any:
    """Parse YAML text as configs are read: ``safe_load`` plus numbers written ``1e-3``, within
    the bounds above (a :class:`ConfigError` naming ``where`` past them)."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(where, f"{len(text):,} characters; a config holds at most "
                          f"{MAX_CONFIG_BYTES:,}")
    try:
        tree = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise ConfigError(where, f"nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ConfigError(where, f"a value cannot be read ({type(exc).__name__}: "
                          f"{str(exc)[:120]})") from None
    check_bounded(tree, where)
    return tree


def check_bounded(tree: Any, where: str = "CONFIG") -> None:
    """Refuse a parsed config past :data:`MAX_ITEMS` (aliases counted as often as they are
    used), :data:`MAX_DEPTH` or :data:`MAX_VALUE_CHARS` per value, without expanding it."""
    items, stack = 0, [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        items += 1
        if items > MAX_ITEMS:
            raise ConfigError(where, f"more than {MAX_ITEMS:,} values (YAML aliases expand "
                              "where they are used)")
        if depth > MAX_DEPTH:
            raise ConfigError(where, f"nested too deeply (at most {MAX_DEPTH} levels)")
        if isinstance(node, (str, bytes)) and len(node) > MAX_VALUE_CHARS:
            raise ConfigError(where, f"a value of {len(node):,} characters; at most "
                              f"{MAX_VALUE_CHARS:,}")
        if isinstance(node, Mapping):
            stack.extend((v, depth + 1) for kv in node.items() for v in kv)
        elif isinstance(node, (list, tuple, set)):
            stack.extend((v, depth + 1) for v in node)


def _load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    longest = max((len(p.encode()) for p in str(path).split("/")), default=0)
    if len(str(path).encode()) > 4096 or longest > 255:  # the OS's PATH_MAX / NAME_MAX
        raise ConfigError("base" if seen else "CONFIG", f"a path of {len(str(path)):,} "
                          "characters; too long for the file system")
    path = path.expanduser().resolve()
    if path in seen:
        raise ConfigError("base", f"circular inheritance through {path}")
    if not path.is_file():
        raise ConfigError("base" if seen else "CONFIG", f"file not found: {path}")
    try:
        raw = yaml_load(path.read_text(), where=str(path)) or {}
    except yaml.YAMLError as exc:
        raise ConfigError("CONFIG", f"{path} is not valid YAML ({exc.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise ConfigError("CONFIG", f"{path} must hold a mapping of sections")
    bases = raw.pop("base", None)
    merged: dict = {}
    for b in [bases] if isinstance(bases, str) else (bases or []):
        merged = _deep_update(merged, _load_yaml(path.parent / b, seen + (path,)))
    return _deep_update(merged, raw)


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``section.key=value``; the value is parsed as YAML (``1e-3``, ``[en, de]``, ``null``),
    numbers as users write them (``1e-3`` and ``5E-4`` are floats)."""
    if "=" not in text:
        raise ConfigError(text, "overrides are written key=value, e.g. privacy.alpha=0.1")
    key, value = text.split("=", 1)
    key = key.strip()
    try:
        parsed = yaml_load(value, where=key[:100]) if value != "" else ""
    except yaml.YAMLError:
        parsed = value
        check_bounded(parsed, key[:100])
    return key, parsed


def _seed_rule(tree: Mapping[str, Any]) -> dict:
    """Secure mode refuses a seed: ``run.seed`` given (preset, override, or a config it was
    derived from) is an error, and it resolves to null. Research mode needs one."""
    tree = dict(tree)
    privacy, run = tree.get("privacy"), tree.get("run")
    secure = isinstance(privacy, Mapping) and privacy.get("secure_mode") is True
    if run is not None and not isinstance(run, Mapping):
        return tree  # build_config names the malformed section
    run = dict(run) if run is not None else None
    if secure:
        if run is not None and run.get("seed") is not None:
            raise ConfigError("run.seed", f"got {run['seed']!r}; privacy.secure_mode draws its "
                              "randomness from the OS and refuses a seed: remove run.seed "
                              "(or set run.seed=null)")
        tree["run"] = {**(run or {}), "seed": None}
    elif run is not None and "seed" in run and run["seed"] is None:
        raise ConfigError("run.seed", "got null; only privacy.secure_mode runs without a seed")
    return tree


def build_config(tree: Mapping[str, Any]) -> Config:
    """Validate a nested mapping ``{section: {field: value}}`` into a :class:`Config`."""
    sections = {}
    for name, values in _seed_rule(tree).items():
        if name not in SECTIONS:
            raise _unknown(str(name))
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise ConfigError(name, "must be a mapping of keys")
        cls = SECTIONS[name]
        allowed = {f.name for f in fields(cls)}
        for k in values:
            if k not in allowed:
                raise _unknown(f"{name}.{k}")
        kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in values.items()}
        try:
            sections[name] = cls(**kwargs)
        except TypeError as exc:  # should not happen after the key check; keep it readable
            raise ConfigError(name, str(exc)) from None
    return Config(**sections)


def load_config(path: str | Path | None, overrides: Iterable[str] = ()) -> Config:
    """Load a YAML preset (or the defaults when ``path`` is None) and apply ``key=value`` overrides."""
    tree = _load_yaml(Path(path)) if path is not None else {}
    for text in overrides:
        key, value = parse_override(text)
        parts = key.split(".")
        if len(parts) != 2 or parts[0] not in SECTIONS:
            raise _unknown(key)
        tree.setdefault(parts[0], {})
        if tree[parts[0]] is None:
            tree[parts[0]] = {}
        tree[parts[0]] = dict(tree[parts[0]])
        tree[parts[0]][parts[1]] = value
    return build_config(tree)


def to_dict(cfg: Config) -> dict:
    """Plain nested dict of a config (tuples as lists), suitable for YAML/JSON."""
    def plain(x: Any) -> Any:
        if isinstance(x, (tuple, list)):
            return [plain(v) for v in x]
        if isinstance(x, Mapping):
            return {k: plain(v) for k, v in x.items()}
        return x
    return {name: plain(dataclasses.asdict(getattr(cfg, name))) for name in SECTIONS}


def dump_config(cfg: Config) -> str:
    """The resolved config as YAML (what ``dump-config`` prints and every run stores)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True)


def override(cfg: Config, changes: Mapping[str, Any]) -> Config:
    """Copy of ``cfg`` with dotted-key changes, e.g. ``override(cfg, {"fl.rounds": 2})``
    (validated as a loaded config is; not :func:`dataclasses.replace`)."""
    tree = to_dict(cfg)
    for key, value in changes.items():
        parts = key.split(".")
        if len(parts) != 2 or parts[0] not in SECTIONS:
            raise _unknown(key)
        tree[parts[0]][parts[1]] = value
    return build_config(tree)


def require_resolved(cfg: Config, where: str) -> None:
    """Refuse a config that did not pass the entrance of its run: what the model fixes
    (``data.n_mels``) is filled there, once, by ``models.registry.resolve_shapes`` -- the command
    layer (``commands.load_checked``), a grid's expansion, or ``engine.train.run_training``. Code
    below takes the resolved config it is handed and never resolves again; a 0 here is a caller
    that skipped the entrance (a bug, not a user's mistake)."""
    if cfg.data.n_mels <= 0:
        raise ValueError(f"{where} needs the config resolved at its run's entrance "
                         "(models.registry.resolve_shapes); data.n_mels is still 0")

"""Loading a config: a dataclass (each component owns its part), a YAML file, key=value overrides.

Every way a config can be wrong ends in ``ConfigError(field, message)`` naming the full dotted key:
an unknown key, a value of the wrong type or out of range, a YAML file that does not parse, a check
in some dataclass's ``__post_init__`` (which names its fields relative to itself; ``build_config``
adds the path it was built at).

Composition: a YAML file may start with ``defaults: [base.yaml, ../other.yaml]``, files relative
to the one that names them. They are merged in order (each may have defaults of its own), then the
file's own keys, then the command line's overrides: a later value replaces an earlier one, a
mapping is merged key by key, a list is replaced whole. ``defaults`` is the loader's, not a key of
the run: the resolved config (``to_yaml``, runs/<name>/config.yaml) has none.

An override ``~key`` deletes a key (Hydra's spelling): a key of the schema takes its default again,
an entry of a mapping (``~data.task_kwargs.chain_sum``) is removed. An override that switches what
the file configured drops the file's keys it leaves unread, with a printed note (the config class's
``left_unread``: ``data.source=my.jsonl`` drops the file's reasoning-gym ``data.tasks``).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Mapping, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybridflow.errors import ConfigError

T = TypeVar("T")

# The command line's names for what is not a key of the schema.
CONFIG_FILE, OVERRIDES = "CONFIG", "overrides"
DEFAULTS = "defaults"
"""The key of a YAML file that lists the files it is composed on."""


def load_config(cls: type[T], path: str | os.PathLike | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Build ``cls`` from its defaults, then the YAML file at ``path`` (composed on the files its
    ``defaults`` lists), then ``overrides`` (``["actor.engine.optim.lr=1e-4", ...]``), and run
    every check."""
    merged = _structured(cls)
    auto: list[str] = []
    if path is not None:
        data = OmegaConf.to_container(load_composed(path))
        # "auto" is no value of these int fields: taken out before the schema
        auto = _take_auto(data, getattr(cls, "AUTO_KEYS", ()))
        _expand_shorthands(cls, data)
        _drop_left_unread(cls, data, overrides, path)
        merged = _merge(merged, _create(data))
    overrides, auto = _auto_overrides(cls, overrides, auto)
    overrides = [_shorthand_override(cls, item) for item in overrides]
    data = _apply_overrides(cls, merged, overrides)
    if auto:
        data[AUTO] = sorted(set(data.get(AUTO) or []) | set(auto))
    return build_config(cls, data)


AUTO = "auto"
"""The field of a config class with ``AUTO_KEYS`` that lists the keys a file or an override set
to ``auto`` (the planner chooses them at start-up)."""


def _take_auto(data: dict, keys: tuple[str, ...]) -> list[str]:
    """Remove every ``key: auto`` of ``keys`` from the nested mapping ``data``; returns them."""
    found = []
    for key in keys:
        *parents, last = key.split(".")
        where = data
        for part in parents:
            where = where.get(part) if isinstance(where, dict) else None
        if isinstance(where, dict) and where.get(last) == AUTO:
            del where[last]
            found.append(key)
    return found


def _expand_shorthands(cls: type, data: dict) -> None:
    """``section: NAME`` for a section of ``cls.SHORTHANDS`` (section -> field) becomes
    ``section: {field: NAME}`` (``placement: auto``)."""
    for section, name in getattr(cls, "SHORTHANDS", {}).items():
        if isinstance(data.get(section), str):
            data[section] = {name: data[section]}


def _shorthand_override(cls: type, item):
    """``section=NAME`` of a section of ``cls.SHORTHANDS`` as ``section.field=NAME``."""
    key, sep, value = item.partition("=") if isinstance(item, str) else ("", "", "")
    name = getattr(cls, "SHORTHANDS", {}).get(key.strip())
    if not sep or name is None or value.strip().startswith("{"):
        return item
    return f"{key.strip()}.{name}={value}"


def _drop_left_unread(cls: type, data: dict, overrides, path) -> None:
    """Delete from the config file's ``data`` the keys an override leaves unread
    (``cls.left_unread``: ``data.source=my.jsonl`` leaves the file's reasoning-gym tasks
    unread), printing a note naming them: an override switches what the file configured."""
    left_unread = getattr(cls, "left_unread", None)
    for item in overrides if left_unread is not None else ():
        key, sep, _ = item.partition("=") if isinstance(item, str) else ("", "", "")
        key = key.strip()
        if not sep or not key or key.startswith(DELETE):
            continue
        try:
            value = OmegaConf.select(OmegaConf.from_dotlist([item]), key)
        except Exception:  # noqa: BLE001 - a broken value is reported with the overrides
            continue
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        dropped = left_unread(data, key, value)
        for dotted in dropped:
            *parents, last = dotted.split(".")
            where = data
            for part in parents:
                where = where[part]
            del where[last]
        if dropped:
            print(f"note: {item}: dropped {', '.join(dropped)} of {os.fspath(path)}, which it "
                  "leaves unread", flush=True)


def _auto_overrides(cls: type, overrides, auto: list[str]) -> tuple[list[str], list[str]]:
    """(the overrides without ``key=auto`` of ``cls.AUTO_KEYS``, ``auto`` with those keys added
    and the keys an override sets to a value or deletes removed)."""
    keys, rest, auto = getattr(cls, "AUTO_KEYS", ()), [], list(auto)
    for item in overrides:
        key, _, value = item.partition("=") if isinstance(item, str) else ("", "", "")
        key = key.strip()
        if key in keys and value.strip() == AUTO:
            auto.append(key)
            continue
        if key.removeprefix(DELETE).strip() in auto:
            auto.remove(key.removeprefix(DELETE).strip())
        rest.append(item)
    return rest, auto


def make_config(cls: type[T], config: Any = None, values: Mapping[str, Any] | None = None) -> T:
    """``cls`` from ``config`` (an instance of ``cls``, a mapping of its keys, or None for the
    defaults) with ``values`` set (dotted keys to Python values:
    ``{"actor.engine.optim.lr": 1e-5}``), every check run: the Python API's ``load_config``."""
    if config is not None and not isinstance(config, (cls, Mapping)):
        raise ConfigError("config", f"must be a {cls.__name__}, a dict of its keys or None, got "
                                    f"{type(config).__name__}")
    node = _structured(config if isinstance(config, cls) else cls)
    if isinstance(config, Mapping):
        node = _merge(node, _create(dict(config)))
    nested: dict[str, Any] = {}
    for key, value in (values or {}).items():
        *parents, last = key.split(".")
        where = nested
        for part in parents:
            where = where.setdefault(part, {})
        where[last] = value
    if nested:
        node = _merge(node, _create(nested))
    return build_config(cls, OmegaConf.to_container(node, resolve=True))


DELETE = "~"
"""``~key`` on the command line deletes a key (Hydra's spelling): see ``_delete``."""


def _apply_overrides(cls: type, node, overrides: list[str] | tuple[str, ...]) -> dict:
    """The structured OmegaConf ``node`` of ``cls`` with ``key=value`` and ``~key`` overrides
    applied, as a plain dict; keys and types are checked against the schema."""
    for item in overrides:
        if isinstance(item, str) and item.strip().startswith(DELETE):
            node = _delete(cls, node, item.strip())
            continue
        if not isinstance(item, str) or "=" not in item:
            raise ConfigError(OVERRIDES, f"{item!r}: an override must look like key=value, e.g. "
                                         "steps=10")
        key = item.split("=", 1)[0].strip()
        if not key:
            raise ConfigError(OVERRIDES, f"{item!r}: the key before '=' is empty")
        try:
            parsed = OmegaConf.from_dotlist([item])
        except Exception as e:  # the value is YAML: a broken one fails to parse
            raise ConfigError(key, f"cannot parse {item!r}: {str(e).splitlines()[0]}") from None
        node = _merge(node, parsed)
    return OmegaConf.to_container(node, resolve=True)


def _delete(cls: type, node, item: str):
    """``node`` with the override ``item`` (``~key``) applied: a key of the schema takes its
    default again, an entry of a mapping-valued key (``~data.task_kwargs.chain_sum``) is
    removed where it is set."""
    key = item.removeprefix(DELETE).strip()
    if not key or "=" in key:
        name = key.partition("=")[0].strip() or "KEY"
        raise ConfigError(OVERRIDES, f"{item!r}: ~ deletes a key and takes no value; write "
                                     f"~{name}")
    parent_key, _, last = key.rpartition(".")
    try:
        parent = OmegaConf.select(node, parent_key) if parent_key else node
    except OmegaConfBaseException:  # no dotted key: "~data..x"
        parent = None
    in_schema = isinstance(parent, DictConfig) and \
        dataclasses.is_dataclass(OmegaConf.get_type(parent))
    if not isinstance(parent, DictConfig) or (in_schema and last not in parent):
        raise ConfigError(key, unknown_key(key))
    try:
        if in_schema:
            parent[last] = OmegaConf.select(_structured(cls), key)
        elif last in parent:  # an entry not there (or dropped already) is what ~ asks for
            del parent[last]
    except OmegaConfBaseException as e:
        raise _from_omegaconf(e) from None
    return node


def build_config(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """``cls`` from a plain mapping, nested dataclasses built first; a ``ConfigError`` from any
    level names the full dotted key (``path`` prefixes this level's fields)."""
    if not isinstance(data, Mapping):
        raise ConfigError(path or CONFIG_FILE, f"must be a mapping of keys to values, got "
                                               f"{type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise ConfigError(where, unknown_key(where, cls.__name__))
    kwargs = {}
    for name, value in data.items():
        sub = _dataclass_in(hints[name])
        key = f"{path}.{name}" if path else name
        if sub is not None and isinstance(value, Mapping):
            value = build_config(sub, value, key)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.under(path) from None


def to_yaml(config: Any) -> str:
    """The resolved config as YAML (what runs/<name>/config.yaml holds)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


# ------------------------------------------------------------------------------------------------
def _dataclass_in(hint: Any) -> type | None:
    """The dataclass type of a field annotated ``X`` or ``X | None``, else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def _structured(obj: Any):
    try:
        return OmegaConf.structured(obj)
    except OmegaConfBaseException as e:
        raise _from_omegaconf(e) from None


def _create(data: dict):
    try:
        return OmegaConf.create(data)
    except OmegaConfBaseException as e:
        raise _from_omegaconf(e) from None


def _merge(base, other):
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as e:
        found = _section_mismatch(base, other)
        if found is not None:  # OmegaConf's message names no key here
            key, section, value = found
            raise ConfigError(key, f"is a section of {OmegaConf.get_type(section).__name__} "
                                   f"settings (key: value lines under it), got "
                                   f"{type(value).__name__} {value!r}") from None
        raise _from_omegaconf(e) from None


def _section_mismatch(base, other, prefix: str = ""):
    """(dotted key, base section, given value) where ``other`` puts a value that is not a
    mapping in place of one of ``base``'s sections, or None."""
    if not isinstance(base, DictConfig) or not isinstance(other, DictConfig):
        return None
    for key in other.keys():
        if key not in base:
            continue
        section, given = base._get_node(key), other._get_node(key)
        if not isinstance(section, DictConfig):
            continue
        if not isinstance(given, DictConfig):
            value = OmegaConf.to_container(given) if OmegaConf.is_config(given) else \
                given._value()
            if value is not None:
                return f"{prefix}{key}", section, value
            continue
        found = _section_mismatch(section, given, f"{prefix}{key}.")
        if found is not None:
            return found
    return None


MOVED_KEYS = {
    "ray.colocate": "moved: where models live is placement.preset now (colocate: every model on "
                    "the same devices, as colocate=true was; standalone: a pool each, as "
                    "colocate=false was; split); remove ray.colocate",
}
"""Keys that are gone, with what replaced them."""


def unknown_key(key: str, schema: str = "the config") -> str:
    """The message for ``key``, which ``schema`` does not have: what replaced it (MOVED_KEYS),
    else where every key is listed."""
    return MOVED_KEYS.get(key, f"not a key of {schema}; `hybridflow defaults train` prints every "
                               "key with its default")


def _from_omegaconf(e: Exception) -> ConfigError:
    key = getattr(e, "full_key", None) or CONFIG_FILE
    message = str(e).split("\n")[0]
    if type(e).__name__ == "ConfigKeyError":
        message = unknown_key(key)
    return ConfigError(key, message)


def load_composed(path: str | os.PathLike, _chain: tuple[str, ...] = ()):
    """The YAML file at ``path`` merged onto the files its ``defaults`` lists (recursively, in
    order), as one OmegaConf node without a ``defaults`` key; not yet checked against a schema.
    A missing file, a cycle or a ``defaults`` that is no list of file names is a ConfigError
    naming the file and the fix."""
    real = os.path.realpath(path)
    if real in _chain:
        cycle = " -> ".join(os.path.relpath(p) for p in (*_chain[_chain.index(real):], real))
        raise ConfigError(CONFIG_FILE, f"{path}: the defaults form a cycle ({cycle}); remove one "
                                       "of them")
    node = _load_yaml(path)
    if DEFAULTS not in node:
        return node
    bases = OmegaConf.to_container(node[DEFAULTS]) if OmegaConf.is_config(node[DEFAULTS]) \
        else node[DEFAULTS]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(CONFIG_FILE, f"{path}: defaults must be a list of YAML files relative "
                                       f"to this file, e.g. defaults: [base.yaml]; got {bases!r}")
    merged = OmegaConf.create({})
    here = os.path.dirname(os.fspath(path))
    for base in bases:
        base_path = os.path.join(here, base)
        if not os.path.isfile(base_path):
            raise ConfigError(CONFIG_FILE, f"{path}: defaults names {base}, but {base_path} is "
                                           "not a file; fix the name (paths are relative to "
                                           f"{here or '.'})")
        merged = OmegaConf.merge(merged, load_composed(base_path, (*_chain, real)))
    del node[DEFAULTS]
    return OmegaConf.merge(merged, node)


def _load_yaml(path: str | os.PathLike):
    """The YAML file at ``path`` as an OmegaConf node; any way it cannot be read is a
    ConfigError naming the file, the line and the fix."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(CONFIG_FILE, f"{path}: config file not found")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(CONFIG_FILE, f"{path}: not UTF-8 text (byte {e.start}); save it as "
                                       "UTF-8") from None
    except OSError as e:
        raise ConfigError(CONFIG_FILE, f"{path}: cannot be read ({e.strerror})") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(CONFIG_FILE, f"{path}:{where} {problem}; fix the YAML") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(CONFIG_FILE, f"{path}: the top level must be a mapping of keys to "
                                       f"values, got {type(data).__name__}")
    try:
        return OmegaConf.create(data)
    except Exception as e:
        raise ConfigError(CONFIG_FILE, f"{path}: {str(e).splitlines()[0]}") from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}; give it once", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)

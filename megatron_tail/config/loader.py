"""YAML (+ `--set a.b=v` overrides) → `RunConfig`, with type coercion and typo errors that suggest a key.

    cfg = load_config("examples/demo/demo.yaml", ["algorithm.log_rho=-13", "train.steps=5"])
    save_resolved_config(cfg, cfg.run_dir)          # <run_dir>/config.yaml, every field spelled out

- Unknown keys raise `ConfigError` naming the dotted key and the nearest valid one (difflib).
- Values are coerced to the field's annotated type (a `Literal[...]` field takes one of its choices):
  YAML numbers to float/int, strings such as "1e-4",
  "-inf", "true", "null" from the command line to float / bool / None, lists to tuples. A value that does
  not fit raises `ConfigError` naming the key, the value and the expected type.
- Each section's own validation (ValueError naming the field) runs when the dataclass is built.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megatron_tail.config.schema import RunConfig
from megatron_tail.rollout.settings import MOVED_KEYS as ROLLOUT_MOVED_KEYS
from megatron_tail.utils.errors import UserError
from megatron_tail.utils.paths import tilde_hint, write_text_atomically

RESOLVED_CONFIG_NAME = "config.yaml"
_NULL_WORDS = ("none", "null", "~", "")
_TRUE_WORDS = ("true", "yes", "on", "1")
_FALSE_WORDS = ("false", "no", "off", "0")


class ConfigError(UserError):
    """A config key or value is wrong; the message names the dotted key."""


@dataclasses.dataclass(frozen=True)
class _CliValue:
    """A raw `--set` value: parsed according to the type of the field it lands in."""

    raw: str


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Read the YAML at `path` (None: all defaults), apply `key=value` overrides, build the `RunConfig`."""
    if path is None:
        return config_from_yaml("", overrides)
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{str(path)!r} is a directory; a YAML config file is expected")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist{tilde_hint(path)}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.start}); a YAML config file is expected"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from None
    return config_from_yaml(text, overrides, source=str(path))


def config_from_yaml(text: str, overrides: Iterable[str] = (), *, source: str = "the config") -> RunConfig:
    """`load_config` of YAML `text` already in hand (an embedded base config such as the demo's); errors
    name `source`."""
    try:
        loaded = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: {_yaml_problem(e)}") from None
    except ValueError as e:  # an integer of more digits than Python converts (4300)
        raise ConfigError(f"{source}: {e}") from None
    if loaded is not None and not isinstance(loaded, Mapping):
        raise ConfigError(
            f"{source}: the top level must be a mapping of sections; got {type(loaded).__name__}"
        )
    return config_from_dict(apply_overrides(dict(loaded or {}), overrides))


def apply_overrides(
    data: Mapping[str, Any], overrides: Iterable[str], cls: type = RunConfig
) -> dict[str, Any]:
    """A copy of `data` with each `"a.b.c=value"` set (keys checked against the schema of `cls`)."""
    out = _deep_copy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"override {item!r} must look like section.key=value (e.g. algorithm.log_rho=-13)"
            )
        parts = key.split(".")
        _check_path(cls, parts)
        if not raw.strip():  # an unset shell variable: null would silently switch the feature off
            unset = f", or {key}=null to unset the key" if _accepts_null(cls, parts) else ""
            raise ConfigError(f"override {item!r} has no value; give one{unset}")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):  # the file's bad section: refused, not replaced
                _build(_section_type(cls, parts[: i + 1]), child, ".".join(parts[: i + 1]) + ".")
            node = child
        node[parts[-1]] = _CliValue(raw.strip())
    return out


def config_from_dict(data: Mapping[str, Any], cls: type = RunConfig) -> Any:
    """Build `cls` (a dataclass) from nested mappings; see the module docstring for coercion and errors."""
    return _build(cls, data, prefix="")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict (tuples as lists) of a config dataclass, every field included."""
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def config_yaml(cfg: RunConfig) -> str:
    """`cfg` as YAML, every key spelled out: what `--print-config` prints and `<run_dir>/config.yaml`, the
    config history and checkpoints hold; loading it gives back an equal config. A string that YAML 1.1 or
    1.2 would read as something else (`1e-6`, `010`, `1:30`, `yes`) is quoted (`_QuotingDumper`)."""
    return yaml.dump(config_to_dict(cfg), Dumper=_QuotingDumper, sort_keys=False, allow_unicode=True)


def save_resolved_config(cfg: RunConfig, run_dir: str | Path) -> Path:
    """Write the fully resolved config to `<run_dir>/config.yaml`; loading it gives back an equal config."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_text_atomically(run_dir / RESOLVED_CONFIG_NAME, config_yaml(cfg))


def all_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema, e.g. "algorithm.log_rho"."""
    keys = []
    for name, tp in _hints(cls).items():
        dotted = f"{prefix}{name}"
        inner = _dataclass_in(tp)
        keys.extend(all_keys(inner, dotted + ".") if inner else [dotted])
    return keys


# --- building -----------------------------------------------------------------------------------------


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    # from a file (`--set` refuses it in `_check_path`, before a value reaches here)
    if where in MOVED_KEYS and not isinstance(data, Mapping | None | _CliValue):
        raise ConfigError(f"config key {where!r} is a section now: set {MOVED_KEYS[where]}: {data!r}")
    if isinstance(data, _CliValue):
        raise ConfigError(f"{where} is a section; set its keys ({where}.<key>=...) instead of {data.raw!r}")
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys; got {type(data).__name__} {data!r}")
    hints = _hints(cls)
    unknown = [k for k in data if k not in hints]
    if unknown:
        raise ConfigError(_unknown_key_message(cls, prefix, str(unknown[0])))
    kwargs = {name: _coerce(value, hints[name], f"{prefix}{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid config in {where}: {e}") from e


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _coerce_union(value, args, key)
    inner = _dataclass_in(tp)
    if inner is not None:
        return _build(inner, value, key + ".")
    if origin is Literal:
        return _coerce_choice(value.raw if isinstance(value, _CliValue) else value, args, key)
    if isinstance(value, _CliValue):
        value = value.raw if tp is str else _parse_cli(value.raw)
    if origin is tuple:
        return _coerce_tuple(value, args, key)
    if tp is bool:
        return _coerce_bool(value, key)
    if tp is int:
        return _coerce_int(value, key)
    if tp is float:
        return _coerce_float(value, key)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} must be a string; got {type(value).__name__} {value!r}")
    raise ConfigError(f"{key}: unsupported field type {tp!r} in the config schema")


def _coerce_union(value: Any, args: tuple, key: str) -> Any:
    allows_none = type(None) in args
    raw = value.raw if isinstance(value, _CliValue) else value
    if allows_none and (raw is None or (isinstance(raw, str) and raw.strip().lower() in _NULL_WORDS)):
        return None
    options = [a for a in args if a is not type(None)]
    errors = []
    for option in options:
        try:
            return _coerce(value, option, key)
        except ConfigError as e:
            errors.append(str(e))
    if len(options) == 1 and typing.get_origin(options[0]) is Literal:  # an optional choice: name them
        raise ConfigError(f"{key} must be one of {typing.get_args(options[0])} or null; got {raw!r}")
    expected = " or ".join(_type_name(a) for a in args)
    raise ConfigError(f"{key} must be {expected}; got {raw!r}")


def _coerce_tuple(value: Any, args: tuple, key: str) -> tuple:
    if isinstance(value, str):
        value = [v for v in (part.strip() for part in value.split(",")) if v]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value]  # one item, as a word is (`--set logging.prob_buckets=0.5` as `...=mlp`)
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key} must be a list; got {type(value).__name__} {value!r}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if len(args) != len(value):
        raise ConfigError(f"{key} must have {len(args)} items; got {list(value)!r}")
    return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True)))


def _coerce_choice(value: Any, choices: tuple, key: str) -> Any:
    if value in choices:
        return value
    raise ConfigError(f"{key} must be one of {choices}; got {value!r}")


def _coerce_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS + _FALSE_WORDS:
        return value.strip().lower() in _TRUE_WORDS
    raise ConfigError(f"{key} must be true or false; got {value!r}")


def _coerce_int(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{key} must be an integer; got {value!r}")


def _coerce_float(value: Any, key: str) -> float:
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            too_large = f"{str(value)[:20]}..."
            raise ConfigError(f"{key} must be a number of at most ~1.8e308; got {too_large}") from None
    if isinstance(value, float) and not math.isnan(value):
        return value  # YAML's .nan is refused here; ±inf is left to each field's own check
    if isinstance(value, str):
        try:
            parsed = float(value.strip())  # "1e-4", "-inf", "inf" (YAML leaves these as strings)
        except ValueError:
            pass
        else:
            if not math.isnan(parsed):
                return parsed
    raise ConfigError(f"{key} must be a number; got {value!r}")


def _yaml_problem(e: yaml.YAMLError) -> str:
    """ "line L, column C: <problem>" of a YAML parse error (1-based, as editors count)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    if mark is None:
        return f"invalid YAML: {problem}"
    return f"line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {problem}"


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class _Yaml12Numbers(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's core-schema numbers, not 1.1's: `010` is ten (not octal 8),
    `1:30` is text (not sexagesimal 90), `1_000` text, and `0o17` / `0x1F` the only other bases. Before, a
    `seed: 010` trained with seed 8 and `--set train.steps=1:30` ran 90 steps, silently."""

    yaml_implicit_resolvers: typing.ClassVar = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node)
        sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
        if digits[:2] in ("0x", "0o"):
            return sign * int(digits[2:], 16 if digits[1] == "x" else 8)
        return sign * int(digits, 10)


_Yaml12Numbers.add_implicit_resolver(  # before the float resolver: a match of both is an int
    _INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Yaml12Numbers.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)
_Yaml12Numbers.add_constructor(_INT, _Yaml12Numbers.construct_yaml_int)


class _QuotingDumper(yaml.SafeDumper):
    """PyYAML's safe dumper, quoting a string that either YAML 1.1's resolvers (PyYAML's, other tools') or
    1.2's numbers (`_Yaml12Numbers`, this loader's) would read as another type."""

    yaml_implicit_resolvers: typing.ClassVar = {
        first: [
            *yaml.SafeDumper.yaml_implicit_resolvers.get(first, []),
            *_Yaml12Numbers.yaml_implicit_resolvers.get(first, []),
        ]
        for first in {*yaml.SafeDumper.yaml_implicit_resolvers, *_Yaml12Numbers.yaml_implicit_resolvers}
    }


class _UniqueKeyLoader(_Yaml12Numbers):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._checked: set[int] = set()

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # Checked here, before PyYAML merges `<<:` keys into the node in place (a merge source is flattened
        # too, and may be, as an alias, before its own turn): a node's own keys once, never merged ones.
        if id(node) not in self._checked:
            self._checked.add(id(node))
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                try:
                    if key in first_line:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} is given twice (first on line {first_line[key]})",
                            key_node.start_mark,
                        )  # fmt: skip
                    first_line[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the base class says so
                    break
        super().flatten_mapping(node)


def _parse_cli(raw: str) -> Any:
    """A `--set` value as YAML would read it ("[1, 2]" → list, "true" → True, "-13" → -13; YAML 1.2's
    numbers, `_Yaml12Numbers`)."""
    try:
        return yaml.load(raw, Loader=_Yaml12Numbers)
    except yaml.YAMLError:
        return raw
    except ValueError as e:  # an integer of more digits than Python converts (4300)
        raise ConfigError(f"--set {raw[:40]}...: {e}") from None


# --- schema helpers -------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _dataclass_in(tp: Any) -> type | None:
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _accepts_null(cls: type, parts: list[str]) -> bool:
    """The leaf at `parts` (a path `_check_path` accepted) may be null."""
    tp = _hints(_section_type(cls, parts[:-1]))[parts[-1]]
    return typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp)


def _section_type(cls: type, parts: list[str]) -> type:
    """The dataclass of the section at `parts` (a path `_check_path` accepted)."""
    for part in parts:
        cls = _dataclass_in(_hints(cls)[part])
    return cls


def _check_path(cls: type, parts: list[str]) -> None:
    node: type | None = cls
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        prefix = prefix + "." if prefix else ""
        if node is None:
            raise ConfigError(f"{prefix.rstrip('.')} is not a section; cannot set {'.'.join(parts)}")
        hints = _hints(node)
        if part not in hints:
            raise ConfigError(_unknown_key_message(node, prefix, part))
        node = _dataclass_in(hints[part])
    if node is not None:
        if (dotted := ".".join(parts)) in MOVED_KEYS:
            raise ConfigError(f"config key {dotted!r} is a section now: set {MOVED_KEYS[dotted]}")
        raise ConfigError(
            f"{'.'.join(parts)} is a section; set one of its keys, "
            f"e.g. {all_keys(node, '.'.join(parts) + '.')[0]}"
        )


MOVED_KEYS = {
    "model.bf16": "model.precision (bf16: true → precision: bf16; bf16: false → precision: fp32)",
    **ROLLOUT_MOVED_KEYS,
}
"""Keys of an earlier spelling → where they live now: such a key is refused in one line naming its new
place, instead of being read under two names. A key that is now a section's name (`rollout.weight_sync`)
is refused the same way when it is given a value instead of keys (`_build`)."""


def _unknown_key_message(cls: type, prefix: str, name: str) -> str:
    key = f"{prefix}{name}"
    if key in MOVED_KEYS:
        return f"config key {key!r} has moved: set {MOVED_KEYS[key]}"
    siblings = list(_hints(cls))
    close = difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    if close:
        hint = f"did you mean {prefix}{close[0]!s}?"
    else:
        # Maybe the key is right but in the wrong section (e.g. algorithm.lr for optimizer.lr).
        everywhere = all_keys()
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in everywhere}
        leaf = difflib.get_close_matches(name, list(by_leaf), n=1, cutoff=0.75)
        if leaf:
            hint = f"did you mean {by_leaf[leaf[0]]}?"
        else:
            hint = f"valid keys here: {', '.join(siblings)}"
    where = prefix.rstrip(".") or "the top level"
    return f"unknown config key {key!r} in {where}; {hint}"


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return config_to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "-inf" if value < 0 else "inf"
    return value


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}

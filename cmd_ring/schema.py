"""One schema mechanism for what transportd reads from outside: control and peer messages, and the config.

Both are msgspec Structs whose fields state their type and their limits where they are declared
(``Annotated[int, Meta(ge=..., le=...)]``, string length and pattern, ``Meta(extra={"rule": ...})`` saying in
words what a pattern means). :func:`convert` turns decoded data (a msgpack map, a TOML table) into such a
Struct with ``msgspec.convert``, then runs what a Meta cannot say, in this order: a field's
``Meta(extra={"check": fn})`` (it may normalise: an octal string becomes an int), finite floats, and each
Struct's ``_check()`` hook for rules across fields. Every failure becomes one :class:`Invalid` (defined in
:mod:`cmd_ring.errors` with the other error classes) carrying the path to the value and the reason, worded
in the caller's vocabulary (:class:`Words`: the protocol says "integer, got bool", the config "integer, got
boolean"), so the protocol and the config report mistakes the same way without a converter of their own.
"""

from __future__ import annotations

import contextvars
import math
import re
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from cmd_ring.errors import Invalid, dotted

__all__ = ["FieldPath", "Words", "convert", "converting", "describe", "dotted", "field_metas", "type_doc", "validate"]

T = TypeVar("T", bound=msgspec.Struct)
FieldPath = tuple[str | int, ...]

_converting: contextvars.ContextVar[bool] = contextvars.ContextVar("transportd_schema_converting", default=False)


@dataclass(frozen=True)
class Words:
    """How one plane names types in its messages."""

    types: dict[Any, str]  #: int, float, bool, str, bytes, tuple, dict, msgspec.Struct -> a word
    value_type: Callable[[object], str]  #: the word for a received value's own type
    articles: dict[str, str] = field(default_factory=dict)  #: "array" -> "an array" when it stands alone
    show_value: bool = False  #: follow "got <type>" with the value itself (scalars only)


def converting() -> bool:
    """True inside :func:`convert`'s msgspec step: a Struct's ``__post_init__`` leaves checking to it."""
    return _converting.get()


@contextmanager
def _conversion() -> Iterator[None]:
    token = _converting.set(True)
    try:
        yield
    finally:
        _converting.reset(token)


def convert(data: object, cls: type[T], words: Words) -> T:
    """``data`` as a checked ``cls``, or :class:`Invalid` naming the path and the reason."""
    try:
        with _conversion():
            obj = msgspec.convert(data, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise _explain(str(exc), cls, data, words) from None
    validate(obj, words)
    return obj


# ---------------------------------------------------------------------------------------------------------
# After msgspec: per-field checks, finite floats, cross-field hooks.


def field_metas(hint: Any) -> tuple[Any, tuple[msgspec.Meta, ...]]:
    """``hint`` without its ``Annotated`` wrapper, and the Metas that wrapper carried."""
    metas: list[msgspec.Meta] = []
    while typing.get_origin(hint) is Annotated:
        args = typing.get_args(hint)
        hint = args[0]
        metas = [m for m in args[1:] if isinstance(m, msgspec.Meta)] + metas
    return hint, tuple(metas)


def _extra(metas: tuple[msgspec.Meta, ...], key: str) -> Any:
    for meta in metas:
        if meta.extra and key in meta.extra:
            return meta.extra[key]
    return None


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        everything = typing.get_type_hints(cls, include_extras=True)
        hints = {name: everything[name] for name in cls.__struct_fields__}
        _HINTS[cls] = hints
    return hints


def validate(obj: msgspec.Struct, words: Words, path: FieldPath = ()) -> None:
    """Run the checks msgspec cannot (see the module doc) on ``obj`` and the Structs inside it, in place."""
    for name, hint in _hints(type(obj)).items():
        value = getattr(obj, name)
        new = _validate_value(value, hint, words, path + (name,))
        if new is not value:
            msgspec.structs.force_setattr(obj, name, new)
    hook = getattr(obj, "_check", None)
    if hook is not None:
        try:
            hook()
        except Invalid as exc:
            raise exc.within(path) from None


def _validate_value(value: Any, hint: Any, words: Words, path: FieldPath) -> Any:
    _, metas = field_metas(hint)
    if isinstance(value, tuple):
        items = tuple(_validate_item(item, metas, words, path + (i,)) for i, item in enumerate(value))
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    return _validate_item(value, metas, words, path)


def _validate_item(value: Any, metas: tuple[msgspec.Meta, ...], words: Words, path: FieldPath) -> Any:
    if isinstance(value, msgspec.Struct):
        validate(value, words, path)
    elif isinstance(value, float) and not math.isfinite(value):
        raise Invalid(path, f"must be finite, got {value}")
    elif isinstance(value, int) and _extra(metas, "le") is not None:
        problem = _range_problem(metas, value)
        if problem is not None:
            raise Invalid(path, problem)
    check = _extra(metas, "check")
    if check is not None:
        try:
            return check(value)
        except ValueError as exc:
            raise Invalid(path, str(exc)) from None
    return value


# ---------------------------------------------------------------------------------------------------------
# msgspec's ValidationError, in the caller's words.

_ERROR = re.compile(r"(?s)(?P<head>.*?)(?: - at `(?P<at>[^`]*)`(?: in `(?P<within>[^`]*)`)?)?")
_PATH_PART = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


def _parse_path(text: str) -> FieldPath:
    parts: list[str | int] = []
    for name, index in _PATH_PART.findall(text.removeprefix("$")):
        parts.append(name if name else int(index))
    return tuple(parts)


def _explain(text: str, cls: type, data: object, words: Words) -> Invalid:
    match = _ERROR.fullmatch(text)
    assert match is not None  # the pattern matches any text
    head = match.group("head")
    if match.group("within") is not None:  # a map key: "... - at `key` in `$.endpoint`"
        return Invalid(_parse_path(match.group("within")), "map keys must be strings")
    path = _parse_path(match.group("at") or "$")
    named = re.fullmatch(r"Object (missing required|contains unknown) field `([^`]*)`", head)
    if named:
        missing = named.group(1).startswith("missing")
        where = _without_none(field_metas(_hint_at(cls, path))[0])
        known = tuple(where.__struct_fields__) if isinstance(where, type) else ()
        return Invalid(path + (named.group(2),), "missing" if missing else "unknown field",
                       reason="missing" if missing else "unknown", known=known)
    problem = describe(_hint_at(cls, path), _value_at(data, path), words)
    return Invalid(path, problem or head[:1].lower() + head[1:])


def _hint_at(cls: type, path: FieldPath) -> Any:
    hint: Any = cls
    for part in path:
        base, _ = field_metas(hint)
        base = _without_none(base)
        if isinstance(part, int):
            args = typing.get_args(base)
            hint = args[0] if typing.get_origin(base) in (tuple, list) and args else Any
        elif isinstance(base, type) and issubclass(base, msgspec.Struct):
            hint = _hints(base).get(part, Any)
        else:
            hint = Any
    return hint


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _value_at(data: object, path: FieldPath) -> object:
    for part in path:
        if isinstance(part, int) and isinstance(data, list | tuple) and part < len(data):
            data = data[part]
        elif isinstance(part, str) and isinstance(data, dict):
            data = data.get(part)
        elif isinstance(part, str) and isinstance(data, msgspec.Struct):
            data = getattr(data, part, None)
        else:
            return None
    return data


def _fits(value: object, hint: Any) -> bool:
    hint, _ = field_metas(hint)
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is bytes:
        return isinstance(value, bytes | bytearray | memoryview)
    if hint is str:
        return isinstance(value, str)
    if origin is Literal:
        return isinstance(value, str) and value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, option) for option in typing.get_args(hint))
    if origin in (tuple, list):
        return isinstance(value, list | tuple)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return isinstance(value, dict | hint)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _word(hint: Any, words: Words) -> str:
    hint, _ = field_metas(hint)
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        return words.types[tuple]
    if origin is dict:
        return words.types[dict]
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return words.types[msgspec.Struct]
    return words.types.get(hint, getattr(hint, "__name__", str(hint)))


def describe(hint: Any, value: object, words: Words) -> str | None:
    """Why ``value`` does not fit ``hint`` (its type, then its Metas), or None when it fits."""
    base, metas = field_metas(hint)
    origin = typing.get_origin(base)
    if isinstance(value, float) and not math.isfinite(value) and _fits(value, base):
        return f"must be finite, got {value}"  # before the bounds: "nan is not in [0, 1]" says less
    if origin is Literal:
        allowed = typing.get_args(base)
        if not (isinstance(value, str) and value in allowed):
            return f"must be one of {', '.join(map(repr, allowed))}, got {value!r:.40}"
    elif origin in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(base) if o is not type(None)]
        fitting = [o for o in typing.get_args(base) if _fits(value, o)]
        if not fitting:
            return _expected(options, value, words)
        problem = describe(fitting[0], value, words)
        if problem is not None:
            return problem
    elif not _fits(value, base):
        return _expected([base], value, words)
    for meta in metas:
        problem = _meta_problem(meta, value)
        if problem is not None:
            return problem
    return _range_problem(metas, value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _expected(options: list[Any], value: object, words: Words) -> str:
    names = [_word(o, words) for o in options]
    text = words.articles.get(names[0], names[0]) if len(names) == 1 else " or ".join(names)
    got = words.value_type(value)
    if words.show_value and not isinstance(value, dict | list | tuple):
        got += f" {value!r:.40}"
    return f"expected {text}, got {got}"


def _meta_problem(meta: msgspec.Meta, value: Any) -> str | None:
    if (meta.min_length is not None or meta.max_length is not None) and hasattr(value, "__len__"):
        n = len(value)
        lo, hi = meta.min_length or 0, meta.max_length
        if n < lo or (hi is not None and n > hi):
            unit = {bytes: "bytes", dict: "keys", str: "characters"}.get(type(value), "items")
            if lo == hi:
                return f"must be {lo} {unit}, got {n}"
            if isinstance(value, str) and lo:
                return f"length must be {lo}..{hi}, got {n}"
            if hi is None:
                return f"at least {lo} {unit}, got {n}"
            return f"at most {hi} {unit}, got {n}" if not lo else f"must hold {lo}..{hi} {unit}, got {n}"
    if meta.pattern is not None and isinstance(value, str) and not re.search(meta.pattern, value):
        rule = (meta.extra or {}).get("rule", f"does not match {meta.pattern!r}")
        return f"{value!r:.40} {rule}"
    return None


def _range_problem(metas: tuple[msgspec.Meta, ...], value: int | float) -> str | None:
    """Bounds of every Meta together: ``ge``/``gt``/``le``/``lt``, and ``extra={"le": ...}`` for a bound
    msgspec cannot hold (it keeps integer bounds within int64; a u64 field's top is 2**64 - 1)."""
    lo = hi = None
    lo_open = hi_open = False
    for meta in metas:
        if meta.ge is not None or meta.gt is not None:
            lo, lo_open = (meta.ge, False) if meta.ge is not None else (meta.gt, True)
        if meta.le is not None or meta.lt is not None:
            hi, hi_open = (meta.le, False) if meta.le is not None else (meta.lt, True)
    if _extra(metas, "le") is not None:
        hi, hi_open = _extra(metas, "le"), False
    low_ok = lo is None or (value > lo if lo_open else value >= lo)
    high_ok = hi is None or (value < hi if hi_open else value <= hi)
    if low_ok and high_ok:
        return None
    if lo is not None and hi is not None and not lo_open and not hi_open:
        return f"must be in [{lo}, {hi}], got {value}"
    if not low_ok:
        return f"must be {'>' if lo_open else '>='} {lo}, got {value}"
    return f"must be {'<' if hi_open else '<='} {hi}, got {value}"


# ---------------------------------------------------------------------------------------------------------
# Documentation from the same annotations.


def type_doc(hint: Any, *, limits: bool = True) -> str:
    """``hint`` for a reader: ``int [1, 8]``, ``list of str``, ``'ring' | 'ibgda'``, ``str (optional)``; with
    ``limits`` the bounds and lengths its Metas state."""
    base, metas = field_metas(hint)
    origin = typing.get_origin(base)
    if origin is Literal:
        text = " | ".join(repr(a) for a in typing.get_args(base))
    elif origin in (tuple, list):
        text = f"list of {type_doc(typing.get_args(base)[0], limits=limits)}"
    elif origin is dict or base is dict:
        text = "map"
    elif origin in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(base) if o is not type(None)]
        text = " or ".join(type_doc(o, limits=limits) for o in options)
        if len(options) < len(typing.get_args(base)):
            text += " (optional)"
    elif _extra(metas, "doc_type") is not None:  # a field typed Any so that its check can say more
        text = _extra(metas, "doc_type")
    elif base is Any:
        text = "any"
    else:
        text = getattr(base, "__name__", str(base))
    if not limits:
        return text
    lo = hi = None
    for meta in metas:
        lo = meta.ge if meta.ge is not None else lo
        hi = meta.le if meta.le is not None else hi
        if meta.min_length is not None or meta.max_length is not None:
            n_lo, n_hi = meta.min_length or 0, meta.max_length
            text += f" (length {n_lo})" if n_lo == n_hi else f" (length {n_lo}..{'' if n_hi is None else n_hi})"
        if meta.extra and "rule" in meta.extra:
            text += " (a name)"
    hi = _extra(metas, "le") if _extra(metas, "le") is not None else hi
    if lo is not None or hi is not None:
        text += f" [{'' if lo is None else lo}, {'' if hi is None else hi}]"
    return text

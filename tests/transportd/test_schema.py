"""The one schema mechanism (cmd_ring/schema.py) on Structs of its own: every failure is one Invalid with
the path to the value and the reason in the caller's words, checks run after msgspec's, and the docs come
from the same annotations. The protocol's and the config's own tests cover their messages."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
import pytest
from msgspec import Meta

from transportd import schema
from transportd.errors import Invalid

WORDS = schema.Words(types={int: "integer", float: "number", bool: "bool", str: "string", bytes: "bytes",
                            tuple: "array", dict: "map", msgspec.Struct: "map"},
                     value_type=lambda v: type(v).__name__)
TABLE_WORDS = schema.Words(types=WORDS.types, value_type=lambda v: type(v).__name__,
                           articles={"map": "a table"}, show_value=True)


def _even(value: int) -> int:
    if value % 2:
        raise ValueError(f"must be even, got {value}")
    return value


class Leaf(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    n: Annotated[int, Meta(ge=0, le=9)]
    big: Annotated[int, Meta(ge=0, extra={"le": (1 << 64) - 1})] = 0
    name: Annotated[str, Meta(min_length=1, max_length=4, pattern=r"^[a-z]+\Z",
                              extra={"rule": "is not lower case"})] = "a"

    def _check(self) -> None:
        if self.n == 7:
            raise Invalid(("n",), "seven is refused by the rule across fields")


class Root(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    leaves: tuple[Leaf, ...] = ()
    kind: Literal["a", "b"] = "a"
    t: float = 0.0
    pair: Annotated[int, Meta(extra={"check": _even})] = 0
    label: Annotated[str | None, Meta(extra={"check": lambda v: v or None})] = None


@pytest.mark.parametrize(("data", "path", "problem"), [
    ({"leaves": [{"n": 10}]}, "leaves[0].n", "must be in [0, 9], got 10"),
    ({"leaves": [{"n": "1"}]}, "leaves[0].n", "expected integer, got str"),
    ({"leaves": [{"n": True}]}, "leaves[0].n", "expected integer, got bool"),
    ({"leaves": [{}]}, "leaves[0].n", "missing"),
    ({"leaves": [{"n": 1, "x": 2}]}, "leaves[0].x", "unknown field"),
    ({"leaves": [3]}, "leaves[0]", "expected map, got int"),
    ({"leaves": [{"n": 1, "big": 1 << 64}]}, "leaves[0].big", f"must be in [0, {(1 << 64) - 1}], got {1 << 64}"),
    ({"leaves": [{"n": 1, "name": ""}]}, "leaves[0].name", "length must be 1..4, got 0"),
    ({"leaves": [{"n": 1, "name": "Ab"}]}, "leaves[0].name", "'Ab' is not lower case"),
    ({"leaves": [{"n": 7}]}, "leaves[0].n", "seven is refused by the rule across fields"),
    ({"kind": "c"}, "kind", "must be one of 'a', 'b', got 'c'"),
    ({"t": float("nan")}, "t", "must be finite, got nan"),
    ({"pair": 3}, "pair", "must be even, got 3"),
    ({"label": 5}, "label", "expected string, got int"),
])
def test_every_failure_names_its_path_and_reason(data, path, problem):
    with pytest.raises(Invalid) as info:
        schema.convert(data, Root, WORDS)
    assert (schema.dotted(info.value.path), info.value.problem) == (path, problem)


def test_unknown_and_missing_say_which_kind_of_failure_and_what_is_known():
    with pytest.raises(Invalid) as info:
        schema.convert({"leaves": [{"n": 1, "x": 2}]}, Root, WORDS)
    assert info.value.reason == "unknown" and info.value.known == ("n", "big", "name")
    with pytest.raises(Invalid) as info:
        schema.convert({"leaves": [{}]}, Root, WORDS)
    assert info.value.reason == "missing"


def test_checks_normalise_and_lists_become_tuples():
    root = schema.convert({"leaves": [{"n": 1}], "label": "", "t": 2}, Root, WORDS)
    assert root.leaves == (Leaf(1),) and root.label is None and root.t == 2.0


def test_a_callers_words():
    with pytest.raises(Invalid, match=r"expected a table, got int 3"):
        schema.convert({"leaves": [3]}, Root, TABLE_WORDS)


def test_within_prefixes_the_path():
    assert schema.dotted(Invalid(("n",), "x").within(("leaves", 2)).path) == "leaves[2].n"


def test_type_doc_shows_the_limits_the_annotations_state():
    hints = {f.name: f.type for f in msgspec.structs.fields(Leaf)}
    assert schema.type_doc(hints["n"]) == "int [0, 9]"
    assert schema.type_doc(hints["big"]) == f"int [0, {(1 << 64) - 1}]"
    assert schema.type_doc(hints["name"]) == "str (length 1..4) (a name)"
    assert schema.type_doc(hints["n"], limits=False) == "int"
    assert schema.type_doc(Literal["a", "b"]) == "'a' | 'b'"
    assert schema.type_doc(tuple[Leaf, ...]) == "list of Leaf"
    assert schema.type_doc(str | None) == "str (optional)"

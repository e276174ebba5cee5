"""slurmgpu.typing_lite.NamedTuple makes the classes typing.NamedTuple makes (only the field
annotations stay text), without importing typing and without compiling anything."""

from __future__ import annotations

import keyword
import pickle
import subprocess
import sys
import types
import typing
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurmgpu import typing_lite
from slurmgpu.pipeline.script import Word


def _make(base: Any, name: str, fields: list[str], defaults: dict[str, Any],
          extra: dict[str, Any] | None = None) -> Any:
    """``class NAME(BASE)`` with FIELDS annotated (as text, as under ``from __future__ import
    annotations``), DEFAULTS set and EXTRA added to the body; made at module level of this test."""

    def body(ns: dict[str, Any]) -> None:
        ns["__module__"] = __name__
        ns["__qualname__"] = name
        ns["__annotations__"] = {f: "int | None" for f in fields}
        ns.update(defaults)
        ns.update(extra or {})

    return types.new_class(name, (base,), exec_body=body)


def _outcome(call: Callable[[], Any]) -> tuple[str, str]:
    """What a call raised, as (type, message), or ("ok", "")."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the exception is what is compared
        return type(exc).__name__, str(exc)
    return "ok", ""


FIELD = st.text(alphabet="abcdefghij_", min_size=1, max_size=6).filter(
    lambda s: s.isidentifier() and not keyword.iskeyword(s) and not s.startswith("_"))


@given(fields=st.lists(FIELD, min_size=0, max_size=6, unique=True), data=st.data())
def test_a_class_behaves_as_typing_makes_it(fields: list[str], data: st.DataObject) -> None:
    n_defaults = data.draw(st.integers(0, len(fields)))
    defaults = {f: data.draw(st.integers(-5, 5) | st.none()) for f in fields[len(fields) - n_defaults:]}
    ours, theirs = (_make(base, "Rec", fields, defaults) for base in (typing_lite.NamedTuple, typing.NamedTuple))
    for attr in ("_fields", "_field_defaults", "__doc__", "__module__", "__qualname__", "__match_args__",
                 "__bases__", "__slots__"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert type(ours) is type(theirs) is type
    assert dict(ours.__annotations__) == {f: "int | None" for f in fields}  # the text, never compiled
    values = data.draw(st.lists(st.integers(-5, 5), min_size=len(fields) - n_defaults, max_size=len(fields)))
    a, b = ours(*values), theirs(*values)
    assert tuple(a) == tuple(b) and repr(a) == repr(b) and a._asdict() == b._asdict()
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
    assert tuple(ours._make(values + [0] * (len(fields) - len(values)))) == \
        tuple(theirs._make(values + [0] * (len(fields) - len(values))))
    if fields:
        assert tuple(a._replace(**{fields[0]: 9})) == tuple(b._replace(**{fields[0]: 9}))
    for args in ((), (1,) * (len(fields) + 1)):
        assert _outcome(lambda args=args: ours(*args)) == _outcome(lambda args=args: theirs(*args))
    assert _outcome(lambda: ours(nonsense=1)) == _outcome(lambda: theirs(nonsense=1))


def test_the_body_s_docstring_methods_and_properties_are_kept() -> None:
    def area(self: Any) -> int:
        return self.w * self.h

    extra = {"__doc__": "A box.", "area": area, "square": property(lambda self: self.w == self.h), "UNIT": 1}
    ours, theirs = (_make(base, "Box", ["w", "h"], {"h": 2}, extra) for base in (typing_lite.NamedTuple,
                                                                                     typing.NamedTuple))
    for cls in (ours, theirs):
        box = cls(3)
        assert (cls.__doc__, box.area(), box.square, cls.UNIT, box) == ("A box.", 6, False, 1, (3, 2))


@pytest.mark.parametrize(("fields", "defaults", "extra"), [
    (["a", "b"], {"a": 1}, {}), (["a", "b", "c"], {"a": 1, "b": 2}, {}),  # a default before a field without
    (["a"], {}, {"_replace": None}), (["a"], {}, {"__new__": None}),  # what a body may not set
])
def test_misuse_is_refused_as_typing_refuses_it(fields: list[str], defaults: dict[str, Any],
                                                extra: dict[str, Any]) -> None:
    got = [_outcome(lambda base=base: _make(base, "Bad", fields, defaults, extra))
           for base in (typing_lite.NamedTuple, typing.NamedTuple)]
    assert got[0] == got[1] and got[0][0] != "ok"


def test_no_other_base_is_taken() -> None:
    with pytest.raises(TypeError):
        types.new_class("Two", (typing_lite.NamedTuple, int))


def test_instances_pickle_and_compare_as_tuples() -> None:
    word = Word("--gres=gpu:1", 8, 20)
    assert pickle.loads(pickle.dumps(word)) == word == ("--gres=gpu:1", 8, 20)
    assert type(pickle.loads(pickle.dumps(word))) is Word


def test_the_path_s_classes_need_neither_typing_nor_compile() -> None:
    """In a fresh interpreter, the modules gsbatch loads with the daemon answering make their
    classes without loading typing and without one call of compile(); the probe sees the compile
    a typing.NamedTuple with a text annotation makes."""
    probe = """
import builtins, sys, types
calls, real = [], builtins.compile
def counted(*args, **kwargs):
    name = sys._getframe(1).f_globals.get("__name__", "?")
    if not name.startswith(("_frozen_importlib", "importlib")):  # a module without its byte code
        calls.append(name)
    return real(*args, **kwargs)
builtins.compile = counted
import slurmgpu.apps.daemon_client, slurmgpu.apps.gsbatch, slurmgpu.pipeline.memory_fit
import slurmgpu.pipeline.spool, slurmgpu.pipeline.validate
print("typing" in sys.modules, sorted(set(calls)))
import typing
types.new_class("Made", (typing.NamedTuple,),
                exec_body=lambda ns: ns.update(__module__="m", __annotations__={"a": "int"}))
print(sorted(set(calls)))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["False []", "['typing']"]

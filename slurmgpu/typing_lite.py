"""What the modules on gsbatch's start-up path take from ``typing``, without importing it.

Importing ``typing`` costs a submission about 0.4x a bare Python start (docs/benchmarks-gsbatch.md).
The modules gsbatch loads with the daemon answering keep their annotations as text (``from
__future__ import annotations``) and take from here the three names they use at run time; type
checkers see typing's own:

- ``TYPE_CHECKING``: False.
- ``NamedTuple``: a class written ``class Word(NamedTuple): ...`` is made as ``typing.NamedTuple``
  makes it (by ``collections.namedtuple``, with the body's docstring, methods and defaults), but its
  field annotations stay the text they were written as: neither evaluated nor compiled (a
  ``typing.NamedTuple`` compiles each text annotation, and a process's first compile() costs
  milliseconds). Only the class form, and no base but ``NamedTuple``.
- ``Protocol``: a plain base class. The protocols are not runtime-checkable (isinstance would
  raise); nothing makes or tests one at run time, they name what type checkers hold code to.
"""

from __future__ import annotations

import collections

TYPE_CHECKING = False  # typing.TYPE_CHECKING's value at run time; type checkers take it as True
if TYPE_CHECKING:
    from typing import NamedTuple as NamedTuple
    from typing import Protocol as Protocol
else:

    class Protocol:
        """typing.Protocol to type checkers (see above)."""

    # as typing.NamedTuple: what a class body may not set, and what is not copied from it
    _PROHIBITED = frozenset({"__new__", "__init__", "__slots__", "__getnewargs__", "_fields", "_field_defaults",
                             "_make", "_replace", "_asdict", "_source"})
    _SPECIAL = frozenset({"__module__", "__name__", "__annotations__"})

    class _Maker(type):
        """The metaclass of ``NamedTuple``: a subclass's body becomes a namedtuple class."""

        def __new__(mcs, typename, bases, ns):
            if bases != (NamedTuple,):
                raise TypeError("can only inherit from NamedTuple")
            annotations = dict(ns.get("__annotations__", {}))
            defaults: list[str] = []
            for name in annotations:
                if name in ns:
                    defaults.append(name)
                elif defaults:
                    raise TypeError(f"Non-default namedtuple field {name} cannot follow default field"
                                    f"{'s' if len(defaults) > 1 else ''} {', '.join(defaults)}")
            cls = collections.namedtuple(typename, annotations, defaults=[ns[n] for n in defaults],
                                         module=ns["__module__"])
            cls.__annotations__ = cls.__new__.__annotations__ = annotations
            for key in ns:
                if key in _PROHIBITED:
                    raise AttributeError("Cannot overwrite NamedTuple attribute " + key)
                if key not in _SPECIAL and key not in cls._fields:
                    setattr(cls, key, ns[key])
            return cls

    NamedTuple = type.__new__(_Maker, "NamedTuple", (), {"__module__": __name__})

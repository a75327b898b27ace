"""The functional forms (``pipe.batch``, ``pipe.map``, ...) carry their class's documentation.

Each built-in operation is a real method of ``IterOperations`` / ``MapOperations`` (so type
checkers see it) that builds the operation's class. ``help(pipe.batch)`` should say what
``help(Batcher)`` says: what it does, its arguments, an example. Each class names its functional
form in its docstring ("(functional name: ``batch``)"); this module copies the class's text onto
the method of that name once every class is imported.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable

_FUNCTIONAL_NAME = re.compile(r"\(functional\s+name:\s+``(\w+)``")


def document_functional_forms(operations: type, classes: Iterable[type]) -> None:
    """Give each method of ``operations`` that is the functional form of one of ``classes``
    that class's docstring (and a line saying what it returns)."""
    for cls in classes:
        doc = inspect.getdoc(cls) if isinstance(cls, type) else None
        found = _FUNCTIONAL_NAME.search(doc or "")
        if doc is None or found is None:
            continue
        doc = _FUNCTIONAL_NAME.sub(lambda m: f"(functional name: ``{m.group(1)}``", doc)  # one line
        method = vars(operations).get(found.group(1))
        if method is None or not inspect.isfunction(method):
            continue
        method.__doc__ = f"{doc}\n\nReturns:\n    a :class:`{cls.__module__}.{cls.__qualname__}` reading from this pipe."

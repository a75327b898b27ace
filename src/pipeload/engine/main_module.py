"""Why a 'spawn' or 'forkserver' worker could not rebuild what it was sent, when the main module
is the reason.

Such a worker imports the main script again under another name (``__mp_main__``), without running
its ``if __name__ == "__main__":`` block, then unpickles the dataset, ``collate_fn`` and
``worker_init_fn``, whose classes and functions are found by name. One defined inside that block
(or typed into an interactive session) is not there: the worker dies with exit code 1 before it
runs any of pipeload's code, and its traceback goes only to the standard error. torch's message
for that death says to rerun with ``num_workers=0``, where the same code works. This module finds
the cause from the main process, by reading the script's top-level statements, so that the
error can say it.

The same import runs every top-level statement outside that block: one that starts a DataLoader
(a ``for`` loop over it, or a call to ``main()``) starts it again in the worker, where
multiprocessing refuses to start processes while the worker is still being set up, and the
worker dies the same way (``started_outside_main_guard``).
"""

from __future__ import annotations

import ast
import sys
import tokenize
from collections.abc import Iterator
from typing import Any


def unreachable_in_workers(named_objects: dict[str, Any]) -> str:
    """A sentence naming the first object among ``named_objects`` (argument name -> object)
    whose class or function lives in the main module but is not defined at its top level, as
    a 'spawn' or 'forkserver' worker sees it; "" when there is none (or the script cannot be
    read)."""
    main = sys.modules.get("__main__")
    defined = _top_level_names(getattr(main, "__file__", None))
    for argument, obj in named_objects.items():
        for found in _main_module_globals(obj):
            head = found.__qualname__.split(".")[0]
            if defined is not None and head in defined:
                continue
            where = ("an interactive session or a `python -c` command, which a worker cannot import"
                     if defined is None else
                     f"{main.__file__} inside `if __name__ == '__main__':` (or another block a "
                     "worker does not run when it imports that file)")
            return (f"{argument}: {found.__qualname__} is defined in {where}, so the worker "
                    f"could not find it (its traceback, above on the standard error, says "
                    f"\"Can't get attribute {head!r}\"). Define {head} at the top level of the "
                    "script or in a module of its own, or use multiprocessing_context='fork'")
    return ""


def started_outside_main_guard() -> str:
    """A sentence naming the line of the main script that is starting the workers, when that
    line runs on import too: a worker importing the script runs it again. "" when the
    top-level statement around the line mentions ``__name__`` anywhere (a main guard of some
    form: better to say nothing than to blame a guarded line), or when no script frame is on
    the stack (pytest, ``python -c``, a notebook) or the script cannot be read."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = _script_frame(getattr(main, "__dict__", None))
    if frame is None or not path:
        return ""
    tree = _parse(path)
    if tree is None:
        return ""
    line = frame.f_lineno
    for statement in tree.body:
        if not statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            continue
        if any(isinstance(node, ast.Name) and node.id == "__name__" for node in ast.walk(statement)):
            return ""
        return (f"line {line} of {path} starts the DataLoader's workers outside "
                "`if __name__ == '__main__':`. A 'spawn' or 'forkserver' worker imports that file "
                "again and runs that line too, where starting processes fails (its traceback, on "
                "the standard error, says \"An attempt has been made to start a new process before "
                "the current process has finished its bootstrapping phase\"). Put the code that "
                "runs when the script is started under `if __name__ == '__main__':`, or use "
                "multiprocessing_context='fork'")
    return ""


def _script_frame(main_globals: dict[str, Any] | None) -> Any:
    """The frame running the main script's top-level code, if it is on this thread's stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is main_globals:
            return frame
        frame = frame.f_back
    return None


def _main_module_globals(obj: Any) -> Iterator[Any]:
    """``obj`` itself if it is a function or class of ``__main__``, and its class if that is."""
    for candidate in (obj, type(obj)):
        if getattr(candidate, "__module__", None) == "__main__" and hasattr(candidate, "__qualname__"):
            yield candidate


def _top_level_names(path: str | None) -> set[str] | None:
    """Names the script at ``path`` binds when imported under another name than ``__main__``
    (None: no script, or one that cannot be read and parsed)."""
    tree = _parse(path) if path else None
    if tree is None:
        return None
    names: set[str] = set()
    _collect(tree.body, names)
    return names


def _parse(path: str) -> ast.Module | None:
    try:
        with tokenize.open(path) as file:  # in the encoding the script declares, as Python reads it
            return ast.parse(file.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _collect(statements: list[ast.stmt], names: set[str]) -> None:
    for statement in statements:
        if isinstance(statement, ast.If) and _is_main_guard(statement.test):
            _collect(statement.orelse, names)  # the worker takes the else branch
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(statement.name)
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in statement.names)
        elif isinstance(statement, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With,
                                    ast.AsyncWith, ast.Try)):
            # A block that runs on import binds what its statements bind (either branch may).
            for header in (getattr(statement, "target", None), *getattr(statement, "items", ())):
                if header is not None:
                    _add_stored(header, names)
            for block in (statement.body, getattr(statement, "orelse", []),
                          getattr(statement, "finalbody", [])):
                _collect(block, names)
            for handler in getattr(statement, "handlers", []):
                _collect(handler.body, names)
        else:
            _add_stored(statement, names)


def _add_stored(node: ast.AST, names: set[str]) -> None:
    """Names ``node`` assigns (``x = ...``, ``x: int = ...``, ``with ... as x``, walrus)."""
    names.update(found.id for found in ast.walk(node)
                 if isinstance(found, ast.Name) and isinstance(found.ctx, ast.Store))


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))

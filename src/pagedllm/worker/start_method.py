"""How tensor-parallel worker processes start.

forkserver where there is one: its server imports torch and the model code once per engine
process, so workers (and later engines' workers) start in a fraction of the time, and a fork
of that single-threaded server is safe for CUDA too, unlike a fork of the engine's process.

A forkserver (or spawn) child first runs the user's main script again, as ``__mp_main__``.
A script that builds the engine at module level without ``if __name__ == "__main__":``
would build another engine in every worker, and multiprocessing refuses that with its
bootstrapping error. Such a script gets workers forked from the engine's process instead
(nothing is run again), as vLLM does, when that is safe: CUDA not yet initialised here. When
it is not safe, the engine fails at once with a message that says what to write.
"""

from __future__ import annotations

import ast
import sys
from multiprocessing.context import BaseContext
from types import FrameType

import torch.multiprocessing as mp

GUARD_MESSAGE = (
    "tensor_parallel_size > 1 starts worker processes that run {path} again, and it builds "
    "the engine at module level; CUDA is already initialised in this process, so the workers "
    "cannot be forked instead. Put the code that builds the engine under "
    '`if __name__ == "__main__":`.'
)


def worker_context(preload: list[str]) -> BaseContext:
    """The multiprocessing context to start workers with (see the module docstring)."""
    path = unguarded_main_script(sys._getframe(1))
    if path is not None:
        if not fork_is_safe():
            raise RuntimeError(GUARD_MESSAGE.format(path=path))
        return mp.get_context("fork")
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


def fork_is_safe() -> bool:
    """A forked child cannot use CUDA once the parent initialised it."""
    import torch

    return not torch.cuda.is_initialized()


def unguarded_main_script(frame: FrameType | None) -> str | None:
    """The main script's path when this call comes from its module-level code outside an
    ``if __name__ == "__main__":`` block (so a spawned child would run it again), else None."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:  # `python -c`, a REPL: children never run __main__
        return None
    while frame is not None:
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            return None if inside_main_guard(path, frame.f_lineno) else path
        frame = frame.f_back
    return None


def inside_main_guard(path: str, lineno: int) -> bool:
    """Whether line lineno of the script at path lies in an `if __name__ == "__main__":`."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return True  # a script that cannot be read cannot be run again either
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_main_test(node.test):
            end = node.body[-1].end_lineno or node.body[-1].lineno
            if node.lineno <= lineno <= end:
                return True
    return False


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    mains = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(mains) == 1

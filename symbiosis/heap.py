"""Our long-running processes keep Python's cycle collector off the heap they built at startup.

A process of ours imports torch and transformers and loads a model before it serves: ~400,000
objects the collector tracks, which live as long as the process. Every collection of the oldest
generation walks all of them, under the interpreter lock: 0.25 s for one ``gc.collect()`` in an
API server's engine process on this 2-core host, 0.1-0.9 s for each of the six that ran while
eight client processes and an executor started side by side (a ``gc.callbacks`` probe, 2026-12-06);
and the interpreter's last collection at exit walks them again -- 2 s of an engine process's exit,
1.1-1.2 s of any process that imported transformers and built a model (0.2 s frozen). Those
walks find little (one at an engine process's ready point freed 182 objects of ~400,000): what a
request allocates is mostly freed by reference counting. ``gc.freeze()`` moves every object
alive at that moment to a permanent generation no collection walks; objects made later are
collected as before. The price: a cycle among the frozen objects that becomes garbage later is
never collected -- startup state is not expected to, and the leak would be bounded by what startup
made. vLLM, SGLang and Ray Serve freeze their serving processes' startup heap the same way.

Only in a process of ours: the ``symbiosis`` command (``cli.run``) and the API server's engine
process claim theirs (``own_this_process``); anywhere else -- a library user's program, a test
running ``cli.main`` in-process -- ``freeze_startup_heap`` leaves the heap alone.
``SYMBIOSIS_FREEZE_HEAP=0`` turns it off (to compare, or to rule it out).
"""

from __future__ import annotations

import gc
import os

VARIABLE = "SYMBIOSIS_FREEZE_HEAP"

_process_is_ours = False


def own_this_process() -> None:
    """Called by the entry point of a process we start: its heap is ours to freeze."""
    global _process_is_ours
    _process_is_ours = True


def enabled() -> bool:
    return os.environ.get(VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def freeze_startup_heap(collect: bool = True) -> bool:
    """Freeze every object alive now out of the collector's walks (see the module doc).

    ``collect``: collect first, so that startup's garbage is freed rather than frozen -- cheap
    after an earlier freeze, which it walks no more; leave it out right after imports, which make
    little garbage. Call it where a process is done building what it keeps: after its imports,
    and once it is ready to serve. Returns whether it froze (False when turned off, or when the
    process is not ours)."""
    if not (_process_is_ours and enabled()):
        return False
    if collect:
        gc.collect()
    gc.freeze()
    return True


def skip_exit_collection() -> None:
    """Freeze everything, without collecting, as the process is about to exit: the interpreter's
    last collection then walks nothing (1.1-1.2 s of the exit of a process that imported
    transformers and built a model, 0.2 s frozen; the OS takes the memory back either way). Only
    where this process is ours and ends now: objects frozen are never collected again, so the
    finalizers of objects caught in reference cycles do not run -- what our commands write is
    closed before they return (``with`` blocks, ``jobs/artifacts.py``'s atomic writes)."""
    if enabled():
        gc.freeze()

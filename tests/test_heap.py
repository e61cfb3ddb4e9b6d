"""Our own processes freeze their startup heap out of the cycle collector's walks (symbiosis/heap.py);
anyone else's heap is left alone. Each case runs in a child interpreter: a freeze is for good."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_child(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


FREEZE_NOW = """
import gc
from symbiosis import heap
{claim}
print(heap.freeze_startup_heap(), gc.get_freeze_count() > 0)
"""


def test_a_process_that_is_not_ours_keeps_its_heap():
    """A library user's program, or a test running cli.main in-process: nothing is frozen."""
    assert run_child(FREEZE_NOW.format(claim="")) == "False False"


def test_a_process_of_ours_freezes_its_heap_unless_told_not_to():
    assert run_child(FREEZE_NOW.format(claim="heap.own_this_process()")) == "True True"
    for off in ("0", "off"):
        assert run_child(FREEZE_NOW.format(claim="heap.own_this_process()"), SYMBIOSIS_FREEZE_HEAP=off) == "False False"


def test_startup_garbage_is_collected_before_the_freeze_and_later_garbage_still_is():
    code = """
import gc, weakref
from symbiosis import heap
heap.own_this_process()
gc.disable()  # no automatic collection in between: only the freeze's own collect may free it

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

startup_garbage = cycle()
heap.freeze_startup_heap()
later_garbage = cycle()
gc.collect()
print(startup_garbage() is None, later_garbage() is None)
"""
    assert run_child(code) == "True True"


@pytest.mark.parametrize("entry", ["symbiosis", "symbiosis.serving.engine_process"])
def test_our_entry_points_skip_the_collection_at_exit(entry):
    """The interpreter's last collection walks only what is not frozen (~1 s of an exit once a
    model is built): the ``symbiosis`` command and the engine process freeze all as they end.
    (The engine process, given no parent to talk to, ends at once.)"""
    argv = ["symbiosis", "--help"] if entry == "symbiosis" else ["engine_process", "ipc://x", "ipc://y", "1"]
    code = f"""
import atexit, gc, runpy, sys
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))
sys.argv = {argv!r}
try:
    runpy.run_module({entry!r}, run_name="__main__")
except SystemExit:
    pass
"""
    assert run_child(code).splitlines()[-1] == "frozen at exit: True"


def test_cli_main_in_process_leaves_the_callers_heap_alone():
    code = """
import atexit, gc, sys
from symbiosis import cli
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))
sys.argv = ["symbiosis", "--help"]
try:
    cli.main()
except SystemExit:
    pass
"""
    assert run_child(code).splitlines()[-1] == "frozen at exit: False"

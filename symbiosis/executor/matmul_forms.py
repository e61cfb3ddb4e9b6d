"""Which way of writing a forward product the executor runs, chosen by timing them here.

Why. A base layer's forward is ``rows @ weight.T`` -- what ``nn.Linear`` runs -- and that is also
``(weight @ rows.T).T``. The two reach the BLAS library as different calls (torch passes the
first as a gemm with the weight transposed, the second with the rows transposed), and for a few
rows the library's kernels for them differ a lot. Measured on this project's 2-core AMD EPYC host
(torch 2.13 CPU, MKL; 2026-11-28; weights streaming from memory, ~105M llama's shapes): at 2 to 8
rows the first takes about twice as long as one row (MKL runs it as one pass over the weight per
row), the second about as long as one row; with two threads the second also uses both cores where
the first uses one, so a 2-row gate/up product took 232 us against 960 (x0.24), 8 rows 519 against
831; at one row, the second with the row given twice ran at x0.39-0.87 of the first (MKL's gemv
uses one core). But not everywhere: the down projection at 4-8 rows on one thread took x1.6-1.7
with the second, and past 64 rows it went either way (two threads: x0.83 at 128 rows, x1.42 at
1024; training's products are that size, and are left to torch's form). So neither is written in:
the first time a (weight shape, row count, thread count) comes up, both are timed on this host and
the faster is kept for the life of the process -- as cuBLAS's heuristics or a Triton autotuner
pick among kernels. Every product with those shapes then runs the same way: results never change
between calls, only, where the second form won, in the last bits against ``nn.Linear``'s (within
float tolerance, as any batch's rows already are: MKL's kernels change with the row count).

How. Only full-precision CPU forwards of 1 to ``LARGEST_TUNED_ROWS`` rows are tuned; anything else
(backward products, accelerators, training-sized batches, quantized layers) runs the first form.
A trial runs each form ``ROUNDS`` times, alternating, each time over up to ``PEERS`` weights of
the same shape (the model's other layers: one weight timed again and again would sit in the cache)
after reading twice the last-level cache's worth of the model's other weights when the model is
larger than that cache (as a decode step reads them between two products of one layer), and keeps
each product's fastest time over the rounds (noise only adds time: another process taking a core
mid-product); the second form must beat the first by ``MARGIN`` to be kept, so what noise is
left leaves torch's own form in place. A trial costs ~10 such reads and ~40 products, once per
shape and row count: on the ~105M llama 54 ms (33 ms with three rounds and medians, whose choices
moved with the host's load), so a fresh server serving every row count from 1 to 64 spends ~17 s
in 320 trials over its first requests (2026-11-29, this 2-core host; three rounds of fastest
times still moved some 8-row choices on a quiet host).

A layer with a packed copy (``packed_weights.py``: oneDNN's linear against the weight in its
blocked layout) has a third form, and there trials are few. Measured the same way (2026-11-29, the
~105M and hidden-512 llamas' shapes, ~200 MB of weights, fastest of 7 passes): at 3-8 rows the
packed product took x0.4-0.7 of the best of the other two, at 16-1,024 rows x0.5-0.87 of
``nn.Linear``'s form, but at 1-2 rows x1.05-1.6 of the transposed form's (a GEMM kernel's blocking
against what is nearly a GEMV). So a packed layer times all three only at up to
``PACKED_TIMED_ROWS`` rows and runs the packed product untimed above: a trial costs ~80-100 ms of
the first requests that bring its row count (three forms, and the peers' packed copies made for it
and dropped after), and with trials at every row count from 1 to 64 the suite's eight one-adapter
decoding processes, whose batches bring row counts 1-8 and the prefills' larger ones during the
measurement, made x0.60 of eight HF processes' tokens/s against x1.02 with no trials at all.

``SYMBIOSIS_TUNE_MATMUL=0`` (read at import; ``symbiosis serve --no-tune-matmul`` sets it) turns
tuning off: every product runs the first form, bit for bit ``nn.Linear``'s -- or, on a layer
with a packed copy, the packed form.
"""

from __future__ import annotations

import enum
import os
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch

from symbiosis.executor.packed_weights import WEIGHT_PACKING, reorder
from symbiosis.executor.packed_weights import linear as packed_linear

TUNE_VARIABLE = "SYMBIOSIS_TUNE_MATMUL"
#: Products of more rows always run the first form (training-sized: see the module doc).
LARGEST_TUNED_ROWS = 64
#: A layer with a packed copy times its forms only up to this many rows (module doc).
PACKED_TIMED_ROWS = 2
#: Times each form is timed in a trial (alternating), and weights of the shape each time covers.
ROUNDS = 5
PEERS = 4
#: The second form is kept only when its fastest times sum to under this fraction of the first's.
MARGIN = 0.9


class Form(enum.Enum):
    """How a forward product is written (module doc)."""

    ROWS_BY_WEIGHT = "rows @ weight.T"  # nn.Linear's
    WEIGHT_BY_ROWS = "(weight @ rows.T).T"
    PACKED = "oneDNN linear, packed weight"  # ``packed_weights.py``; only where the layer has a packed copy


def timed_rows(packed: torch.Tensor | None) -> int:
    """The most rows whose forms are timed: ``PACKED_TIMED_ROWS`` for a layer with a packed copy,
    ``LARGEST_TUNED_ROWS`` for one without (module doc)."""
    return _timed_rows(packed is not None)


def _timed_rows(packed: bool) -> int:
    return PACKED_TIMED_ROWS if packed else LARGEST_TUNED_ROWS


def _enabled_by_environment() -> bool:
    return os.environ.get(TUNE_VARIABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def forward(
    form: Form,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: torch.Tensor,
    out: torch.Tensor | None = None,
    weight_t: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rows @ weight.T (+ bias)`` written as ``form``; into ``out`` when given (a contiguous
    tensor of the result's shape that the caller checked). ``weight_t``: ``weight.t()`` if the
    caller keeps one (making the view is a torch call). ``packed``: the weight packed for
    ``Form.PACKED`` (``packed_weights.py``)."""
    if form is Form.PACKED:
        result = packed_linear(rows, packed, bias)
        return result if out is None else out.copy_(result)
    if form is Form.ROWS_BY_WEIGHT:
        weight_t = weight.t() if weight_t is None else weight_t
        if bias is None:
            return rows @ weight_t if out is None else torch.mm(rows, weight_t, out=out)
        return torch.addmm(bias, rows, weight_t) if out is None else torch.addmm(bias, rows, weight_t, out=out)
    n = rows.shape[0]
    # One row is given twice: a single column would make this a gemv again (module doc).
    columns = rows.t() if n > 1 else rows.expand(2, -1).contiguous().t()
    product = torch.mm(weight, columns) if bias is None else torch.addmm(bias.unsqueeze(1), weight, columns)
    result = product.t() if n > 1 else product[:, :1].t()
    return result.contiguous() if out is None else out.copy_(result)


def last_level_cache_bytes(default: int = 32 << 20) -> int:
    """The CPU's largest cache (Linux's sysfs), or ``default`` where it cannot be read."""
    for index in (3, 2):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        except ValueError:
            continue
    return default


class MatmulForms:
    """The form each (shape, row count) runs, timed on first use (module doc). Thread-safe: a
    decided form is read without a lock; trials run one at a time."""

    def __init__(self, enabled: bool | None = None, cache_bytes: int | None = None) -> None:
        self.enabled = _enabled_by_environment() if enabled is None else enabled
        self._clock = time.perf_counter
        self._cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
        self._chosen: dict[tuple, Form] = {}
        self._weights: dict[int, weakref.ref] = {}  # id -> every weight offered, as loaded
        self._trial_lock = threading.Lock()
        self.trials = 0  # how many trials ran (tests, stats)

    def remember(self, weights: Iterable[torch.Tensor]) -> None:
        """Offer a model's weights for trials: peers of a shape are timed in turn, the others are
        read between turns when the model is larger than the cache, as serving it reads them."""
        self._weights = {key: ref for key, ref in self._weights.items() if ref() is not None}  # ids are reused
        for weight in weights:
            if weight.device.type == "cpu" and weight.dim() == 2 and id(weight) not in self._weights:
                self._weights[id(weight)] = weakref.ref(weight)

    def form(
        self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, packed: torch.Tensor | None = None
    ) -> Form:
        """The form a forward of ``rows`` rows against ``weight`` runs (trying each if not known).
        ``packed``: the layer's packed copy, if it has one: then ``Form.PACKED`` is a candidate up
        to ``PACKED_TIMED_ROWS`` rows and runs untimed above (and with tuning off)."""
        if not self.enabled or rows > timed_rows(packed) or rows < 1 or weight.device.type != "cpu":
            return Form.ROWS_BY_WEIGHT if packed is None else Form.PACKED
        key = _key(weight, bias, rows, packed is not None)
        chosen = self._chosen.get(key)
        if chosen is None:
            with self._trial_lock:
                chosen = self._chosen.get(key)
                if chosen is None:
                    chosen = self._chosen[key] = self._trial(weight, bias, rows, packed)
                    self.trials += 1
        return chosen

    def warm_up(
        self,
        weights: Iterable[tuple[torch.Tensor, torch.Tensor | None, bool]],
        most_rows: int,
        unpacked_too: bool = False,
    ) -> int:
        """Decide now the forms of forwards of 1 to ``most_rows`` rows against each shape of
        ``weights`` -- (weight, bias, whether its layer may have a packed copy) -- rather than on
        the first request of each size: a trial then runs on the thread serving that request, and
        every client waits behind it (``symbiosis serve`` calls this before it says ready; see
        ``BaseExecutor.warm_up``). A packed layer's trial uses a packed copy made for it and
        dropped after, as its peers' are: the layers pack their own on their first forward, so
        warming up a shape no client asks for costs no memory. ``unpacked_too``: also the forms
        of a packable shape's layers left unpacked (past the packing budget). Returns how many
        trials ran. Keys carry the calling thread's torch thread count: call it in the thread, or
        with the count, the products will run with."""
        if not self.enabled:
            return 0
        trials = self.trials
        for weight, bias, packable in weights:
            if weight.device.type != "cpu":
                continue
            packs = packable and WEIGHT_PACKING.applies_to(weight)
            for packed_flag in (True, False) if packs and unpacked_too else (packs,):
                rows = range(1, min(most_rows, _timed_rows(packed_flag)) + 1)
                if all(_key(weight, bias, n, packed_flag) in self._chosen for n in rows):
                    continue  # decided before (this shape came already): no packed copy made for nothing
                packed = reorder(weight) if packed_flag else None
                for n in rows:
                    self.form(weight, bias, n, packed)
        return self.trials - trials

    def trial_weights(self, weight: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The weights a trial for ``weight``'s shape times (it first, then up to ``PEERS - 1``
        others of its shape), and those it reads between turns: serving a model larger than the
        cache reads every other weight between two products of one layer, so each timed weight
        should come from memory; a model that fits is served from the cache, and timed so."""
        # One tensor per memory: a group of a whole block is a view of the block's matrix, which
        # is remembered too, and timing it twice as two peers would time the second from the cache.
        seen = {(weight.data_ptr(), tuple(weight.shape))}
        alive = []
        for ref in list(self._weights.values()):
            w = ref()
            if w is not None and (w.data_ptr(), tuple(w.shape)) not in seen:
                seen.add((w.data_ptr(), tuple(w.shape)))
                alive.append(w)
        same = [w for w in alive if w.shape == weight.shape and w.dtype == weight.dtype]
        timed = [weight, *same[: PEERS - 1]]
        evict: list[torch.Tensor] = []
        if sum(_nbytes(w) for w in alive) + _nbytes(weight) > self._cache_bytes:
            budget = 2 * self._cache_bytes
            for w in alive:
                if budget <= 0:
                    break
                if all(w is not t for t in timed):
                    evict.append(w)
                    budget -= _nbytes(w)
        return timed, evict

    def _trial(
        self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, packed: torch.Tensor | None = None
    ) -> Form:
        timed, evict = self.trial_weights(weight)
        inputs = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(weight.dtype)
        forms = list(Form) if packed is not None else [Form.ROWS_BY_WEIGHT, Form.WEIGHT_BY_ROWS]
        # The peers' packed copies for this trial only (a layer packs its own on its first forward).
        packs = None if packed is None else [packed] + [reorder(w) for w in timed[1:]]
        # Per form, each timed weight's fastest product over the rounds: another process that
        # takes a core mid-product only ever adds time, so the fastest is the product's own cost
        # (a median or a sum of whole passes took that noise for a difference: on a host busy with
        # clients, servers started side by side chose differently and ran 20-30% apart).
        fastest: dict[Form, list[float]] = {form: [float("inf")] * len(timed) for form in forms}
        with torch.no_grad():
            for form in forms:  # one untimed pass each: first-call costs (allocations, OpenMP start)
                forward(form, weight, bias, inputs, packed=packed)
            for _ in range(ROUNDS):
                for form in forms:
                    for w in evict:
                        w.sum()
                    seconds = self._time_pass(form, timed, bias, inputs, packs)
                    fastest[form] = [min(a, b) for a, b in zip(fastest[form], seconds)]
        totals = {form: sum(fastest[form]) for form in forms}
        best = min(forms[1:], key=totals.__getitem__)
        return best if totals[best] < MARGIN * totals[Form.ROWS_BY_WEIGHT] else Form.ROWS_BY_WEIGHT

    def _time_pass(
        self,
        form: Form,
        weights: list[torch.Tensor],
        bias: torch.Tensor | None,
        inputs,
        packs: list[torch.Tensor] | None = None,
    ) -> list[float]:
        """Seconds ``form``'s product takes with each of ``weights`` (``packs``: their packed
        copies, for ``Form.PACKED``; tests replace this)."""
        spent = []
        for i, w in enumerate(weights):
            packed = packs[i] if packs is not None else None
            began = self._clock()
            forward(form, w, bias, inputs, packed=packed)
            spent.append(self._clock() - began)
        return spent

    def chosen(self) -> dict[str, int]:
        """How many (shape, row count) pairs run each form so far (stats; past the tuned row
        counts a packed layer runs ``Form.PACKED`` untimed and uncounted)."""
        counts = {form.value: 0 for form in Form}
        for form in list(self._chosen.values()):
            counts[form.value] += 1
        return counts


def _key(weight: torch.Tensor, bias: torch.Tensor | None, rows: int, packed: bool) -> tuple:
    """What a form is decided for: the weight's shape and dtype, bias or not, the row count, the
    calling thread's torch thread count, and whether the product runs against a packed copy."""
    return (tuple(weight.shape), weight.dtype, bias is not None, rows, torch.get_num_threads(), packed)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


#: The process's forms: the choice is a fact of this host and these shapes, shared by every
#: executor in the process (so two executors give the same bits).
MATMUL_FORMS = MatmulForms()

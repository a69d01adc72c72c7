"""CpuExpertRunner: runs the cpu/ expert kernels on the ExpertStore off the calling thread.

    handle = runner.submit(layer, expert_ids, token_rows, route_weights, x)   # returns at once
    y = runner.sync(handle)                                                   # [T, H] f32

y = Σ over listed experts of weight * down(silu(gate(x_rows)) * up(x_rows)), scattered into the
token rows (untouched rows are 0).  One background thread hands each call to Numba's thread pool:
by default `cpu.dataflow.experts_dataflow` (one parallel region; `threads` parts claim the
call's gate|up units and then its (expert, H-tile) down units from one counter, a down unit
waiting only for its own expert), or with schedule='phases' `cpu.expert.experts_parallel` (two
regions: all gate|up units, a barrier, then all H-tiles).
The kernels release the GIL, so the thread that submitted keeps running Python/GPU work meanwhile,
and there is one dispatch per call (a pool of Python workers dispatching each phase under the GIL
measured half the speed at 16 threads on the H200 host).  Each output element is computed by one
unit in a fixed order, so the result does not depend on the thread count.  The pool's idle threads
sleep rather than spin (set_pool_wait, HYBRID_CPU_WAIT=passive|spin|spin:<us>); with spin:<us> the
workers and the lead thread stay awake <us> after each call, then sleep.  With join (HYBRID_CPU_JOIN=1)
sync() runs the call's still unclaimed dataflow units on the calling thread before it waits.

Small calls (a decode step's few experts: at most `inline_bytes` of packed weights) skip the pool:
submit only prepares them and sync runs both phases on the calling thread, as one part would
(the same numbers). Handing work to the pool and back costs more than such a call computes, and
running it in sync keeps the overlap with what the caller does between submit and sync (the GPU's
hits are launched by then).

Legend: T tokens, H hidden, I intermediate, E listed experts, P = Σ_e rows of expert e.
"""
from __future__ import annotations

import functools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
from numba import njit

from hybrid.errors import HybridError
from hybrid.hardware import physical_cores
from hybrid.switches import env_flag
from cpu.dataflow import (LINE as LINE_I64, PF_NEXT, dataflow_part, dataflow_prepare, experts_dataflow,
                          experts_dataflow_on, spin_while_equal)
from cpu.expert import experts_forward, experts_parallel
from cpu.i16 import PREFETCH

log = logging.getLogger("hybrid.experts")
POOL_WAIT_ENV = "HYBRID_CPU_WAIT"
POOL_WAITS = {"passive": "PASSIVE", "spin": None}     # -> OMP_WAIT_POLICY (None: libgomp's default)
SCHEDULE_ENV = "HYBRID_CPU_SCHEDULE"
JOIN_ENV = "HYBRID_CPU_JOIN"
SCHEDULES = ("phases", "dataflow")                      # cpu/expert.py experts_parallel, cpu/dataflow.py
DEFAULT_SCHEDULE = "dataflow"


def default_schedule() -> str:
    """The schedule a runner built without one uses: $HYBRID_CPU_SCHEDULE, else DEFAULT_SCHEDULE."""
    return (os.environ.get(SCHEDULE_ENV) or DEFAULT_SCHEDULE).strip().lower()


def schedule_kernel(schedule: str, prefetch: tuple[int, int] = (PREFETCH, PF_NEXT)):
    """-> f(qkind, arena, gu_off, dn_off, scl, x, rows, ptr, w, out, H, I, R, n, scr=None) running a
    call on Numba's pool (scr: dataflow's scratch from cpu/dataflow.py dataflow_prepare, for a
    call that another thread joins; None: experts_dataflow makes it inside the region).  prefetch (dataflow only): (bytes ahead, what to prefetch near a unit's end:
    cpu/dataflow.py PF_ON | PF_STOP | PF_NEXT)."""
    if schedule == "phases":
        return lambda *args, scr=None: experts_parallel(*args)
    dist, mode = int(prefetch[0]), int(prefetch[1])

    def run(qk, arena, gu, dn, scl, x, rows, ptr, w, out, H, I, R, n, scr=None):
        if scr is None:                       # the call's scratch made inside the region (as measured before join)
            experts_dataflow(qk, arena, gu, dn, scl, x, rows, ptr, w, out, H, I, R, n, dist, mode)
        else:
            experts_dataflow_on(qk, arena, gu, dn, scl, x, rows, ptr, w, out, H, I, R, n, dist, mode, scr)
    return run


def set_pool_wait(mode: str | None = None) -> str:
    """How the threads of Numba's OpenMP pool wait at the phase barrier and between calls; must run
    before the pool starts (GNU OpenMP reads it once, when Numba loads its libgomp at the first
    parallel launch; torch loads its own copy, which this leaves alone):
        passive    sleep at once (OMP_WAIT_POLICY=PASSIVE); the default
        spin       libgomp's default: spin GOMP_SPINCOUNT (300000) pause loops, then sleep
        spin:<us>  spin about <us> microseconds, then sleep: GOMP_SPINCOUNT = <us> / the time of
                   one `pause` on this CPU (measured here: ~30-45 ns on recent x86, ~3-10 ns on
                   older), so a pool kept busy by back-to-back calls (a decode layer every ~100 us)
                   finds its workers awake, and an idle one sleeps after <us>
    mode None: $HYBRID_CPU_WAIT, else passive.  OMP_WAIT_POLICY / GOMP_SPINCOUNT already in the
    environment win.  Returns the setting that applies, in words.  libgomp spins only 100 pauses
    (its throttled count) while it manages more threads than there are CPUs, e.g. two 16-thread
    teams (two runners, or a runner and the caller's own parallel calls) on 16 CPUs.  Why passive
    by default: a spinning waiter takes the CPU from the thread still working wherever cores are
    time-sliced or oversubscribed (the runner's threads share the cores with the thread driving the
    GPUs); on the 2-vCPU dev VM 2-thread calls with spinning waiters fell to 0.15-0.6x one thread
    at times (results/cpu_kernels.md)."""
    import numba.np.ufunc.parallel as npar

    mode = (mode or os.environ.get(POOL_WAIT_ENV) or "passive").strip().lower()
    base, _, arg = mode.partition(":")
    us = spin_us_of(mode)
    if base not in POOL_WAITS or (arg and (base != "spin" or us is None)):
        raise HybridError(f"{POOL_WAIT_ENV}={mode!r}: expected one of {', '.join(POOL_WAITS)} or spin:<microseconds>")
    given = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ]
    if getattr(npar, "_is_initialized", False):
        return " ".join(given) or "libgomp default (Numba's pool started before the runner)"
    if given:
        return " ".join(given) + " (from the environment)"
    if us is not None:
        ns = pause_ns()
        count = max(1, int(round(us * 1000 / ns)))
        os.environ["GOMP_SPINCOUNT"] = str(count)
        return f"GOMP_SPINCOUNT={count} (spin ~{us:g} us at {ns:.1f} ns per pause, then sleep)"
    if POOL_WAITS[mode] is None:
        return "libgomp default (spin, then sleep)"
    os.environ["OMP_WAIT_POLICY"] = POOL_WAITS[mode]
    return f"OMP_WAIT_POLICY={POOL_WAITS[mode]}"


def spin_us_of(mode: str | None = None) -> float | None:
    """Microseconds of spin:<us> in mode (None: $HYBRID_CPU_WAIT), else None."""
    mode = (mode or os.environ.get(POOL_WAIT_ENV) or "passive").strip().lower()
    base, _, arg = mode.partition(":")
    return _spin_us(arg) if base == "spin" and arg else None


def _spin_us(arg: str) -> float | None:
    """'100' or '100us' -> 100.0 (microseconds, >= 0); anything else None."""
    try:
        v = float(arg[:-2] if arg.endswith("us") else arg)
    except ValueError:
        return None
    return v if 0 <= v < 1e7 else None


@functools.cache
def pause_ns(n: int = 20000) -> float:
    """ns per x86 `pause` on this CPU (the unit of libgomp's spin count), best of 5 loops of n;
    measured once per process."""
    from cpu.dataflow import pause_loop

    pause_loop(10)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        pause_loop(n)
        best = min(best, time.perf_counter() - t0)
    return max(best / n * 1e9, 0.1)


@dataclass
class Work:
    """One submitted call: the kernel inputs (see cpu/expert.py) and the hand-off state."""

    ids: np.ndarray           # i64 [E]
    rows: np.ndarray          # i64 [P]
    ptr: np.ndarray           # i64 [E + 1]
    w: np.ndarray             # f32 [P]
    x: np.ndarray             # f32 [T, H]
    out: np.ndarray           # f32 [T, H]
    slots: tuple              # gate_up offsets [E], down offsets [E], scales [E, 3]
    parts: int = 1            # parts each phase is split into (the runner's threads)
    inline: bool = False      # run by sync() on the calling thread
    scr: np.ndarray | None = None   # dataflow scratch prepared at submit (sync may join the call)
    t_submit: float = 0.0     # perf_counter at submit (hand-off timing: CpuExpertRunner.timing)
    done: threading.Event | None = None   # set by submit (run() needs none)
    error: BaseException | None = None


INLINE_BYTES = 1 << 20    # calls reading at most this many packed weight bytes run in sync()


class CpuExpertRunner:
    """Worker pool over an ExpertStore; threads default to the physical core count.
    inline_bytes: calls that read at most this many packed expert bytes run on the caller (0: never).
    wait: how the pool's idle threads wait (set_pool_wait; default passive: they sleep).
    schedule: how a pooled call's units are run: 'phases' (two parallel regions, a barrier
    between gate|up and down) or 'dataflow' (one region, no barrier); default $HYBRID_CPU_SCHEDULE,
    else DEFAULT_SCHEDULE ('dataflow': 1.09-1.15x 'phases' at M = 1 and 0.93-1.12x at M = 8 with
    16 threads on the H200 host, results/cpu_kernels_h200.md).  prefetch: see schedule_kernel.
    join: sync() runs the call's unclaimed units on the calling thread beside the pool (dataflow
    only) instead of only waiting; default $HYBRID_CPU_JOIN (1/0), else off."""

    def __init__(self, store, threads: int | None = None, inline_bytes: int = INLINE_BYTES,
                 wait: str | None = None, schedule: str | None = None, prefetch: tuple[int, int] = (PREFETCH, PF_NEXT),
                 join: bool | None = None):
        self.store = store
        self.prefetch = (int(prefetch[0]), int(prefetch[1]))
        self.schedule = (schedule or default_schedule()).strip().lower()
        if self.schedule not in SCHEDULES:
            raise HybridError(f"{SCHEDULE_ENV}={self.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        self._kernel = schedule_kernel(self.schedule, prefetch)
        self.inline_bytes = int(inline_bytes)
        self.join = (env_flag(JOIN_ENV, False) if join is None else bool(join)) \
            and self.schedule == "dataflow"
        self.threads = int(threads or physical_cores())
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._loop, daemon=True, name="cpu-experts")
        self._closed = False
        self.timing = {"calls": 0, "queue_s": 0.0, "kernel_s": 0.0,     # pooled calls: submit -> start, kernel
                       "direct_calls": 0, "direct_s": 0.0}                # run(): calls on the caller, their time
        self._teams: set[int] = set()                 # threads whose Numba team is sized (_own_team)
        self.wait = set_pool_wait(wait)
        us = spin_us_of(wait)
        self.spin_pauses = 0 if not us else max(1, int(us * 1000 / pause_ns()))
        self._bell = np.zeros(LINE_I64, np.int64)     # submits so far (the lead thread spins on it)
        log.debug("cpu experts: %d threads, pool waiters: %s", self.threads, self.wait)
        self._warm_up()
        self._worker.start()

    # --------------------------------------------------------------------- public
    def submit(self, layer: int, expert_ids, token_rows, route_weights, x: np.ndarray) -> Work:
        """expert_ids list[int] [E], token_rows list of int arrays, route_weights list of f32 arrays,
        x [T, H] f32 -> handle.  (Also accepted: flat [A] arrays of (expert, token, weight) pairs.)"""
        work = self._prepare(layer, expert_ids, token_rows, route_weights, x, self.join)
        work.done = threading.Event()
        work.t_submit = time.perf_counter()
        if work.inline:
            return work
        if work.rows.shape[0] == 0:
            work.done.set()
        else:
            self._queue.put(work)
            self._bell[0] += 1            # after the put: a lead thread spinning on the bell finds the work
        return work

    def run(self, layer: int, expert_ids, token_rows, route_weights, x: np.ndarray) -> np.ndarray:
        """submit + sync with no hand-off: the call runs on the calling thread's own Numba team
        (`threads` parts; GIL released), for a caller that would only wait (a graphed can-miss
        layer: its hits already run on the card). Saves the two thread wake-ups of a pooled call
        (worker, then caller); the same numbers as submit/sync -> out [T, H] f32."""
        work = self._prepare(layer, expert_ids, token_rows, route_weights, x, False)
        if work.inline:
            self._run_all(work)
            if work.error is not None:
                raise work.error
        elif work.rows.shape[0]:
            self._own_team()
            t0 = time.perf_counter()
            self._run_parallel(work)
            self.timing["direct_calls"] += 1
            self.timing["direct_s"] += time.perf_counter() - t0
        return work.out

    def sync(self, handle: Work) -> np.ndarray:
        """Wait for a submitted call -> out [T, H] f32."""
        if handle.inline:
            handle.inline = False
            self._run_all(handle)
            handle.done.set()
        if handle.scr is not None and not handle.done.is_set():
            self._join(handle)
        handle.done.wait()
        if handle.error is not None:
            raise handle.error
        return handle.out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._worker.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --------------------------------------------------------------------- internals
    def _prepare(self, layer, expert_ids, token_rows, route_weights, x, join: bool) -> Work:
        if self._closed:
            raise RuntimeError("CpuExpertRunner is closed")
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.store.hidden:
            raise ValueError(f"x must be [T, {self.store.hidden}] f32, got {x.shape}")
        s, T = self.store, x.shape[0]
        if _is_flat(token_rows) and 0 <= layer < s.num_layers:   # one compiled pass (a decode layer's call)
            e, r, w = _flat_pairs(expert_ids, token_rows, route_weights)
            ids, rows, ptr, w, gu, dn, scl, bad = _plan_pairs(e, r, w, T, s.offsets[layer], s.scales[layer])
            if bad == 1:
                raise ValueError(f"token rows must lie in [0, {T})")
            if bad == 2:
                s.slots(layer, e)                                 # raises its IndexError
            slots = (gu, dn, scl)
        else:
            ids, rows, ptr, w = _group(expert_ids, token_rows, route_weights, T)
            slots = s.slots(layer, ids)
        return self._plan(ids, rows, ptr, w, x, slots, join)

    def _plan(self, ids, rows, ptr, w, x, slots, join: bool) -> Work:
        s = self.store
        inline = bool(rows.shape[0]) and len(ids) * s.slot_nbytes <= self.inline_bytes
        scr = (dataflow_prepare(s.qkind, x, rows, ptr, s.hidden, s.inter, s.R)
               if join and not inline and rows.shape[0] else None)
        return Work(ids, rows, ptr, w, x, np.zeros_like(x), slots, parts=self.threads, inline=inline, scr=scr)

    def _warm_up(self) -> None:
        """Compile (or load from numba's cache) both paths for these argument types, on no work."""
        s = self.store
        x = np.zeros((1, s.hidden), np.float32)
        rows, ptr, w = np.zeros(0, np.int64), np.zeros(1, np.int64), np.zeros(0, np.float32)
        gu, dn, scl = s.slots(0, [])
        if self.inline_bytes > 0:                    # the inline path (else compiled at a first use, if any)
            experts_forward(s.qkind, s.arena.array, gu, dn, scl, x, rows, ptr, w, x, s.hidden, s.inter, s.R)
        self._kernel(s.qkind, s.arena.array, gu, dn, scl, x, rows, ptr, w, x, s.hidden, s.inter, s.R, 1)
        if self.join:                                 # the joining path: prepared scratch, pool + caller
            scr = dataflow_prepare(s.qkind, x, rows, ptr, s.hidden, s.inter, s.R)
            self._kernel(s.qkind, s.arena.array, gu, dn, scl, x, rows, ptr, w, x, s.hidden, s.inter, s.R, 1, scr=scr)
            dataflow_part(s.qkind, s.arena.array, gu, dn, scl, x, rows, ptr, w, x, s.hidden, s.inter, s.R,
                          self.prefetch[0], self.prefetch[1], scr)
        _group_pairs(rows, rows, w, 1)
        _plan_pairs(rows, rows, w, 1, s.offsets[0], s.scales[0])

    def _own_team(self) -> None:
        """Size the calling thread's Numba team (a per-thread setting) for this runner's parts, once
        per thread. A second OpenMP team beside the pool's: its threads sleep (passive) while the
        pool runs, and the pool's while it runs."""
        me = threading.get_ident()
        if me not in self._teams:
            import numba

            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
            self._teams.add(me)

    def _loop(self) -> None:
        self._own_team()
        while True:
            work = self._next()
            if work is None:
                return
            t0 = time.perf_counter()
            try:
                self._run_parallel(work)
            except BaseException as exc:        # noqa: BLE001 - handed to sync()
                work.error = exc
            finally:
                t1 = time.perf_counter()
                tm = self.timing
                tm["calls"] += 1
                tm["queue_s"] += t0 - work.t_submit
                tm["kernel_s"] += t1 - t0
                work.done.set()

    def _next(self):
        """The next submitted call.  With spin:<us> this (lead) thread first spins up to <us> on
        the submit counter, GIL released, like the pool's workers, so a call submitted soon after
        the last one starts without waking a sleeping thread."""
        if self.spin_pauses:
            seen = int(self._bell[0])                # before the queue check: a later put changes it
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                spin_while_equal(self._bell, seen, self.spin_pauses)
        return self._queue.get()

    def _run_parallel(self, work: Work) -> None:
        s = self.store
        gu, dn, scl = work.slots
        self._kernel(s.qkind, s.arena.array, gu, dn, scl, work.x, work.rows, work.ptr, work.w, work.out,
                     s.hidden, s.inter, s.R, work.parts, scr=work.scr)

    def _join(self, work: Work) -> None:
        """This thread as one more part of a pooled dataflow call: claims its units until none is
        left (all claimed: returns at once), GIL released; the pool finishes the rest."""
        s = self.store
        gu, dn, scl = work.slots
        try:
            dataflow_part(s.qkind, s.arena.array, gu, dn, scl, work.x, work.rows, work.ptr, work.w, work.out,
                          s.hidden, s.inter, s.R, self.prefetch[0], self.prefetch[1], work.scr)
        except BaseException as exc:            # noqa: BLE001 - as the pool's errors
            work.error = exc

    def _run_all(self, work: Work) -> None:
        """Both phases of the whole call on this thread (one part: the numbers of any part count)."""
        s = self.store
        gu, dn, scl = work.slots
        try:
            experts_forward(s.qkind, s.arena.array, gu, dn, scl, work.x, work.rows, work.ptr, work.w, work.out,
                            s.hidden, s.inter, s.R)
        except BaseException as exc:            # noqa: BLE001 - handed to sync()
            work.error = exc


def _is_flat(token_rows) -> bool:
    """Whether a call lists flat (expert, token row, weight) pairs ([A] int rows), not per-expert lists."""
    return isinstance(token_rows, np.ndarray) and token_rows.ndim == 1 and token_rows.dtype.kind in "iu"


def _flat_pairs(expert_ids, token_rows, route_weights):
    """Flat pairs (_is_flat) -> e i64 [A], rows i64 [A], w f32 [A]; one entry per pair or ValueError."""
    e = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
    w = np.asarray(route_weights, dtype=np.float32).reshape(-1)
    if not e.shape == token_rows.shape == w.shape:
        raise ValueError("flat expert_ids, token_rows and route_weights must have one entry per pair, "
                         f"got {e.shape[0]}, {token_rows.shape[0]}, {w.shape[0]}")
    return e, token_rows.astype(np.int64, copy=False), w


def _group(expert_ids, token_rows, route_weights, T: int):
    """-> ids i64 [E], rows i64 [P], ptr i64 [E + 1], w f32 [P] (rows of entry e: ptr[e]:ptr[e+1])."""
    if _is_flat(token_rows):                                    # [A] pairs -> grouped by expert id, ascending
        ids, rows, ptr, w, ok = _group_pairs(*_flat_pairs(expert_ids, token_rows, route_weights), T)
        if not ok:
            raise ValueError(f"token rows must lie in [0, {T})")
        return ids, rows, ptr, w
    else:
        if not len(expert_ids) == len(token_rows) == len(route_weights):
            raise ValueError("expert_ids, token_rows and route_weights must have one entry per expert")
        ids = np.asarray(expert_ids, dtype=np.int64).reshape(-1)
        counts = [len(r) for r in token_rows]
        if counts != [len(v) for v in route_weights]:
            raise ValueError(f"token rows per expert {counts} != route weights per expert "
                             f"{[len(v) for v in route_weights]}")
        rows = np.concatenate(token_rows).astype(np.int64, copy=False) if counts else np.zeros(0, np.int64)
        w = np.concatenate(route_weights).astype(np.float32, copy=False) if counts else np.zeros(0, np.float32)
    if rows.size and (rows.min() < 0 or rows.max() >= T):
        raise ValueError(f"token rows must lie in [0, {T})")
    ptr = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ids, np.ascontiguousarray(rows), ptr, np.ascontiguousarray(w)


@njit(nogil=True, cache=True)
def _group_pairs(e, r, wt, T):
    """Flat (expert e[a], token row r[a], weight wt[a]) pairs, stably sorted by expert ->
    ids [E], rows [P], ptr [E + 1], w [P], all rows in [0, T).  One compiled pass: numpy's
    argsort + unique + gathers cost ~35-50 us of Python per call, paid by every decode layer."""
    n = e.shape[0]
    order = np.argsort(e, kind="mergesort")
    ids = np.empty(n, np.int64)
    rows = np.empty(n, np.int64)
    w = np.empty(n, np.float32)
    ptr = np.zeros(n + 1, np.int64)
    E, ok = 0, True
    for i in range(n):
        j = order[i]
        rows[i], w[i] = r[j], wt[j]
        ok = ok and 0 <= r[j] < T
        if E == 0 or e[j] != ids[E - 1]:
            ids[E] = e[j]
            E += 1
        ptr[E] = i + 1
    return ids[:E].copy(), rows, ptr[:E + 1].copy(), w, ok


@njit(nogil=True, cache=True)
def _plan_pairs(e, r, wt, T, offsets, scales):
    """_group_pairs, then the listed experts' slots in one layer of the store (offsets [E_all, 2],
    scales [E_all, 3]: ExpertStore.slots' gate_up offsets [E], down offsets [E], scales [E, 3]), in
    one compiled call (the numpy gathers and checks cost a decode layer's call ~30 us of Python).
    bad: 0 ok, 1 a token row outside [0, T), 2 an expert outside the layer."""
    ids, rows, ptr, w, ok = _group_pairs(e, r, wt, T)
    n = ids.shape[0]
    gu = np.empty(n, np.int64)
    dn = np.empty(n, np.int64)
    scl = np.empty((n, 3), np.float32)
    if not ok:
        return ids, rows, ptr, w, gu, dn, scl, 1
    for i in range(n):
        x = ids[i]
        if x < 0 or x >= offsets.shape[0]:
            return ids, rows, ptr, w, gu, dn, scl, 2
        gu[i], dn[i] = offsets[x, 0], offsets[x, 1]
        for j in range(3):
            scl[i, j] = scales[x, j]
    return ids, rows, ptr, w, gu, dn, scl, 0

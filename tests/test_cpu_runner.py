"""CpuExpertRunner: submit/sync against a float64 reference, thread-count invariance, input forms."""
import numpy as np
import pytest

from cpu import expert
from hybrid.errors import HybridError
from hybrid.experts.cpu_runner import SCHEDULES, CpuExpertRunner
from hybrid.experts.store import ExpertStore
from tests.test_cpu_kernels import RTOL, rand_fp8, rand_nvfp4, ref_experts, rel_err

L, E, H, I = 2, 5, 192, 128


@pytest.fixture(scope="module", params=["nvfp4", "fp8"])
def store_and_weights(request):
    rng = np.random.default_rng(3)
    mk = rand_nvfp4 if request.param == "nvfp4" else rand_fp8
    ws = {(l, e): (mk(I, H, rng), mk(I, H, rng), mk(H, I, rng)) for l in range(L) for e in range(E)}
    s = ExpertStore.build(L, E, H, I, lambda l, e: ws[l, e], request.param, progress=False)
    yield s, ws
    s.close()


def routing(T, rng, k=3):
    """top-k routing of T tokens -> per-expert lists (expert ids, token rows, weights)."""
    choice = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)])      # [T, k]
    wt = rng.uniform(0.05, 1, size=(T, k)).astype(np.float32)
    ids = sorted(set(choice.ravel().tolist()))
    rows = [np.nonzero((choice == e).any(1))[0] for e in ids]
    wts = [wt[r, np.argmax(choice[r] == e, axis=1)] for e, r in zip(ids, rows)]
    return ids, rows, wts


@pytest.mark.parametrize("T", [1, 8, 37])
def test_runner_matches_reference(store_and_weights, T):
    s, ws = store_and_weights
    rng = np.random.default_rng(T)
    x = (rng.standard_normal((T, H)) * 20).astype(np.float32)
    ids, rows, wts = routing(T, rng)
    with CpuExpertRunner(s, threads=2) as runner:
        y = runner.sync(runner.submit(1, ids, rows, wts, x))
    ref = ref_experts({e: ws[1, e] for e in range(E)}, x, ids, rows, wts)
    assert y.dtype == np.float32 and y.shape == (T, H)
    assert rel_err(y, ref) <= RTOL


def test_thread_counts_give_the_same_result(store_and_weights):
    s, _ = store_and_weights
    rng = np.random.default_rng(11)
    x = rng.standard_normal((9, H)).astype(np.float32)
    ids, rows, wts = routing(9, rng)
    outs = []
    for sched in SCHEDULES:                            # pooled (inline_bytes=0): both schedules
        for n in range(1, 6):
            with CpuExpertRunner(s, threads=n, schedule=sched, inline_bytes=0) as runner:
                outs.append(runner.sync(runner.submit(0, ids, rows, wts, x)))
    with CpuExpertRunner(s, threads=2) as runner:     # default: small calls inline
        outs.append(runner.sync(runner.submit(0, ids, rows, wts, x)))
    for n in (1, 3):                                   # sync joins the pool as one more part
        with CpuExpertRunner(s, threads=n, inline_bytes=0, join=True) as runner:
            assert runner.join
            for _ in range(3):
                outs.append(runner.sync(runner.submit(0, ids, rows, wts, x)))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    with pytest.raises(HybridError, match="HYBRID_CPU_SCHEDULE"):
        CpuExpertRunner(s, threads=1, schedule="nope")


def test_run_on_the_caller_matches_the_pool(store_and_weights):
    """run(): the call on the calling thread's own Numba team, no hand-off; the same numbers as
    submit/sync at every thread count, inline and pooled sizes; the pool's counters untouched."""
    s, _ = store_and_weights
    rng = np.random.default_rng(17)
    for T in (1, 6):
        x = rng.standard_normal((T, H)).astype(np.float32)
        ids, rows, wts = routing(T, rng)
        with CpuExpertRunner(s, threads=2, inline_bytes=0) as runner:
            want = runner.sync(runner.submit(0, ids, rows, wts, x))
        for n in (1, 2, 3):
            for inline in (0, 1 << 30):
                with CpuExpertRunner(s, threads=n, inline_bytes=inline) as runner:
                    got = [runner.run(0, ids, rows, wts, x) for _ in range(2)]
                    assert runner.timing["calls"] == 0
                    assert runner.timing["direct_calls"] == (2 if inline == 0 else 0)
                assert all(np.array_equal(want, g) for g in got), (T, n, inline)
    with CpuExpertRunner(s, threads=2) as runner:
        assert not runner.run(1, [], [], [], np.ones((2, H), np.float32)).any()
        with pytest.raises(ValueError, match="token rows"):
            runner.run(0, [1], [np.array([2])], [np.array([1.0])], np.zeros((2, H), np.float32))


def test_timing_counts_pooled_calls_only(store_and_weights):
    s, _ = store_and_weights
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, H)).astype(np.float32)
    ids, rows, wts = routing(2, rng)
    with CpuExpertRunner(s, threads=2) as runner:                     # small call: runs inline in sync
        runner.sync(runner.submit(0, ids, rows, wts, x))
        assert runner.timing["calls"] == 0
    with CpuExpertRunner(s, threads=2, inline_bytes=0) as runner:     # every call through the pool
        for _ in range(3):
            runner.sync(runner.submit(0, ids, rows, wts, x))
        tm = runner.timing
        assert tm["calls"] == 3 and tm["kernel_s"] > 0 and tm["queue_s"] >= 0


def test_spinning_lead_thread_takes_every_call(store_and_weights):
    """wait='spin:<us>': the runner's lead thread spins on the submit counter before sleeping on the
    queue; calls submitted back to back, two before one sync, and after a pause all come back,
    equal to a passive runner's."""
    import time

    s, _ = store_and_weights
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, H)).astype(np.float32)
    ids, rows, wts = routing(3, rng)
    with CpuExpertRunner(s, threads=2, inline_bytes=0, wait="passive") as runner:
        want = runner.sync(runner.submit(0, ids, rows, wts, x))
    with CpuExpertRunner(s, threads=2, inline_bytes=0, wait="spin:30") as runner:
        assert runner.spin_pauses >= 1
        outs = [runner.sync(runner.submit(0, ids, rows, wts, x)) for _ in range(5)]
        h1, h2 = runner.submit(0, ids, rows, wts, x), runner.submit(0, ids, rows, wts, x)
        outs += [runner.sync(h2), runner.sync(h1)]
        time.sleep(0.01)                                   # past the spin: the lead thread sleeps
        outs.append(runner.sync(runner.submit(0, ids, rows, wts, x)))
    assert all(np.array_equal(want, o) for o in outs)


def test_untouched_rows_are_zero_and_flat_pairs_match(store_and_weights):
    s, _ = store_and_weights
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, H)).astype(np.float32)
    ids, rows, wts = [4, 1], [np.array([0, 3]), np.array([3])], [np.array([.5, .25], np.float32), np.array([1.0], np.float32)]
    with CpuExpertRunner(s, threads=3) as runner:
        h1 = runner.submit(1, ids, rows, wts, x)
        h2 = runner.submit(1, np.array([4, 1, 4], np.int32), np.array([0, 3, 3], np.int32),
                           np.array([.5, 1.0, .25], np.float32), x)
        y1, y2 = runner.sync(h1), runner.sync(h2)
        empty = runner.sync(runner.submit(1, [], [], [], x))
    assert not y1[[1, 2, 4, 5]].any() and y1[[0, 3]].any()
    assert rel_err(y1, y2) <= 1e-5                    # same sum, experts in another order
    assert not empty.any()


def test_bad_inputs_raise(store_and_weights):
    s, _ = store_and_weights
    x = np.zeros((2, H), np.float32)
    with CpuExpertRunner(s, threads=1) as runner:
        with pytest.raises(ValueError, match="token rows"):
            runner.submit(0, [1], [np.array([2])], [np.array([1.0])], x)
        with pytest.raises(IndexError):
            runner.submit(0, [E], [np.array([0])], [np.array([1.0])], x)
        flat = lambda e, r: (np.array(e, np.int32), np.array(r, np.int32), np.ones(len(e), np.float32))  # noqa: E731
        with pytest.raises(ValueError, match="token rows"):
            runner.submit(0, *flat([1, 2], [0, 2]), x)
        with pytest.raises(IndexError, match="out of range"):
            runner.run(0, *flat([1, E], [0, 1]), x)
        with pytest.raises(IndexError, match="out of range"):
            runner.submit(L, *flat([1], [0]), x)
        with pytest.raises(ValueError, match="one entry per pair"):
            runner.submit(0, np.array([1, 2]), np.array([0], np.int32), np.ones(2, np.float32), x)
        with pytest.raises(ValueError, match=r"\[T, 192\]"):
            runner.submit(0, [1], [np.array([0])], [np.array([1.0])], np.zeros((2, 7), np.float32))


def test_kernels_release_the_gil_and_the_pool_call_is_parallel():
    for f in (expert.experts_gate_up, expert.experts_down, expert.experts_parallel):
        assert f.targetoptions.get("nogil") is True
    assert expert.experts_parallel.targetoptions.get("parallel")


def test_pool_wait_policy_is_set_before_the_pool_starts():
    """set_pool_wait: passive by default, spin leaves libgomp's default, the environment wins, a bad
    value is one clear error; in a fresh process Numba's libgomp then reports the policy."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import ctypes, os
        from hybrid.errors import HybridError
        from hybrid.experts.cpu_runner import set_pool_wait
        for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "HYBRID_CPU_WAIT"):
            os.environ.pop(k, None)
        print(set_pool_wait("spin"), "|", os.environ.get("OMP_WAIT_POLICY"))
        os.environ["GOMP_SPINCOUNT"] = "1000"
        print(set_pool_wait(), "|", os.environ.get("OMP_WAIT_POLICY"))
        del os.environ["GOMP_SPINCOUNT"]
        try:
            set_pool_wait("busy")
        except HybridError as e:
            print("error:", e)
        print(set_pool_wait(), "|", os.environ.get("OMP_WAIT_POLICY"))
        del os.environ["OMP_WAIT_POLICY"]
        print(set_pool_wait("spin:200"), "|", os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
        for bad in ("spin:x", "passive:5", "spin:-1"):
            try:
                set_pool_wait(bad)
            except HybridError as e:
                print("error:", e)
        del os.environ["GOMP_SPINCOUNT"]
        print(set_pool_wait(), "|", os.environ.get("OMP_WAIT_POLICY"))
        from numba import njit, prange
        @njit(parallel=True)
        def f(n):
            s = 0
            for i in prange(n):
                s += i
            return s
        f(10)
        print(set_pool_wait("spin"), flush=True)
        gomp = ctypes.CDLL("libgomp.so.1")
        if hasattr(gomp, "omp_display_env"):
            gomp.omp_display_env(0)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stderr
    assert lines[0] == "libgomp default (spin, then sleep) | None"
    assert lines[1] == "GOMP_SPINCOUNT=1000 (from the environment) | None"
    assert lines[2].startswith("error: HYBRID_CPU_WAIT='busy': expected one of passive, spin")
    assert lines[3] == "OMP_WAIT_POLICY=PASSIVE | PASSIVE"
    spin = lines[4].split(" | ")                              # spin:200 -> a spin count of ~200 us of pauses
    count = int(spin[1].split()[1])
    assert spin[0].startswith(f"GOMP_SPINCOUNT={count} (spin ~200 us at ") and spin[1].startswith("None ")
    assert count >= 1
    for line in lines[5:8]:
        assert line.startswith("error: HYBRID_CPU_WAIT=") and "spin:<microseconds>" in line
    assert lines[8] == "OMP_WAIT_POLICY=PASSIVE | PASSIVE"
    assert lines[9] == "OMP_WAIT_POLICY=PASSIVE"            # pool started: reports, changes nothing
    if "OMP_WAIT_POLICY =" in r.stderr:                      # libgomp >= 11 lists its settings
        assert "OMP_WAIT_POLICY = 'PASSIVE'" in r.stderr


def test_flat_pairs_grouping_matches_numpy():
    """The compiled grouping of flat (expert, row, weight) pairs = stable argsort + unique + gathers."""
    from hybrid.experts.cpu_runner import _group
    rng = np.random.default_rng(9)
    for n in (0, 1, 8, 64, 300):
        e = rng.integers(0, 40, n).astype(np.int32)
        r = rng.integers(0, 9, n).astype(np.int32)
        w = rng.random(n).astype(np.float32)
        order = np.argsort(e.astype(np.int64), kind="stable")
        ids, counts = np.unique(e[order], return_counts=True)
        ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        got = _group(e, r, w, 9)
        for a, b in zip(got, (ids.astype(np.int64), r[order].astype(np.int64), ptr, w[order])):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    with pytest.raises(ValueError, match="one entry per pair"):
        _group(np.array([1, 2]), np.array([0]), np.array([1.0, 1.0]), 4)


def test_flat_plan_matches_grouping_and_store_slots(store_and_weights):
    """A call of flat pairs is planned in one compiled pass (_plan_pairs): the same grouping and the
    same gate_up / down offsets and scales as _group + ExpertStore.slots, on every layer."""
    from hybrid.experts.cpu_runner import _group

    s, _ = store_and_weights
    rng = np.random.default_rng(21)
    with CpuExpertRunner(s, threads=1, inline_bytes=0) as runner:
        for layer in range(L):
            for n in (1, 8, 40):
                e = rng.integers(0, E, n)
                r = rng.integers(0, 5, n)
                w = rng.random(n).astype(np.float32)
                x = rng.standard_normal((5, H)).astype(np.float32)
                work = runner._prepare(layer, e, r, w, x, False)
                ids, rows, ptr, wt = _group(e, r, w, 5)
                for a, b in zip((work.ids, work.rows, work.ptr, work.w), (ids, rows, ptr, wt)):
                    assert a.dtype == b.dtype and np.array_equal(a, b)
                for a, b in zip(work.slots, s.slots(layer, ids)):
                    assert a.dtype == b.dtype and np.array_equal(a, b)

"""The CPU half of the expert split: a runner with submit(...) -> handle, sync(handle) -> [T, H].

Legend: T tokens, H hidden, A (token, expert) pairs that missed the cache.
Quantized checkpoints use hybrid.experts.cpu_runner.CpuExpertRunner (Numba kernels over the
hugepage-backed ExpertStore of every expert); dense checkpoints, or `--cpu-engine torch`, use
TorchCpuRunner: the same interface over the reference linear path, run in sync() on the calling
thread (after the GPU's hits are launched, so they still overlap; see the class for why no worker).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from hybrid.errors import HybridError
from hybrid.model.linear import Linear
from hybrid.model.moe import SwiGLU, expert_sum

INLINE_BYTES = 1 << 20    # TorchCpuRunner: calls over at most this many stored expert bytes keep
                          # the caller's torch threads
KEEP_BYTES = 1 << 30      # TorchCpuRunner: stored expert bytes kept after the first read


class _Deferred:
    """A submitted TorchCpuRunner call; sync() runs it on the calling thread."""

    def __init__(self, args: tuple):
        self.args = args


class TorchCpuRunner:
    """Reference CPU expert runner; get_expert(layer, e) -> (gate, up, down) QWeight.

    Calls run in sync() on the calling thread, after the caller launched its hits (so a GPU still
    overlaps them), never on a worker thread: torch ops on a second thread start a second OpenMP
    thread team, and once it exists every OpenMP user of the process (llama.cpp's ggml shares the
    runtime) slows down severalfold on a small machine. Calls over more than `inline_bytes` of
    (stored) experts run with `threads` torch threads, the caller's count is restored after; small
    ones keep the caller's count. Experts are read from the checkpoint once and kept as stored
    (never dequantized) while they fit in `keep_bytes`."""

    def __init__(self, get_expert, threads: int | None = None, inline_bytes: int = INLINE_BYTES,
                 keep_bytes: int = KEEP_BYTES):
        self._read = get_expert
        self.threads = threads
        self.inline_bytes, self.keep_bytes = int(inline_bytes), int(keep_bytes)
        self._kept: dict = {}
        self._kept_bytes = 0

    def get_expert(self, layer: int, e: int):
        w = self._kept.get((layer, e))
        if w is None:
            w = self._read(layer, e)
            n = sum(q.nbytes for q in w)
            if self._kept_bytes + n <= self.keep_bytes:
                self._kept[(layer, e)] = w
                self._kept_bytes += n
        return w

    def submit(self, layer: int, expert_ids, token_rows, route_weights, x: np.ndarray) -> _Deferred:
        """expert_ids/token_rows/route_weights [A]; x [T, H] f32 -> handle."""
        return _Deferred((layer, np.asarray(expert_ids), np.asarray(token_rows),
                          np.asarray(route_weights, dtype=np.float32), x))

    def run(self, layer: int, expert_ids, token_rows, route_weights, x: np.ndarray) -> np.ndarray:
        """submit + sync in one call (the calls run on the calling thread anyway)."""
        return self.sync(self.submit(layer, expert_ids, token_rows, route_weights, x))

    def sync(self, handle: _Deferred) -> np.ndarray:
        layer, expert_ids = handle.args[:2]
        if not self.threads or self._small(layer, expert_ids):
            return self._run(*handle.args)
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._run(*handle.args)
        finally:
            torch.set_num_threads(before)

    def _small(self, layer: int, expert_ids: np.ndarray) -> bool:
        uniq = np.unique(expert_ids).tolist()
        return sum(q.nbytes for e in uniq for q in self.get_expert(layer, e)) <= self.inline_bytes

    def _run(self, layer, expert_ids, token_rows, route_weights, x) -> np.ndarray:
        out = expert_sum(torch.from_numpy(x), torch.from_numpy(expert_ids), torch.from_numpy(token_rows),
                         torch.from_numpy(route_weights),
                         lambda e: SwiGLU(*(Linear(w) for w in self.get_expert(layer, e))))
        return out.numpy()                                                    # [T, H] f32

    def close(self) -> None:
        self._kept.clear()


class NumbaCpuRunner:
    """Adapter over hybrid.experts (ExpertStore + CpuExpertRunner); builds the store of all experts."""

    def __init__(self, cfg, get_expert, qtype, threads: int | None, hugepages: str, progress: bool):
        from hybrid.experts.cpu_runner import CpuExpertRunner
        from hybrid.experts.store import ExpertStore

        t0 = time.perf_counter()
        self.store = ExpertStore.build(cfg.num_hidden_layers, cfg.num_experts, cfg.hidden_size,
                                       cfg.moe_intermediate_size, get_expert, qtype,
                                       hugepages=hugepages, progress=progress)
        self.build_s = time.perf_counter() - t0
        self.runner = CpuExpertRunner(self.store, threads=threads)
        self._source, self._source_tried = None, False

    def store_source(self):
        """The store pinned for the cards' DMA (hybrid.runtime.store_stage.StoreSource: prefill offload
        streams from it), registered on the first call and kept until close; None where CUDA refuses."""
        if not self._source_tried:
            from hybrid.runtime.store_stage import StoreSource

            self._source_tried = True
            self._source = StoreSource.pin(self.store)
        return self._source

    def submit(self, layer, expert_ids, token_rows, route_weights, x):
        return self.runner.submit(layer, *_pairs(expert_ids, token_rows, route_weights, x))

    def run(self, layer, expert_ids, token_rows, route_weights, x) -> np.ndarray:
        """submit + sync on the calling thread (CpuExpertRunner.run: no hand-off to the pool's thread)."""
        return self.runner.run(layer, *_pairs(expert_ids, token_rows, route_weights, x))

    def sync(self, handle) -> np.ndarray:
        return self.runner.sync(handle)

    def close(self) -> None:
        self.runner.close()
        if self._source is not None:
            self._source.close()                 # unregistered before the store's memory goes
            self._source = None


def _pairs(expert_ids, token_rows, route_weights, x) -> tuple:
    """Flat (expert, token row, weight) pairs and x as the Numba runner takes them."""
    return (np.ascontiguousarray(expert_ids, dtype=np.int64), np.ascontiguousarray(token_rows, dtype=np.int64),
            np.ascontiguousarray(route_weights, dtype=np.float32), np.ascontiguousarray(x, dtype=np.float32))


def numba_available() -> bool:
    try:
        from hybrid.experts.cpu_runner import CpuExpertRunner  # noqa: F401
        from hybrid.experts.store import ExpertStore  # noqa: F401
    except ImportError:
        return False
    return True


def make_cpu_runner(cfg, get_expert, qtype, engine: str = "auto", threads: int | None = None,
                    hugepages: str = "auto", progress: bool = False):
    """engine: auto (Numba for NVFP4/FP8 experts when available, else torch), numba, torch."""
    quantized = getattr(qtype, "is_quantized", False)
    if engine == "numba" or (engine == "auto" and quantized and numba_available()):
        if not quantized:
            raise HybridError(f"--cpu-engine numba: the experts are {qtype.name}; the Numba kernels "
                              f"take NVFP4/FP8 experts (use --cpu-engine torch)")
        if not numba_available():
            raise HybridError("--cpu-engine numba: hybrid.experts.cpu_runner is not installed")
        return NumbaCpuRunner(cfg, get_expert, qtype, threads, hugepages, progress)
    return TorchCpuRunner(get_expert, threads)

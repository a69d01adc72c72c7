"""ExpertStore: every routed expert of every layer in one arena, prepacked for the cpu/ kernels.

Arena layout: slot (layer L, expert E) at byte L*E_total*S + E*S, S = slot_nbytes, holding
gate|up tile pairs then down tiles (cpu/expert.py, cpu/layout.py); the fp32 global scales live
beside it in `scales` [L, E, 3] (gate, up, down).  The arena is backed by, in order of preference:
    hugetlb  explicit 2 MiB pages (MAP_HUGETLB) from the vm.nr_hugepages reserve
    thp      transparent hugepages (madvise(MADV_HUGEPAGE) on a 2 MiB-aligned anonymous map)
    normal   4 KiB pages
One log line (logger "hybrid.experts") says which and why.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cpu import layout
from cpu.expert import FP8, NVFP4
from hybrid.checkpoint.formats import QType
from hybrid.errors import CheckpointError, HybridError
from hybrid.hardware import detect_memory

log = logging.getLogger("hybrid.experts")

HUGE = 2 << 20
MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)   # Linux value; Python < 3.12 lacks the name
HUGEPAGE_MODES = ("auto", "on", "off")
QKIND = {QType.NVFP4: NVFP4, QType.FP8: FP8}


@dataclass
class Arena:
    """Anonymous memory of one backing kind; `array` u8 [nbytes] is a view of it."""

    array: np.ndarray
    backing: str
    why: str
    _mm: mmap.mmap | None = field(default=None, repr=False)

    def huge_fraction(self) -> float | None:
        """Share of the arena's bytes the kernel backs with 2 MiB pages now: 1.0 for hugetlb, 0.0 for
        normal pages, for thp the AnonHugePages of its mappings in /proc/self/smaps over the arena's
        size (None where smaps cannot be read). A thp arena filled while memory was short or
        fragmented (a page cache full of the checkpoint) can hold far fewer than it asked for."""
        if self.backing != "thp":
            return 1.0 if self.backing == "hugetlb" else 0.0
        lo = self.array.ctypes.data
        hi, huge, inside = lo + self.array.nbytes, 0, False
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split(None, 1)[0]
                    if "-" in head and not head.endswith(":"):
                        a, b = (int(v, 16) for v in head.split("-"))
                        inside = a < hi and b > lo
                    elif inside and head == "AnonHugePages:":
                        huge += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            return None
        return min(1.0, huge / max(1, self.array.nbytes))

    def close(self) -> None:
        self.array = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:     # a view is still alive elsewhere; the GC frees it later
                pass
            self._mm = None


# ----------------------------------------------------------------------------- system facts
def thp_mode() -> str:
    """'always' | 'madvise' | 'never' (transparent hugepages), 'never' where unknown."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0] if "[" in text else "never"


# ----------------------------------------------------------------------------- allocation paths
def alloc_hugetlb(nbytes: int) -> Arena:
    """Explicit 2 MiB hugepages; raises OSError when the reserve cannot cover nbytes."""
    size = -(-nbytes // HUGE) * HUGE
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB)
    arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
    return Arena(arr, "hugetlb", f"{size // HUGE} explicit 2 MiB hugepages (vm.nr_hugepages)", mm)


def alloc_thp(nbytes: int, why: str = "") -> Arena:
    """2 MiB-aligned anonymous map with madvise(MADV_HUGEPAGE)."""
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(mm, dtype=np.uint8)
    start = (-whole.ctypes.data) % HUGE
    mm.madvise(mmap.MADV_HUGEPAGE, start, -(-nbytes // HUGE) * HUGE)
    return Arena(whole[start: start + nbytes], "thp", why or "transparent hugepages via madvise", mm)


def alloc_normal(nbytes: int, why: str = "") -> Arena:
    """4 KiB pages; asks the kernel not to use transparent hugepages here."""
    mm = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    return Arena(np.frombuffer(mm, dtype=np.uint8, count=nbytes), "normal", why or "normal pages", mm)


def allocate(nbytes: int, hugepages: str = "auto") -> Arena:
    """Pick the backing for `--hugepages auto|on|off` (see module docstring)."""
    if hugepages not in HUGEPAGE_MODES:
        raise HybridError(f"--hugepages {hugepages!r}: expected one of {', '.join(HUGEPAGE_MODES)}")
    if hugepages == "off":
        return alloc_normal(nbytes, "--hugepages off")
    mem = detect_memory()
    need = -(-nbytes // HUGE)
    free, total = mem.hugepages_free, mem.hugepages_total
    why = f"{free} free 2 MiB hugepages < {need} needed"
    if mem.hugepage_size_bytes == HUGE and free >= need:
        try:
            return alloc_hugetlb(nbytes)
        except OSError as exc:
            why = f"MAP_HUGETLB failed ({exc.strerror})"
    if hugepages == "on":
        raise HybridError(f"--hugepages on: the expert store needs {need} 2 MiB hugepages ({why}); "
                          f"reserve them with `sysctl -w vm.nr_hugepages={total - free + need}` "
                          f"or use --hugepages auto")
    thp = thp_mode()
    if thp in ("always", "madvise"):
        return alloc_thp(nbytes, f"{why}; transparent hugepages [{thp}] via madvise")
    return alloc_normal(nbytes, f"{why}; transparent hugepages [{thp}]")


def lock_memory(arr: np.ndarray) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mlock(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(arr.nbytes)) != 0:
        err = ctypes.get_errno()
        raise HybridError(f"--mlock: locking {arr.nbytes / 2**30:.1f} GiB of experts failed "
                          f"({os.strerror(err)}); raise the limit (`ulimit -l unlimited`) or drop --mlock")


# ----------------------------------------------------------------------------- the store
@dataclass
class ExpertStore:
    """All experts, prepacked.  offsets i64 [L, E, 2] (gate_up, down byte offsets), scales f32 [L, E, 3]."""

    num_layers: int
    num_experts: int
    hidden: int
    inter: int
    qtype: QType
    arena: Arena
    offsets: np.ndarray
    scales: np.ndarray
    slot_nbytes: int
    R: int = layout.R

    def __post_init__(self) -> None:
        if self.qtype not in QKIND:
            raise HybridError(f"expert store: qtype {self.qtype} not supported (NVFP4 or FP8)")
        if self.offsets.shape != (self.num_layers, self.num_experts, 2):
            raise ValueError(f"expert store: offsets shape {self.offsets.shape} does not match "
                             f"{self.num_layers} layers x {self.num_experts} experts")

    # --------------------------------------------------------------------- construction
    @classmethod
    def build(cls, num_layers: int, num_experts: int, hidden: int, inter: int, get_expert, qtype,
              hugepages: str = "auto", mlock: bool = False, progress: bool = True,
              workers: int | None = None) -> "ExpertStore":
        """Allocate the arena and copy every expert from get_expert(layer, e) -> (gate, up, down)
        on `workers` threads (default: physical cores, at most 16)."""
        qtype, kind = _qkind(qtype)
        for name, dim in (("hidden", hidden), ("inter", inter)):
            if dim <= 0 or dim % layout.GROUP:
                raise HybridError(f"expert store: {name} size {dim} must be a positive multiple "
                                  f"of {layout.GROUP}")
        gu = 2 * layout.num_tiles(inter) * _tile_nbytes(kind, hidden)
        slot = gu + layout.num_tiles(hidden) * _tile_nbytes(kind, inter)
        n = num_layers * num_experts
        arena = allocate(n * slot, hugepages)
        log.info("expert store: %s backing for %.2f GiB (%d experts x %.2f MiB): %s",
                 arena.backing, n * slot / 2**30, n, slot / 2**20, arena.why)
        base = np.arange(n, dtype=np.int64).reshape(num_layers, num_experts) * slot
        store = cls(num_layers, num_experts, hidden, inter, qtype, arena,
                    np.stack([base, base + gu], axis=-1),
                    np.zeros((num_layers, num_experts, 3), np.float32), slot)
        try:
            store._fill(get_expert, progress, workers)
            if mlock:
                lock_memory(arena.array)
        except BaseException:
            store.close()
            raise
        if arena.backing == "thp":
            frac = arena.huge_fraction()
            log.info("expert store: %s of its %.2f GiB in 2 MiB pages after the fill",
                     "unknown" if frac is None else f"{frac:.0%}", n * slot / 2**30)
        return store

    def _fill(self, get_expert, progress: bool, workers: int | None = None) -> None:
        """Read and prepack every expert on `workers` threads (default: physical cores, at most 16;
        numpy and the safetensors reads release the GIL), a bounded window of experts in flight.
        Each expert writes only its own slot, so the arena does not depend on the thread count."""
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        from tqdm import tqdm

        from hybrid.hardware import physical_cores

        workers = workers or max(1, min(16, physical_cores()))
        jobs = [(layer, e) for layer in range(self.num_layers) for e in range(self.num_experts)]
        bar = tqdm(total=len(jobs), desc="expert store", unit="expert", disable=not progress, leave=False)
        one = lambda layer, e: self.put(layer, e, *get_expert(layer, e))  # noqa: E731
        with bar, ThreadPoolExecutor(workers, thread_name_prefix="expert-store") as ex:
            window: deque = deque()  # consumed in submission order: the first error is the first expert's
            try:
                for job in jobs:
                    window.append(ex.submit(one, *job))
                    if len(window) >= 2 * workers:
                        window.popleft().result()
                        bar.update()
                while window:
                    window.popleft().result()
                    bar.update()
            except BaseException:
                for f in window:
                    f.cancel()
                raise

    def put(self, layer: int, e: int, gate, up, down) -> None:
        """Prepack one expert's (gate [I, H], up [I, H], down [H, I]) QWeights into its slot."""
        H, I = self.hidden, self.inter
        for w, shape, role in ((gate, (I, H), "gate"), (up, (I, H), "up"), (down, (H, I), "down")):
            if w.qtype is not self.qtype or tuple(w.shape) != shape:
                raise CheckpointError(f"layer {layer} expert {e} {role} ({w.name or '?'}): expected "
                                      f"{self.qtype.value} {shape}, got {w.qtype.value} {tuple(w.shape)}")
        gu0, dn0 = self.offsets[layer, e]
        nti = layout.num_tiles(I)
        pairs = self.arena.array[gu0:dn0].reshape(nti, 2, -1)                 # [NTI, 2, tile]
        pairs[:, 0] = self._pack(gate).reshape(nti, -1)
        pairs[:, 1] = self._pack(up).reshape(nti, -1)
        self._pack(down, self.arena.array[dn0: gu0 + self.slot_nbytes])
        self.scales[layer, e] = [_global_scale(w) for w in (gate, up, down)]

    def _pack(self, w, out=None) -> np.ndarray:
        data = _u8(w.data)
        if self.qtype is QType.NVFP4:
            return layout.pack_nvfp4(data, _u8(w.scale), out)
        return layout.pack_fp8(data, out)

    # --------------------------------------------------------------------- queries
    @property
    def backing(self) -> str:
        return self.arena.backing

    @property
    def nbytes(self) -> int:
        return int(self.arena.array.nbytes)

    @property
    def qkind(self) -> int:
        return QKIND[self.qtype]

    def slots(self, layer: int, expert_ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> gate_up offsets i64 [E], down offsets i64 [E], scales f32 [E, 3] for the listed experts."""
        ids = np.asarray(expert_ids, dtype=np.int64)
        if not 0 <= layer < self.num_layers or (ids.size and (ids.min() < 0 or ids.max() >= self.num_experts)):
            raise IndexError(f"expert store: layer {layer} experts {ids.tolist()} out of range "
                             f"({self.num_layers} layers x {self.num_experts} experts)")
        off = self.offsets[layer, ids]
        return (np.ascontiguousarray(off[:, 0]), np.ascontiguousarray(off[:, 1]),
                np.ascontiguousarray(self.scales[layer, ids]))

    def close(self) -> None:
        self.arena.close()


def _qkind(qtype) -> tuple[QType, int]:
    """QType or its name ('nvfp4', 'FP8', ...) -> (QType, kernel kind); HybridError otherwise."""
    try:
        q = qtype if isinstance(qtype, QType) else QType(str(qtype).lower())
    except ValueError:
        q = None
    if q not in QKIND:
        raise HybridError(f"expert store: qtype {qtype!r} not supported (nvfp4 or fp8)")
    return q, QKIND[q]


def _tile_nbytes(kind: int, k: int) -> int:
    """Bytes of one R-row tile with k in-features (cpu/layout.py)."""
    return layout.nvfp4_nbytes(layout.R, k) if kind == NVFP4 else layout.fp8_nbytes(layout.R, k)


def _u8(t) -> np.ndarray:
    """torch (u8 or float8 bits) or numpy -> u8 numpy view, on the CPU, no copy where possible."""
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype != torch.uint8:
            t = t.view(torch.uint8)
        return t.numpy()
    return np.asarray(t).view(np.uint8)


def _global_scale(w) -> float:
    s = w.scale_2 if w.qtype is QType.NVFP4 else w.scale
    return float(s) if s is not None else 1.0

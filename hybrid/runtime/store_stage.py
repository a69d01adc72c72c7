"""Prefill offload from the CPU expert store: the arena pinned for the cards' DMA, slots copied up as
stored and put back into the checkpoint's byte layout on the card (what hybrid.runtime.stage_pack packs).

Legend: n experts of a group, S the store's slot bytes, H hidden, I expert intermediate, R rows per
CPU tile, NT tiles of a weight, G = K/16 groups of a row, K in-features.

Without it a streamed expert is read from the checkpoint's safetensors mmap (page cache) and copied by
host threads into pinned staging memory before its DMA. The store already holds every expert in RAM
once (hybrid.experts.store); registered with CUDA (cudaHostRegister, portable: every card), its slots
are DMA'd straight from there, with no host copy, and a model larger than the page cache can hold
beside the store is not read from disk again at each long prompt.

A slot is a permutation of the checkpoint's bytes (cpu/layout.py; the CPU kernel family of this host):
    NVFP4 int16 tile  u8 [R/8, G*72]: [b, 64g + 32h + 4i + c] = data[8b + i, 8g + 4h + c],
                      [b, 64G + 8g + i] = scale[8b + i, g]
    NVFP4 tile        u8 [G, 9, R]: [g, j < 8, r] = RECODE[data[r, 8g + j]], [g, 8, r] = scale[r, g]
    FP8 tile          u8 [K, R]: [k, r] = data[r, k]
    slot              gate|up tile pairs [NTI, 2, tile(H)], then down tiles [NTH, tile(I)]
so `unpack` is a few strided copies (and one table lookup for the NVFP4 tile family) on the card.
The global scales come from the store's `scales`, folded as hybrid.kernels.layout.global_scale does.

    HYBRID_PREFILL_SOURCE=store|checkpoint   where streamed experts come from (default store, when
                                             the CPU runner has a pinned store); read at each layer
    HYBRID_PROMOTE_SOURCE=store|checkpoint   where an expert-cache promotion reads its expert (default
                                             store, when pinned: asynchronous on the promotion stream,
                                             no host copy); read at each promotion
    HYBRID_STAGE_KERNEL=1|0                  store slots -> QPN slots in one kernel launch (default 1;
                                             0: unpack + the torch pack; see stage_kernel_enabled)
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext

import numpy as np
import torch

from cpu import layout as cpu_layout
from cpu.expert import FP8, NVFP4_F32, NVFP4_I16
from hybrid.kernels.layout import FOLD
from hybrid.runtime.stage_pack import finish_group, pack_group
from hybrid.switches import env_choice

log = logging.getLogger("hybrid.runtime")

SOURCE_ENV = "HYBRID_PREFILL_SOURCE"
PROMOTE_ENV = "HYBRID_PROMOTE_SOURCE"
STAGE_KERNEL_ENV = "HYBRID_STAGE_KERNEL"
SOURCES = ("store", "checkpoint")
_INV_RECODE: dict = {}


def source_mode(env: str = SOURCE_ENV, default: str = "store") -> str:
    """HYBRID_PREFILL_SOURCE (or `env`, module doc); HybridError naming the variable on anything else
    (checked when a CUDA session opens, so a bad value is a one-line error before any work)."""
    return env_choice(env, SOURCES, default)


def stage_kernel_enabled() -> bool:
    """HYBRID_STAGE_KERNEL (default 1): store slots of the int16 NVFP4 tile family become QPN slots through
    cuda/qpn.cu's qpn2_stage_pack (one launch per group) instead of unpack + the table-driven torch pack
    (~40 launches); 0 restores the latter. Bit-exact (tests/test_stage_pack_emu.py, the CUDA tests);
    H200, 512-token prompt, every expert on the CPU: 3210-3558 vs 2448-2478 tok/s (results/runtime.md
    §20). HybridError naming the variable on anything but 0 or 1 (checked when a CUDA session opens)."""
    return env_choice(STAGE_KERNEL_ENV, ("0", "1"), "1", "1 (the stage-pack kernel) or 0 (unpack + torch pack)") == "1"


def promote_mode() -> str:
    """HYBRID_PROMOTE_SOURCE (module doc): 'store' (default) or 'checkpoint'. H200, 1024 slots spread
    over 48 layers, promotions every token: the host's promotion time 4.9 -> 0.3-0.4 ms per token,
    decode 196-205 vs 190-204 tok/s (results/runtime.md §20)."""
    return source_mode(PROMOTE_ENV, "store")


class StoreSource:
    """An ExpertStore's arena as a (pinned, where CUDA allows) torch view, and the layout facts to
    turn its slots back into stored bytes."""

    def __init__(self, store, pinned: bool = False):
        self.store = store
        self.arena = torch.from_numpy(store.arena.array)              # u8 [nbytes], no copy
        self.pinned = pinned
        self.kind, self.S = store.qkind, store.slot_nbytes
        self.H, self.I, self.R = store.hidden, store.inter, store.R
        self.fold = FOLD[store.qtype]
        self._scratches: dict = {}

    @classmethod
    def pin(cls, store) -> "StoreSource | None":
        """Register the store's arena with CUDA (portable: all cards); None, with one log line, where
        that fails (no CUDA, a locked-memory limit): prefill offload and promotions then read the checkpoint."""
        arr = store.arena.array
        t0 = time.perf_counter()
        try:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(arr.ctypes.data, arr.nbytes, 1)   # cudaHostRegisterPortable
        except (AssertionError, AttributeError, RuntimeError) as exc:
            log.info("expert store not pinned for the cards (%s): streamed experts come from the checkpoint", exc)
            return None
        if int(err) != 0:
            log.info("expert store not pinned for the cards (cudaHostRegister error %d): streamed "
                     "experts come from the checkpoint", int(err))
            return None
        log.info("expert store pinned for the cards' DMA (prefill offload, promotions): %.2f GiB in %.1f s",
                 arr.nbytes / 2**30, time.perf_counter() - t0)
        return cls(store, pinned=True)

    def close(self) -> None:
        """Unregister the arena (before the store unmaps it)."""
        if self.pinned:
            self.pinned = False
            torch.cuda.cudart().cudaHostUnregister(self.store.arena.array.ctypes.data)

    @property
    def gate_up_nbytes(self) -> int:
        return int(self.store.offsets[0, 0, 1] - self.store.offsets[0, 0, 0])

    def upload(self, layer: int, experts: list[int], dst: torch.Tensor) -> int:
        """Copy the experts' slots as stored into dst[:n] (u8 [>= n, S], any device; asynchronous on the
        current stream for a CUDA dst, runs of neighbouring slots in one copy) -> bytes copied."""
        base = self.store.offsets[layer, experts, 0]
        j = 0
        while j < len(experts):
            k = j + 1
            while k < len(experts) and base[k] == base[k - 1] + self.S:
                k += 1
            src = self.arena[int(base[j]): int(base[j]) + (k - j) * self.S]
            dst[j:k].view(-1).copy_(src, non_blocking=True)
            j = k
        return len(experts) * self.S

    def global_scales(self, layer: int, experts: list[int]) -> torch.Tensor:
        """f32 [n, 3] (gate, up, down) as the QPN kernels take them (layout.global_scale)."""
        s = self.store.scales[layer, experts].astype(np.float64) * self.fold
        return torch.from_numpy(s.astype(np.float32))

    def target(self, card_slots, layer: int):
        """The layer's packed slot storage on a card (CardSlots.packed) when this store can fill it (the
        same weight type), else None: the layer loads from the checkpoint."""
        packed = card_slots.packed(layer)
        return packed if packed is not None and packed.qtype is self.store.qtype else None

    def load_slot(self, slots, slot: int, layer: int, e: int, stream=None) -> None:
        """Expert e of `layer` into `slot` of QPNExpertSlots `slots` (packed storage on its device)
        from the store: upload, unpack, pack, all queued on `stream` (the card's promotion stream)
        through this source's scratch for that device; bit for bit what slots.load packs from the
        checkpoint's tensors (tests/test_store_stage.py)."""
        raw, up = self._scratch(slots, stream)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self.upload(layer, [e], up)
            self.pack_into(slots, slot, up, raw, layer, [e])

    def pack_into(self, slots, first: int, up: torch.Tensor, raw: dict, layer: int, group: list[int],
                  read_done=None) -> None:
        """The group's uploaded slots `up` [>= n, S] -> slots first..first+n-1 of QPNExpertSlots `slots`,
        on the current stream: the stage-pack kernel (HYBRID_STAGE_KERNEL=1, the int16 NVFP4 tile family
        on a card: one launch) or unpack into `raw` + the table-driven pack. read_done (a cuda Event) is
        recorded once `up` has been read (the next group's DMA may then overwrite it)."""
        n = len(group)
        gs = self.global_scales(layer, group)
        if stage_kernel_enabled() and self.kind == NVFP4_I16 and up.is_cuda:
            from hybrid.kernels.qpn import stage_pack_store

            stage_pack_store(up, slots, first, n)
            if read_done is not None:
                read_done.record(torch.cuda.current_stream(up.device))
            finish_group(slots, first, gs)
            return
        self.unpack(up, raw, n)
        if read_done is not None:
            read_done.record(torch.cuda.current_stream(up.device))
        raw["gs"][:n].copy_(gs, non_blocking=True)
        pack_group(slots, n, raw, first=first)

    def _scratch(self, slots, stream) -> tuple[dict, torch.Tensor]:
        """(stored-bytes dict of one expert, u8 [1, S]) on slots' device for `stream`, made on first use
        and kept: reused in that stream's order (two logical cards on one GPU have two streams)."""
        key = (str(slots.device), slots.qtype, id(stream))
        scr = self._scratches.get(key)
        if scr is None:
            from hybrid.runtime.prefill_stream import _raw_shapes

            raw = {k: torch.empty(sh, dtype=dt, device=slots.device)
                   for k, (sh, dt) in _raw_shapes(slots.qtype, 1, self.H, self.I).items()}
            scr = self._scratches[key] = (raw, torch.empty(1, self.S, dtype=torch.uint8, device=slots.device))
        return scr

    def unpack(self, slots: torch.Tensor, raw: dict, n: int) -> None:
        """slots u8 [n, S] (as uploaded) -> raw['d13'] [n, 2I, ...], raw['d2'] [n, H, ...] (+ 's13',
        's2' for NVFP4) in the checkpoint's byte layout, on slots' device."""
        unpack_slots(self.kind, slots[:n], self.H, self.I, self.R, raw, self.gate_up_nbytes)


def unpack_slots(kind: int, slots: torch.Tensor, H: int, I: int, R: int, raw: dict, gu_nbytes: int) -> None:
    """The module doc's inverse for n slots [n, S] into raw's first n rows (see StoreSource.unpack)."""
    n = slots.shape[0]
    nti, nth = cpu_layout.num_tiles(I), cpu_layout.num_tiles(H)
    pairs = slots[:, :gu_nbytes].view(n, nti, 2, -1)
    down = slots[:, gu_nbytes:].reshape(n, nth, -1)
    for w, (tiles, rows, k) in enumerate(((pairs[:, :, 0], I, H), (pairs[:, :, 1], I, H), (down, H, I))):
        data, scale = _weight(kind, tiles, k, R)
        d = raw["d2"][:n] if w == 2 else raw["d13"][:n, w * I:(w + 1) * I]
        d.copy_(data[:, :rows])
        if scale is not None:
            s = raw["s2"][:n] if w == 2 else raw["s13"][:n, w * I:(w + 1) * I]
            s.copy_(scale[:, :rows])


def _weight(kind: int, tiles: torch.Tensor, k: int, R: int):
    """tiles u8 [n, NT, tile bytes] of one weight -> data u8 [n, NT*R, K/2 or K] and scale u8
    [n, NT*R, K/16] (None for FP8), as strided views where the layout allows."""
    n, nt = tiles.shape[0], tiles.shape[1]
    g = k // cpu_layout.GROUP
    if kind == NVFP4_I16:
        blk = tiles.unflatten(-1, (R // 8, g * 72))                              # n t b [G*72]
        data = blk[..., :64 * g].unflatten(-1, (g, 2, 8, 4))                     # n t b g h i c
        data = data.permute(0, 1, 2, 5, 3, 4, 6).reshape(n, nt * R, k // 2)      # n t b i g h c
        scale = blk[..., 64 * g:].unflatten(-1, (g, 8)).permute(0, 1, 2, 4, 3).reshape(n, nt * R, g)
        return data, scale
    if kind == NVFP4_F32:
        t = tiles.unflatten(-1, (g, 9, R))                                        # n t g j r
        inv = _inv_recode(tiles.device)
        codes = inv[t[:, :, :, :8].long()]                                        # n t g j r
        data = codes.permute(0, 1, 4, 2, 3).reshape(n, nt * R, k // 2)            # n t r g j
        scale = t[:, :, :, 8].permute(0, 1, 3, 2).reshape(n, nt * R, g)
        return data, scale
    if kind == FP8:
        return tiles.unflatten(-1, (k, R)).transpose(-1, -2).reshape(n, nt * R, k), None
    raise ValueError(f"expert store kind {kind}: expected NVFP4 ({NVFP4_I16}, {NVFP4_F32}) or FP8 ({FP8})")


def _inv_recode(device) -> torch.Tensor:
    """u8 [256]: the NVFP4 tile family's byte -> the checkpoint's byte (cpu/layout.RECODE inverted)."""
    device = torch.device(device)
    lut = _INV_RECODE.get(device)
    if lut is None:
        inv = np.empty(256, np.uint8)
        inv[cpu_layout.RECODE] = np.arange(256, dtype=np.uint8)
        lut = _INV_RECODE[device] = torch.from_numpy(inv).to(device)
    return lut

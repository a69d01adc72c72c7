"""MissLink: the static buffers that join a graphed can-miss layer to the host and to the next graph.

Legend: H hidden, k experts per token (one decode token). For a layer whose experts are split
between its card's slots and the CPU runner, the segment graph (hybrid.runtime.graphs) ends with

    send(h, slots):  slots + h into `pack` (the router launch wrote ids and weights there already),
                     pack -> `host` (pinned) in one copy, then `event` (an external event: the host
                     waits for it, not for the whole graph);
    keep(x, y_hits): x after attention -> `xm`, the grouped kernel's sum over the hits -> `yh`.

The host then reads the row (fetch), runs the misses on the CPU while the card runs the hits, and
put()s the CPU's sum into the pinned `stage` (a host write: no launch; zeros after a layer with
misses had none). The next graph starts with combine(): `stage` -> `yc` (a copy node of that graph:
it reads what put() left there when it replays), then xm + moe_out(fp16(yh + yc)), the eager path's
very ops in its order (hits + CPU in fp32, one rounding, the residual), so the numbers do not change.
The host writes `stage` again only after the next step's event of this layer, behind that copy.

pack / host row [1, 3k + H] fp32: ids (as floats, exact below 2^24) | weights | the card's local
slot of each routed expert (-1: not in a slot; the host checks them against its cache lookup) | h.
"""
from __future__ import annotations

import numpy as np
import torch


def _event(device: torch.device):
    """(event, external): an event the graph records at its own node; torch without `external`
    gets a plain event, which step() records after the replay (the host then waits for the hits too)."""
    if device.type != "cuda":
        return None, False
    try:
        return torch.cuda.Event(external=True), True
    except TypeError:
        return torch.cuda.Event(), False


class MissLink:
    """One can-miss layer's link (see the module doc); buffers are graph-static, made once."""

    def __init__(self, k: int, hidden: int, dtype: torch.dtype, device: torch.device):
        device = torch.device(device)
        self.k, self.cuda = k, device.type == "cuda"
        f32 = dict(dtype=torch.float32)
        self.pack = torch.zeros(1, 3 * k + hidden, device=device, **f32)        # [1, 3k + H]
        self.host = torch.zeros(1, 3 * k + hidden, pin_memory=self.cuda, **f32)
        self.xm = torch.zeros(1, hidden, dtype=dtype, device=device)            # [1, H]
        self.yh = torch.zeros(1, hidden, device=device, **f32)                  # [1, H] hits
        self.yc = torch.zeros(1, hidden, device=device, **f32)                  # [1, H] CPU
        self.stage = torch.zeros(1, hidden, pin_memory=self.cuda, **f32)
        self.event, self.external = _event(device)
        self.device = device
        self._host_np, self._stage_np = self.host.numpy(), self.stage.numpy()   # views, made once
        self.dirty = False                                                      # stage != 0

    @property
    def row(self) -> torch.Tensor:
        """[1, 2k] view of pack: what the router launch writes (RouteOut.row)."""
        return self.pack[:, :2 * self.k]

    # ---- inside the graph ----------------------------------------------------------------------
    def send(self, h: torch.Tensor, slots: torch.Tensor) -> None:
        """h [1, H], slots [k] int32 (local, -1 = absent) -> the host row; the event after it."""
        k = self.k
        self.pack[:, 2 * k:3 * k].copy_(slots.view(1, k))
        self.pack[:, 3 * k:].copy_(h)
        self.host.copy_(self.pack, non_blocking=True)
        if self.external:
            self.event.record()

    def keep(self, x: torch.Tensor, y_hits: torch.Tensor | None) -> None:
        """x after attention [1, H]; the hits' sum [1, H] fp32 (None: the layer has no slots, yh stays 0)."""
        self.xm.copy_(x)
        if y_hits is not None:
            self.yh.copy_(y_hits)

    def combine(self, model, layer: int) -> torch.Tensor:
        """The layer's output x [1, H]: xm + moe_out(round(yh + yc)), as the eager path adds them."""
        self.yc.copy_(self.stage, non_blocking=self.cuda)                       # put()'s sum, at replay
        y = (self.yh + self.yc).to(self.xm.dtype)                               # hits + CPU, fp32
        h = None
        if model.layers[layer].shared is not None:                              # its shared expert reads h
            h = self.pack[:, 3 * self.k:].to(self.xm.dtype)                     # fp16 -> fp32 -> fp16: exact
        return self.xm + model.moe_out(layer, h, y)

    # ---- on the host ---------------------------------------------------------------------------
    def after_replay(self) -> None:
        """torch without external events: mark the end of the replay instead."""
        if self.cuda and not self.external:
            self.event.record(torch.cuda.current_stream(self.device))   # the layer's card, not the current one

    def fetch(self):
        """Wait for the row -> ids int64 [1, k], weights f32 [1, k], local slots int64 [1, k], h f32
        [1, H] (h a view of the pinned row: read it before the layer's next replay)."""
        if self.event is not None:
            self.event.synchronize()
        row, k = self._host_np, self.k
        return (row[:, :k].astype(np.int64), row[:, k:2 * k].copy(), row[:, 2 * k:3 * k].astype(np.int64),
                row[:, 3 * k:])

    def put(self, y: np.ndarray | None) -> None:
        """The CPU's sum of the misses [1, H] f32 into the pinned stage, which the next graph copies
        up (combine); None: no misses, the stage must read 0."""
        if y is None:
            if self.dirty:
                self._stage_np[...] = 0
                self.dirty = False
            return
        self._stage_np[...] = y
        self.dirty = True

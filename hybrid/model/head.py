"""The output head's storage at load (`hybrid-run --lm-head`): a 16/32-bit lm_head (ModelOpt's NVFP4 and FP8
exports keep it in BF16; a tied head is the embedding) quantized once to FP8 or NVFP4, so the card holding it
stores and reads 2x / 3.6x fewer bytes per token and runs it through the QPN kernels instead of a dense matmul.
A head the checkpoint already stores quantized is kept as it is.
"""
from __future__ import annotations

import torch

from hybrid.checkpoint.formats import GROUP, QType, fp8_scale, nvfp4_global_scale, quantize_fp8, quantize_nvfp4
from hybrid.checkpoint.qweight import QWeight
from hybrid.errors import HybridError

HEAD_TYPES = ("keep", "fp8", "nvfp4")
ROWS = 8192   # rows quantized at a time: the fp32 transient of one chunk, not of the whole head


def quantize_head(w: QWeight, to: str, device: torch.device | str | None = None) -> QWeight:
    """A dense head [V, H] -> the same head stored as `to` ("fp8": e4m3 with one per-tensor scale; "nvfp4":
    E2M1 codes, e4m3 scales per 16 inputs chosen for the least squared error (formats.SCALES "mse"), one global
    scale), quantized ROWS rows at a time (the same bits as one call over the whole tensor: the per-tensor scale
    comes from the whole tensor's amax first) on `device` (default: where w is; the head's card at load, where a
    GPU does it in a fraction of the host's time), the result there. "keep", or a head already stored quantized:
    w itself."""
    if to not in HEAD_TYPES:
        raise ValueError(f"lm_head type {to!r}: expected one of {', '.join(HEAD_TYPES)}")
    if to == "keep" or w.qtype.is_quantized:
        return w
    if to == "nvfp4" and w.shape[1] % GROUP:
        raise HybridError(f"--lm-head nvfp4: {w.name or 'lm_head'} has {w.shape[1]} in-features, not a multiple of "
                          f"{GROUP} (NVFP4's scale group); use fp8")
    data = w.data
    dev = data.device if device is None else torch.device(device)
    starts = range(0, data.shape[0], ROWS)
    rows = lambda i: data[i:i + ROWS].to(dev).float()  # noqa: E731
    amax = max((float(rows(i).abs().max()) for i in starts), default=0.0)
    if to == "fp8":
        scale = fp8_scale(amax)
        q = torch.cat([quantize_fp8(rows(i), scale)[0] for i in starts])
        return QWeight(QType.FP8, w.shape, q, torch.tensor(scale, dtype=torch.float32, device=dev), name=w.name)
    gs = nvfp4_global_scale(amax)
    chunks = [quantize_nvfp4(rows(i), gs, scales="mse") for i in starts]
    return QWeight(QType.NVFP4, w.shape, torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks]),
                   chunks[0][2].to(dev), name=w.name)

"""The embedding table in pinned host memory, mapped into the cards' address space.

The overlapped decode (hybrid.generate, HybridModel.enqueue) leaves the sampled id on the card, so the next
step's embedding must be looked up there with no host sync. The table stays on the host (as llama.cpp keeps
token_embd): fused_embed_rows reads the token's one row (H elements) over the bus from the registered table,
so the card never holds vocab x hidden x 2 bytes for it (622 MB for Qwen3-30B-A3B, 1.2 GB at hidden 4096:
expert-cache slots on a 16 GB card). The eager steps index the same host tensor.

    HYBRID_HOST_EMBED=1|0   1 (default): as above; 0: a copy of the table in the model dtype on the first layer's
                            card, made at load (the earlier path, for A/B runs; the planner does not count it)

Legend: V vocabulary, H hidden.
"""
from __future__ import annotations

import logging
import time
import weakref

import torch

from hybrid.kernels import driver, fused
from hybrid.switches import env_flag

log = logging.getLogger(__name__)

ENV = "HYBRID_HOST_EMBED"
CUDA_HOST_REGISTER_PORTABLE_MAPPED = 3      # cudaHostRegisterPortable | cudaHostRegisterMapped: every card reads it


def host_embed_enabled() -> bool:
    return env_flag(ENV)


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:                    # interpreter shutdown: the driver may already be gone
        pass


class HostEmbedding:
    """A [V, H] host table registered with CUDA (portable, mapped); `rows(ids, dtype)` embeds ids that live on a
    card. Made by `pin`; unregistered when this object goes (the table tensor stays valid, pageable again)."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self._ptrs: dict[int, int] = {}
        weakref.finalize(self, _unregister, table.data_ptr())

    @classmethod
    def pin(cls, table: torch.Tensor) -> HostEmbedding | None:
        """Register a host table (fp16 / bf16 / fp32, contiguous, on the CPU) in place; None, with one log line,
        where that cannot be done (no CUDA, a dtype the kernel does not read, the driver refuses)."""
        if table.device.type != "cpu" or table.dtype not in fused._EMB or not table.is_contiguous():
            log.info("embedding not pinned (%s %s on %s): the decode copies it to the card", table.dtype,
                     "contiguous" if table.is_contiguous() else "strided", table.device)
            return None
        t0 = time.perf_counter()
        try:
            err = int(torch.cuda.cudart().cudaHostRegister(table.data_ptr(), table.nbytes,
                                                           CUDA_HOST_REGISTER_PORTABLE_MAPPED))
        except (AssertionError, AttributeError, RuntimeError) as exc:
            log.info("embedding not pinned (%s): the decode copies it to the card", exc)
            return None
        if err:
            log.info("embedding not pinned (cudaHostRegister error %d): the decode copies it to the card", err)
            return None
        log.info("embedding pinned in host memory for the decode: %.2f GiB in %.2f s", table.nbytes / 2**30,
                 time.perf_counter() - t0)
        return cls(table)

    def ptr(self, device: torch.device) -> int:
        """The table's address for `device`'s kernels."""
        device = fused._dev(device)
        p = self._ptrs.get(device.index)
        if p is None:
            p = self._ptrs[device.index] = driver.mapped_ptr(self.table.data_ptr(), device)
        return p

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """ids [T] int64 on a card -> [T, H] in dtype on that card, read from the host table."""
        return fused.embed_rows(self.table, ids, dtype, table_ptr=self.ptr(ids.device))


def owned_copy(table: torch.Tensor) -> torch.Tensor:
    """table in anonymous host memory of its own (a safetensors tensor may be a view of a file mapping, which is
    not registered in place)."""
    return table.clone(memory_format=torch.contiguous_format)

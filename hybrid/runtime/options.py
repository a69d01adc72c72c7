"""RuntimeOptions: the hybrid-run flags the runtime consumes, validated in one place."""
from __future__ import annotations

from dataclasses import dataclass

from hybrid.errors import HybridError
from hybrid.model.head import HEAD_TYPES

KV_DTYPES = ("fp16", "int8")
HUGEPAGES = ("auto", "on", "off")
CPU_ENGINES = ("auto", "numba", "torch")
CACHE_WARM = ("auto", "profile", "off")
PREFILL_OFFLOAD_MIN = 128   # CUDA cards without a plan (no hardware profile known): prefill steps of >= this
                            # many tokens stream their missed experts to the card (hybrid.runtime.prefill_stream);
                            # with a plan the threshold is the planner's (hybrid.planner.prefill)


@dataclass(frozen=True)
class RuntimeOptions:
    """None means `auto` (the planner decides, or the default named in the flag's help).

    gpus: CUDA ordinal per logical card (repeat one to put two logical cards on one GPU);
    layer_split: card boundaries (len(gpus) - 1 of them); cache_slots: slots per card (one value
    or one per card); vram_cap_gib: per card; kv_resident: KV tokens each card holds;
    prefill_offload_min: prefill steps of at least this many tokens stream their missed experts to
    the card (0 = never; None = auto: see offload_min_for); cache_warm: what the expert slots hold at load
    (auto: the expert profile's most used experts, else experts in id order until the slots are full;
    profile: the profile's, else nothing; off: nothing; where nothing, the cache warms up online);
    save_expert_profile: a file the run's routing counts go to when the session closes (routing_counts);
    lm_head: the output head's storage (keep, or a 16-bit head quantized at load to fp8 / nvfp4: hybrid.model.head).
    """

    device: str = "cpu"
    gpus: tuple[int, ...] = (0,)
    layer_split: tuple[int, ...] | None = None
    kv_resident: int | None = None
    kv_dtype: str = "fp16"
    cache_slots: tuple[int, ...] | None = None
    cpu_threads: int | None = None
    hugepages: str = "auto"
    prefill_chunk: int | None = None
    pcie_frac: float = 0.1
    profile: str | None = None
    vram_cap_gib: tuple[float, ...] | None = None
    expert_profile: str | None = None
    policy: str = "lfu-decay"
    cpu_engine: str = "auto"
    trace: str | None = None
    prefill_offload_min: int | None = None
    cache_warm: str = "auto"
    save_expert_profile: str | None = None
    lm_head: str = "keep"

    def __post_init__(self) -> None:
        n = len(self.gpus)
        if self.device not in ("cpu", "cuda"):
            raise HybridError(f"--device {self.device}: expected cpu or cuda")
        if n < 1 or any(g < 0 for g in self.gpus):
            raise HybridError(f"--gpus: expected one or more indices >= 0, got {list(self.gpus)}")
        if self.layer_split is not None and len(self.layer_split) != n - 1:
            raise HybridError(f"--layer-split: {n} card(s) need {n - 1} boundary(ies), "
                              f"got {len(self.layer_split)}")
        for flag, v in (("--cache-slots", self.cache_slots), ("--vram-cap", self.vram_cap_gib)):
            if v is not None and len(v) not in (1, n):
                raise HybridError(f"{flag}: give one value or one per card ({n}), got {len(v)}")
        if self.cache_slots is not None and any(s < 0 for s in self.cache_slots):
            raise HybridError("--cache-slots must be >= 0")
        if self.vram_cap_gib is not None and any(v <= 0 for v in self.vram_cap_gib):
            raise HybridError("--vram-cap must be > 0 GB")
        if self.kv_resident is not None and self.kv_resident < 1:
            raise HybridError(f"--kv-resident must be >= 1 token, got {self.kv_resident}")
        if self.kv_dtype not in KV_DTYPES:
            raise HybridError(f"--kv-dtype {self.kv_dtype}: expected one of {', '.join(KV_DTYPES)}")
        if self.hugepages not in HUGEPAGES:
            raise HybridError(f"--hugepages {self.hugepages}: expected one of {', '.join(HUGEPAGES)}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise HybridError(f"--cpu-threads must be >= 1, got {self.cpu_threads}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise HybridError(f"--prefill-chunk must be >= 1 or auto, got {self.prefill_chunk}")
        if not 0.0 <= self.pcie_frac <= 1.0:
            raise HybridError(f"--pcie-frac must be a fraction in [0, 1], got {self.pcie_frac}")
        m = self.prefill_offload_min
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 0):
            raise HybridError(f"--prefill-offload-min must be a token count >= 0 (0 = off), got {m}")
        if self.cache_warm not in CACHE_WARM:
            raise HybridError(f"--cache-warm {self.cache_warm}: expected one of {', '.join(CACHE_WARM)}")
        if self.cpu_engine not in CPU_ENGINES:
            raise HybridError(f"--cpu-engine {self.cpu_engine}: expected one of {', '.join(CPU_ENGINES)}")
        if self.lm_head not in HEAD_TYPES:
            raise HybridError(f"--lm-head {self.lm_head}: expected one of {', '.join(HEAD_TYPES)}")

    @property
    def offload_min(self) -> int:
        """Before a plan exists: whether prefill offload may be on (> 0: the planner reserves its
        staging; with auto it gives the room back where its cost model never streams). The flag's
        value; unset: PREFILL_OFFLOAD_MIN on CUDA, never in CPU mode (the "card" is the CPU, so
        streaming only swaps the Numba kernels for the torch reference: tests ask for it explicitly)."""
        if self.prefill_offload_min is not None:
            return self.prefill_offload_min
        return PREFILL_OFFLOAD_MIN if self.device == "cuda" else 0

    def offload_min_for(self, plan) -> int:
        """The threshold the session uses: prefill steps of at least this many tokens stream their
        misses to the card; 0 = never. --prefill-offload-min N if given; else, on CUDA, the plan's
        (hybrid.planner.prefill: from the hardware profile), or PREFILL_OFFLOAD_MIN without a plan;
        never in CPU mode (see offload_min)."""
        if self.prefill_offload_min is not None or self.device != "cuda":
            return self.offload_min
        pre = getattr(plan, "prefill", None)
        return pre.offload_min if pre is not None else PREFILL_OFFLOAD_MIN

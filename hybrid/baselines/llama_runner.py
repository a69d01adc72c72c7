"""Run a GGUF through llama-cpp-python: teacher-forced logits and wall-clock-timed prefill/decode.

Settings are pinned so every engine sees the same conditions: flash attention OFF (hybrid's CPU
attention is plain softmax attention), F16 KV cache (llama.cpp's default), no BOS insertion (the
caller feeds exact token ids), one batch per chunk. llama.cpp computes synchronously on CPU, so
`time.perf_counter()` around `eval` is a synchronized wall clock (on CUDA too: `eval` returns after
the logits are on the host).

GPU offload: `n_gpu_layers=-1` puts every layer on the GPU; `cpu_experts=True` (or a regex) keeps the
tensors it matches (llama.cpp's `--cpu-moe` pattern by default) on the CPU, as `-ot exps=CPU` does
(hybrid.baselines.llama_offload). `load_log` keeps what llama.cpp said about the placement.

Extra buffer types (llama.cpp's repacked CPU weight layouts and its AMX path) follow
HYBRID_LLAMA_EXTRA_BUFTS=auto|on|off (`extra_bufts`); result records carry the choice.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybrid.errors import HybridError
from hybrid.switches import env_choice

FLASH_ATTN = False


def require_llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise HybridError("llama-cpp-python is not installed; `pip install llama-cpp-python` "
                          "(or `pip install .[gguf]`)") from exc
    return llama_cpp


EXTRA_BUFTS_ENV = "HYBRID_LLAMA_EXTRA_BUFTS"


def extra_bufts(system: str | None = None) -> bool:
    """Whether llama.cpp may load weights into its extra buffer types (repacked CPU layouts, AMX
    tiles): HYBRID_LLAMA_EXTRA_BUFTS=on|off|auto. auto (the default) is off where libggml was built
    with AMX (its system info says AMX_INT8 = 1), else on: llama-cpp-python 0.3.36 built on a
    Sapphire Rapids VM (2 vCPUs) died with SIGILL at `tileloadd` in ggml_backend_amx_mul_mat on its
    first multi-threaded evaluation, while a multi-threaded AMX test program ran there; without the
    extra buffers the same GGUFs evaluate normally. The AVX2 rigs have no AMX: auto changes nothing there."""
    choice = env_choice(EXTRA_BUFTS_ENV, ("auto", "on", "off"), "auto", "auto, on or off")
    if choice != "auto":
        return choice == "on"
    if system is None:                       # libggml's system info (llama_cpp_info passes what it read)
        system = require_llama_cpp().llama_print_system_info().decode()
    return "AMX_INT8 = 1" not in system


def llama_cpp_info() -> dict:
    """Version facts for result records."""
    llama_cpp = require_llama_cpp()
    system = llama_cpp.llama_print_system_info().decode()
    return {"llama_cpp_python": llama_cpp.__version__,
            "libllama": llama_cpp.llama_version().decode() if hasattr(llama_cpp, "llama_version") else "?",
            "nvfp4": hasattr(llama_cpp, "GGML_TYPE_NVFP4"),
            "system": system.strip(),
            "extra_bufts": extra_bufts(system)}


@dataclass(slots=True)
class DecodeTiming:
    """Greedy decode of `tokens` after a prompt: prefill seconds and one wall time per new token."""

    tokens: list[int]
    prefill_s: float
    step_s: list[float]

    decode_s: float = 0.0          # wall time of all steps, each with its argmax (hybrid.generate's count)

    @property
    def median_tok_s(self) -> float:
        return 1.0 / float(np.median(self.step_s)) if self.step_s else 0.0

    @property
    def mean_tok_s(self) -> float:
        """Steps over the wall time of all of them (what hybrid.generate calls decode tok/s)."""
        return len(self.step_s) / self.decode_s if self.decode_s > 0 else 0.0


class LlamaRunner:
    """One GGUF loaded in llama.cpp. logits_all=True for teacher-forced logits, False for speed."""

    def __init__(self, path: str | Path, n_ctx: int = 512, n_threads: int | None = None,
                 logits_all: bool = True, n_gpu_layers: int = 0, cpu_experts: bool | str = False,
                 use_mmap: bool = True, flash_attn: bool = FLASH_ATTN):
        from hybrid.baselines import llama_offload as lo

        llama_cpp = require_llama_cpp()
        path = Path(path)
        if not path.exists():
            raise HybridError(f"{path}: GGUF not found")
        kw = {"n_threads": n_threads, "n_threads_batch": n_threads} if n_threads else {}
        self.path = path
        pattern = (lo.EXPS_PATTERN if cpu_experts is True else cpu_experts) or None
        self.cpu_experts = lo.check_pattern(pattern) if pattern else None
        self._overrides = lo.cpu_overrides([pattern]) if pattern else None   # alive as long as the model
        self.extra_bufts = extra_bufts()
        with lo.capture_log() as self.load_log, lo.model_params_with(self._overrides, self.extra_bufts):
            try:
                self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                           logits_all=logits_all, flash_attn=flash_attn, verbose=False,
                                           n_gpu_layers=n_gpu_layers, use_mmap=use_mmap, **kw)
            except ValueError as exc:
                why = "; ".join(self.load_log.errors()[-2:]) or str(exc)
                raise HybridError(f"{path}: llama.cpp could not load it: {why}") from exc
        if pattern and not self.load_log.overridden:
            self.close()
            raise HybridError(f"{path}: cpu_experts pattern {pattern!r} matched no tensor; "
                              f"expert tensors are named like blk.0.ffn_up_exps.weight")
        self.n_gpu_layers = n_gpu_layers
        self.n_ctx = n_ctx
        self.n_vocab = self.llm.n_vocab()
        self._llama_cpp = llama_cpp

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's tokenization of `text` (no BOS, special tokens not parsed)."""
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def _check(self, ids) -> list[int]:
        ids = [int(t) for t in ids]
        if not ids or len(ids) > self.n_ctx:
            raise HybridError(f"{len(ids)} tokens; {self.path.name} was opened with n_ctx={self.n_ctx}")
        return ids

    def logits(self, ids) -> np.ndarray:
        """Teacher-forced float32 [T, V] logits from an empty KV cache."""
        ids = self._check(ids)
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32, copy=True)

    def _last_logits(self) -> np.ndarray:
        ptr = self._llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def prefill_seconds(self, ids) -> float:
        """Wall time of one prefill of `ids` from an empty cache."""
        ids = self._check(ids)
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0

    def greedy_decode(self, prompt, n_new: int) -> DecodeTiming:
        """Prefill `prompt`, then n_new greedy steps, each timed by wall clock."""
        prompt = self._check(list(prompt) + [0] * n_new)[: len(prompt)]
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        prefill = time.perf_counter() - t0
        out, steps = [], []
        tok = int(np.argmax(self._last_logits()))
        start = time.perf_counter()
        for _ in range(n_new):
            out.append(tok)
            t0 = time.perf_counter()
            self.llm.eval([tok])
            steps.append(time.perf_counter() - t0)
            tok = int(np.argmax(self._last_logits()))
        return DecodeTiming(out, prefill, steps, time.perf_counter() - start)

    def decode_speed(self, prompt, tokens: int, warmup: int = 0) -> dict:
        """Prefill and decode tok/s counted as hybrid.bench.decode.measure counts them: a warm-up
        generation of `warmup` tokens first (not timed), then `tokens` greedy tokens after `prompt`:
        one from the prefill, tokens - 1 decode steps; decode tok/s = steps / their wall time."""
        prompt = [int(t) for t in prompt]
        if tokens < 2:
            raise HybridError(f"tokens={tokens}: need at least 2 to time a decode step")
        if warmup:
            self.greedy_decode(prompt, warmup)
        t = self.greedy_decode(prompt, tokens - 1)
        ids = t.tokens + [int(np.argmax(self._last_logits()))]      # the token the last step chose
        return {"prompt_tokens": len(prompt), "warmup_tokens": warmup, "tokens": tokens,
                "prefill_tok_s": round(len(prompt) / t.prefill_s, 3),
                "decode_tok_s": round(t.mean_tok_s, 3), "decode_median_tok_s": round(t.median_tok_s, 3),
                "generated_ids_head": ids[:16]}

    def placement(self) -> dict:
        """What llama.cpp reported at load: model buffer MiB per buffer type, overridden tensors."""
        over = self.load_log.overridden
        return {"n_gpu_layers": self.n_gpu_layers, "cpu_experts_pattern": self.cpu_experts,
                "model_buffers_mib": self.load_log.model_buffers_mib, "overridden_tensors": len(over),
                "overridden_to": sorted(set(over.values()))}

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None and hasattr(llm, "close"):
            llm.close()
        self.llm = None
        self._overrides = None

"""Detect this machine: GPUs (pynvml), CPU (psutil + /proc/cpuinfo flags), RAM and hugepages
(/proc/meminfo). Detection never fails: what cannot be read is None / empty, and why is in `notes`.

The parse_* functions take file text so they can be tested with fixtures.
"""
from __future__ import annotations

import platform
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class GPUInfo:
    index: int
    name: str
    compute_capability: str          # "7.0"
    memory_total_bytes: int
    memory_free_bytes: int
    pcie_gen: int | None             # current link (may read lower while the GPU idles)
    pcie_width: int | None
    pcie_gen_max: int | None
    pcie_width_max: int | None


@dataclass(frozen=True)
class CPUInfo:
    model: str
    physical_cores: int
    logical_cores: int
    avx2: bool
    avx512: bool                     # avx512f
    fma: bool
    f16c: bool


@dataclass(frozen=True)
class MemoryInfo:
    total_bytes: int
    available_bytes: int
    hugepages_total: int
    hugepages_free: int
    hugepage_size_bytes: int


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[GPUInfo, ...]
    cpu: CPUInfo
    memory: MemoryInfo
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- parsing


def parse_meminfo(text: str) -> MemoryInfo:
    """/proc/meminfo text -> MemoryInfo (kB fields turned into bytes)."""
    kv = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            n = int(parts[0])
            kv[key.strip()] = n * 1024 if len(parts) > 1 and parts[1] == "kB" else n
    total = kv.get("MemTotal", 0)
    return MemoryInfo(total_bytes=total, available_bytes=kv.get("MemAvailable", kv.get("MemFree", 0)),
                      hugepages_total=kv.get("HugePages_Total", 0), hugepages_free=kv.get("HugePages_Free", 0),
                      hugepage_size_bytes=kv.get("Hugepagesize", 2048 * 1024))


def parse_cpuinfo(text: str) -> dict:
    """/proc/cpuinfo text -> {model, flags (set), logical, physical (unique core ids; 0 if unknown)}."""
    model, flags, logical, cores = "", set(), 0, set()
    phys = core = None
    for line in text.splitlines() + [""]:
        key, _, val = (s.strip() for s in line.partition(":"))
        if key == "processor":
            logical += 1
        elif key == "model name" and not model:
            model = val
        elif key in ("flags", "Features") and not flags:
            flags = set(val.split())
        elif key == "physical id":
            phys = val
        elif key == "core id":
            core = val
        elif not line.strip():
            if core is not None:
                cores.add((phys, core))
            phys = core = None
    return {"model": model, "flags": flags, "logical": logical, "physical": len(cores)}


def cpu_from(cpuinfo: dict, psutil_physical: int | None, psutil_logical: int | None) -> CPUInfo:
    f = cpuinfo["flags"]
    logical = psutil_logical or cpuinfo["logical"] or 1
    physical = psutil_physical or cpuinfo["physical"] or logical
    return CPUInfo(model=cpuinfo["model"] or platform.processor() or "unknown", physical_cores=physical,
                   logical_cores=logical, avx2="avx2" in f, avx512="avx512f" in f, fma="fma" in f,
                   f16c="f16c" in f)


# ---------------------------------------------------------------- detection


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def detect_cpu(cpuinfo_text: str | None = None) -> CPUInfo:
    import psutil

    info = parse_cpuinfo(_read("/proc/cpuinfo") if cpuinfo_text is None else cpuinfo_text)
    return cpu_from(info, psutil.cpu_count(logical=False), psutil.cpu_count(logical=True))


def physical_cores() -> int:
    """Physical CPU cores (psutil), else logical ones, at least 1."""
    import os

    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def detect_memory(meminfo_text: str | None = None) -> MemoryInfo:
    text = _read("/proc/meminfo") if meminfo_text is None else meminfo_text
    if text:
        return parse_meminfo(text)
    import psutil

    vm = psutil.virtual_memory()
    return MemoryInfo(vm.total, vm.available, 0, 0, 2 * 2**20)


@contextmanager
def _nvml(notes: list[str] | None = None):
    """pynvml, initialised for the block and shut down after it; None without pynvml or a driver (why, into notes)."""
    notes = [] if notes is None else notes
    try:
        import pynvml
    except ImportError:
        notes.append("pynvml not installed (pip install nvidia-ml-py): no GPU detection")
        yield None
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        notes.append(f"NVML unavailable ({exc}): no NVIDIA driver, or no GPU")
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def detect_gpus(notes: list[str] | None = None) -> tuple[GPUInfo, ...]:
    """Every GPU NVML sees; () with a note when pynvml or the driver is missing."""
    with _nvml(notes) as nv:
        return () if nv is None else tuple(_gpu(nv, i) for i in range(nv.nvmlDeviceGetCount()))


def require_gpus(device_flag: str, indices=(), gpus_flag: str | None = None) -> int:
    """The CUDA GPUs torch sees (a count); one-line HybridError where there is none ("<device_flag>: no CUDA GPU is
    visible to torch; use --device cpu") or an index of `indices` is past them ("<gpus_flag or device_flag>: GPU i
    does not exist (n visible: 0..n-1)")."""
    import torch

    from hybrid.errors import HybridError

    n = torch.cuda.device_count()
    if n == 0:
        raise HybridError(f"{device_flag}: no CUDA GPU is visible to torch; use --device cpu")
    bad = [g for g in indices if g >= n]
    if bad:
        raise HybridError(f"{gpus_flag or device_flag}: GPU {bad[0]} does not exist ({n} visible: 0..{n - 1})")
    for g in sorted(set(indices)) or [0]:
        problem = torch_arch_problem(g)
        if problem:
            raise HybridError(f"{gpus_flag or device_flag}: {problem}")
    return n


def _arch_runs_on(arch: str, major: int, minor: int) -> bool:
    """Whether code torch was built for (an entry of torch.cuda.get_arch_list(): "sm_86", "sm_90a", "compute_120")
    runs on a GPU of compute capability major.minor: a CUBIN on its major at a minor up to the GPU's (an "a" / "f"
    feature-specific one on that exact GPU only), PTX on any GPU at or past its version (the driver compiles it)."""
    kind, _, num = arch.partition("_")
    digits = num.rstrip("abf")
    if not digits.isdigit():
        return False
    v = int(digits)
    am, an = divmod(v, 10)
    if kind == "compute":
        return (am, an) <= (major, minor)
    if kind != "sm":
        return False
    if digits != num:                        # sm_90a, sm_100f: that GPU only
        return (am, an) == (major, minor)
    return am == major and an <= minor


def torch_arch_problem(index: int) -> str | None:
    """None where the installed torch can run its kernels on CUDA GPU `index` (or does not say what it was built
    for: CPU builds, tests); else why not, in words that name the fix. The case that matters here: torch's CUDA 12.8+
    and 13 wheels carry no sm_70 code, so on a V100 every torch operation would fail with "no kernel image is
    available" mid-run."""
    import torch

    archs = torch.cuda.get_arch_list()
    if not archs:
        return None
    major, minor = torch.cuda.get_device_capability(index)
    if any(_arch_runs_on(a, major, minor) for a in archs):
        return None
    return (f"GPU {index} ({torch.cuda.get_device_name(index)}, sm_{major}{minor}) cannot run this torch build's "
            f"kernels (CUDA {torch.version.cuda}, built for {' '.join(archs)}); install a torch wheel with sm_{major}"
            f"{minor} code{' (V100: the cu126 wheels)' if (major, minor) == (7, 0) else ''}, or use --device cpu")


def driver_version() -> str | None:
    """The NVIDIA driver's version as NVML reports it (e.g. "580.159.04"); None without pynvml or a driver.
    Benchmark records carry it: the same code can time differently under another driver (results/cuda_kernels.md,
    twenty-eighth session)."""
    with _nvml() as nv:
        if nv is None:
            return None
        try:
            v = nv.nvmlSystemGetDriverVersion()
        except nv.NVMLError:
            return None
        return v.decode() if isinstance(v, bytes) else str(v)


def sm_clocks(index: int = 0) -> dict | None:
    """NVML GPU `index`'s SM clock now and its maximum (MHz) and the clock event (throttle) reasons as a hex mask;
    None without pynvml or a driver. Benchmarks sample it right after their timed launches: the clock then, which
    need not be the one they ran at (twenty-ninth session: NVML read 1980 MHz after runs whose kernels ncu measured
    at 1.79-1.80 GHz; results/cuda_kernels.md)."""
    with _nvml() as nv:
        if nv is None:
            return None
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            out = {"sm_clock_mhz": int(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                   "sm_clock_max_mhz": int(nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))}
        except nv.NVMLError:
            return None
        try:
            out["clock_event_reasons"] = hex(int(nv.nvmlDeviceGetCurrentClocksEventReasons(h)))
        except (nv.NVMLError, AttributeError):
            pass
        return out


def _gpu(nv, i: int) -> GPUInfo:
    h = nv.nvmlDeviceGetHandleByIndex(i)
    name = nv.nvmlDeviceGetName(h)
    name = name.decode() if isinstance(name, bytes) else name
    major, minor = nv.nvmlDeviceGetCudaComputeCapability(h)
    mem = nv.nvmlDeviceGetMemoryInfo(h)

    def opt(fn):
        try:
            return int(getattr(nv, fn)(h))
        except nv.NVMLError:
            return None

    return GPUInfo(index=i, name=name, compute_capability=f"{major}.{minor}",
                   memory_total_bytes=int(mem.total), memory_free_bytes=int(mem.free),
                   pcie_gen=opt("nvmlDeviceGetCurrPcieLinkGeneration"),
                   pcie_width=opt("nvmlDeviceGetCurrPcieLinkWidth"),
                   pcie_gen_max=opt("nvmlDeviceGetMaxPcieLinkGeneration"),
                   pcie_width_max=opt("nvmlDeviceGetMaxPcieLinkWidth"))


def detect() -> Hardware:
    """This machine's GPUs, CPU and memory."""
    notes: list[str] = []
    gpus = detect_gpus(notes)
    return Hardware(gpus=gpus, cpu=detect_cpu(), memory=detect_memory(), notes=tuple(notes))

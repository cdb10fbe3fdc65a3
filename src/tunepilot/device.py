"""The local device: what it is (CUDA GPU, ROCm GPU or CPU), what its software stack offers,
the catalog card it corresponds to, and a background sampler of device-wide memory.

Device-wide memory is read outside PyTorch's allocator, so it includes what the allocator never
sees (the runtime context, cuBLAS/cuDNN workspaces, NCCL buffers):
  CUDA  NVML (nvidia-ml-py) nvmlDeviceGetMemoryInfo(handle).used, per device
  ROCm  amdsmi amdsmi_get_gpu_memory_usage(handle, VRAM)
  CPU   this process's resident set: the kernel's exact high-water mark (VmHWM, reset through
        /proc/self/clear_refs) where Linux allows it - then no thread runs - else psutil RSS
The pilot subtracts the baseline read before it touches the device.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from tunepilot.catalog import Card, Catalog, load_catalog, normalise_card_name

if TYPE_CHECKING:
    from tunepilot.spec.precision import Precision

SAMPLE_INTERVAL_S = 0.02  # 50 Hz: a spike shorter than this can be missed (the allocator's
# own peak counters and VmHWM are exact; the sampler is for what they cannot see)
_VENDOR_WORDS = {"nvidia", "amd", "instinct", "tesla", "geforce", "radeon", "ati"}
# form factors that are different cards from the catalog's SXM / OAM parts (other clocks, power
# and peak FLOP/s): a name with one of these maps only to a catalog card that names it too.
_FORM_FACTOR_WORDS = {"pcie", "pci", "nvl"}
_MEMORY_MATCH_TOLERANCE = 0.15  # device-reported memory vs the card's sold GB (HBM ECC, GiB/GB)


@dataclass
class DeviceInfo:
    """The device the pilot runs on, as probed."""

    kind: str  # "cuda" | "rocm" | "cpu"
    name: str
    torch_device: str  # "cuda:0" | "cpu"
    count: int
    memory_bytes: int | None
    card_id: str | None
    torch_version: str
    uuids: list[str] = field(default_factory=list)
    driver_version: str | None = None
    cuda_version: str | None = None
    hip_version: str | None = None
    cudnn_version: int | None = None
    nccl_version: str | None = None  # RCCL on ROCm (torch.cuda.nccl reports it)
    compute_capability: str | None = None
    bf16_supported: bool | None = None
    sdpa_backends: dict[str, bool] = field(default_factory=dict)
    ecc_enabled: bool | None = None
    mig_enabled: bool | None = None
    missing: list[str] = field(default_factory=list)  # what the spec or a fast path lacks here
    notes: list[str] = field(default_factory=list)
    cpu: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> dict:
        """The short form every result carries: {kind, name, card_id}."""
        return {"kind": self.kind, "name": self.name, "card_id": self.card_id}


# --- the catalog card of a device --------------------------------------------------------------


def card_for_device_name(name: str, memory_bytes: int | None = None,
                         catalog: Catalog | None = None) -> Card | None:
    """The catalog card a device reports itself as, or None when none matches safely.

    "NVIDIA H200" -> h200-sxm-141gb, "NVIDIA H100 80GB HBM3" -> h100-sxm-80gb (alias h100-80gb),
    "NVIDIA A100-SXM4-80GB" -> a100-sxm-80gb, "AMD Instinct MI300X" -> mi300x-192gb. The name is
    split into words (vendor words dropped), and the longest leading run of words that is a card
    id or alias (normalised as the catalog normalises) wins. Refused: a PCIe/NVL part when the
    card is not one (other peak FLOP/s), and a card whose memory differs from the device's by
    more than 15% (an A100 40GB is not the 80GB card).
    """
    catalog = catalog or load_catalog()
    index = {normalise_card_name(n): card for card in catalog.cards for n in (card.id,
                                                                              *card.aliases)}
    words = [w for w in _split_words(name) if w not in _VENDOR_WORDS]
    for k in range(len(words), 0, -1):
        card = index.get("".join(words[:k]))
        if card is None:
            continue
        card_words = set(_split_words(card.id + " " + " ".join(card.aliases)))
        if (_FORM_FACTOR_WORDS & set(words)) - card_words:
            return None
        if memory_bytes and abs(memory_bytes - card.memory_bytes) > \
                _MEMORY_MATCH_TOLERANCE * card.memory_bytes:
            return None
        return card
    return None


def card_id_for_device_name(name: str, memory_bytes: int | None = None,
                            catalog: Catalog | None = None) -> str | None:
    card = card_for_device_name(name, memory_bytes, catalog)
    return card.id if card else None


def _split_words(name: str) -> list[str]:
    import re

    return [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]


# --- probing -----------------------------------------------------------------------------------

TORCH_FLOOR = "2.13"
"""The oldest torch tunepilot is tested on (pyproject's [tool.tunepilot] torch-floor; CI's floor
job runs on it). Not a requirement - the user's own CUDA/ROCm build must keep working - so an older
one is said in the pilot's notes, not refused."""


def torch_floor_note(version: str) -> str | None:
    """A note when ``version`` (torch.__version__) is older than TORCH_FLOOR."""
    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("+")[0].split(".")[:2] if x.isdigit())

    if parts(version) >= parts(TORCH_FLOOR):
        return None
    return (f"torch {version} is older than {TORCH_FLOOR}, the oldest tunepilot is tested on: "
            "the pilot may fail or differ; upgrade torch if it does")



def probe_device(catalog: Catalog | None = None, needs: list[str] | None = None,
                 device: str | None = None) -> DeviceInfo:
    """Probe the first accelerator torch can use, else the CPU (``device="cpu"`` forces the CPU).
    `needs` names features the spec uses ("bitsandbytes") so the probe flags what is missing."""
    import torch

    needs = needs or []
    if torch.cuda.is_available() and device != "cpu":
        info = _probe_gpu(torch, catalog)
    else:
        info = _probe_cpu(torch)
        if torch.cuda.is_available():
            info.notes.append("the CPU was chosen although a GPU is present")
    floor = torch_floor_note(torch.__version__)
    if floor:
        info.notes.append(floor)
    if "bitsandbytes" in needs and (importlib.util.find_spec("bitsandbytes") is None):
        info.missing.append("bitsandbytes is not installed (needed by the spec: QLoRA / 8-bit "
                            "or paged optimizers)")
    return info


def _probe_gpu(torch, catalog: Catalog | None) -> DeviceInfo:
    kind = "rocm" if torch.version.hip else "cuda"
    idx = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    count = torch.cuda.device_count()
    uuids = [_uuid_str(torch.cuda.get_device_properties(i)) for i in range(count)]
    info = DeviceInfo(kind=kind, name=props.name, torch_device=f"cuda:{idx}", count=count,
                      memory_bytes=int(props.total_memory),
                      card_id=card_id_for_device_name(props.name, int(props.total_memory),
                                                      catalog),
                      torch_version=torch.__version__, uuids=[u for u in uuids if u],
                      cuda_version=torch.version.cuda, hip_version=torch.version.hip,
                      compute_capability=f"{props.major}.{props.minor}")
    with contextlib.suppress(Exception):
        info.cudnn_version = torch.backends.cudnn.version()
    with contextlib.suppress(Exception):
        v = torch.cuda.nccl.version()
        info.nccl_version = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    with contextlib.suppress(Exception):
        info.bf16_supported = bool(torch.cuda.is_bf16_supported())
    info.sdpa_backends = _sdpa_backends(torch)
    if kind == "cuda":
        _nvml_details(info)
    else:
        _amdsmi_details(info)
        if not info.sdpa_backends.get("flash_available", False):
            info.missing.append("no flash-attention SDPA kernel in this ROCm build: attention "
                                "falls back to the memory-efficient or math kernel (slower; "
                                "math materialises the seq x seq scores)")
        if importlib.util.find_spec("bitsandbytes") is None:
            info.missing.append("bitsandbytes is not installed (ROCm needs its ROCm build for "
                                "QLoRA and 8-bit optimizers)")
    if info.card_id is None:
        info.notes.append(f"{props.name!r} is not a card of the catalog: MFU is omitted "
                          "(add the card to a --catalog file to get it)")
    return info


def _uuid_str(props) -> str | None:
    u = getattr(props, "uuid", None)
    if u is None:
        return None
    s = str(u)
    return s if s.startswith(("GPU-", "MIG-")) else f"GPU-{s}"


def _sdpa_backends(torch) -> dict[str, bool]:
    b = torch.backends.cuda
    out: dict[str, bool] = {}
    for key, fn in (("flash_enabled", "flash_sdp_enabled"),
                    ("mem_efficient_enabled", "mem_efficient_sdp_enabled"),
                    ("math_enabled", "math_sdp_enabled"), ("cudnn_enabled", "cudnn_sdp_enabled"),
                    ("flash_available", "is_flash_attention_available")):
        f = getattr(b, fn, None)
        if f is not None:
            with contextlib.suppress(Exception):
                out[key] = bool(f())
    return out


def _nvml_details(info: DeviceInfo) -> None:
    nvml = _nvml()
    if nvml is None:
        info.notes.append("NVML is not readable (nvidia-ml-py missing or no driver library): "
                          "driver version, ECC/MIG state and the device-wide memory peak are "
                          "unavailable")
        return
    with contextlib.suppress(Exception):
        info.driver_version = _text(nvml.nvmlSystemGetDriverVersion())
    handle = _nvml_handle(nvml, info.uuids[0] if info.uuids else None)
    if handle is None:
        return
    with contextlib.suppress(Exception):
        current, _pending = nvml.nvmlDeviceGetEccMode(handle)
        info.ecc_enabled = bool(current)
    with contextlib.suppress(Exception):
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        info.mig_enabled = bool(current)


def _amdsmi_details(info: DeviceInfo) -> None:
    smi = _amdsmi()
    if smi is None:
        info.notes.append("amdsmi is not importable: driver version and the device-wide memory "
                          "peak are unavailable")
        return
    with contextlib.suppress(Exception):
        h = smi.amdsmi_get_processor_handles()[0]
        drv = smi.amdsmi_get_gpu_driver_info(h)
        info.driver_version = str(drv.get("driver_version", drv))


def _probe_cpu(torch) -> DeviceInfo:
    import psutil

    name = _cpu_model_name()
    cap = None
    with contextlib.suppress(Exception):
        cap = torch.backends.cpu.get_cpu_capability()
    native_bf16 = None
    with contextlib.suppress(Exception):
        native_bf16 = bool(torch.cpu._is_avx512_bf16_supported()) or \
            bool(torch.cpu._is_amx_tile_supported())
    info = DeviceInfo(kind="cpu", name=name, torch_device="cpu", count=1,
                      memory_bytes=int(psutil.virtual_memory().total), card_id=None,
                      torch_version=torch.__version__, bf16_supported=True,
                      sdpa_backends={"cpu_flash": True, "math": True},
                      cpu={"logical_cores": os.cpu_count(), "torch_threads":
                           torch.get_num_threads(), "isa": cap, "native_bf16": native_bf16,
                           "machine": platform.machine()})
    info.notes.append("no GPU in use: this pilot ran on the CPU. Its times and memory are this "
                      "CPU's, not a rented card's; the GPU-only figures (allocator, device-wide "
                      "memory, MFU) are marked unavailable")
    return info


def emulated_bf16_note(info: DeviceInfo, precision: Precision) -> str | None:
    """A CPU without native bf16 (AVX512-BF16/AMX) runs a bf16 spec's steps emulated: said only
    when the run computes in bf16."""
    if info.kind != "cpu" or not precision.computes_in_bf16 or info.cpu.get("native_bf16"):
        return None
    return "bf16 on this CPU is emulated (no AVX512-BF16/AMX): bf16 steps are slow"


def _cpu_model_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# --- vendor libraries (optional) ---------------------------------------------------------------

_NVML_READY: bool | None = None


def _nvml():
    """pynvml, initialised once, or None where NVML cannot be read."""
    global _NVML_READY
    if _NVML_READY is False:
        return None
    try:
        import pynvml

        if not _NVML_READY:
            pynvml.nvmlInit()
            _NVML_READY = True
        return pynvml
    except Exception:
        _NVML_READY = False
        return None


def _norm_uuid(uuid: str | None) -> str:
    """'GPU-6B5B...' / '6b5b...' -> '6b5b...' (torch and NVML spell UUIDs differently)."""
    u = (uuid or "").strip().lower()
    return u[4:] if u.startswith("gpu-") else u


def _nvml_handle(nvml, uuid: str | None):
    """The NVML handle of the GPU torch uses: by UUID, else the only GPU NVML sees."""
    with contextlib.suppress(Exception):
        if uuid:
            return nvml.nvmlDeviceGetHandleByUUID(uuid)
    with contextlib.suppress(Exception):
        n = nvml.nvmlDeviceGetCount()
        for i in range(n):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            if uuid and _norm_uuid(_text(nvml.nvmlDeviceGetUUID(h))) == _norm_uuid(uuid):
                return h
        if n == 1:
            return nvml.nvmlDeviceGetHandleByIndex(0)
    return None


def _amdsmi():
    try:
        import amdsmi

        amdsmi.amdsmi_init()
        return amdsmi
    except Exception:
        return None


def nvml_used_by_uuid() -> dict[str, int]:
    """Device-wide used bytes of every NVIDIA GPU, keyed by lower-case UUID without "GPU-" ({}
    without NVML). Read this before torch initialises CUDA: it is the pre-run baseline."""
    nvml = _nvml()
    out: dict[str, int] = {}
    if nvml is None:
        return out
    with contextlib.suppress(Exception):
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            out[_norm_uuid(_text(nvml.nvmlDeviceGetUUID(h)))] = \
                int(nvml.nvmlDeviceGetMemoryInfo(h).used)
    return out


def nvml_handles() -> tuple[object, list] | None:
    """(pynvml, a handle per GPU) or None without NVML: for readers outside this module."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        return nvml, [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    except Exception:
        return None


def nvml_used_total(handles: tuple[object, list]) -> int:
    """Device-wide used bytes summed over the GPUs of ``handles`` (0 when unreadable)."""
    nvml, hs = handles
    try:
        return sum(int(nvml.nvmlDeviceGetMemoryInfo(h).used) for h in hs)
    except Exception:
        return 0


def nvml_used_per_process(handles: tuple[object, list]) -> dict[int, int]:
    """Device bytes per process id (NVML's per-process figure: its CUDA context included);
    {} where the driver does not report processes (some containers)."""
    nvml, hs = handles
    out: dict[int, int] = {}
    for h in hs:
        try:
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(h):
                out[p.pid] = out.get(p.pid, 0) + int(p.usedGpuMemory or 0)
        except Exception:
            continue
    return out


def own_device_bytes() -> tuple[int, str]:
    """(bytes this process holds on the GPU now, how it was read): NVML's per-process figure
    when the driver reports it, else the caching allocator's reserved bytes (without the CUDA
    context, which is then counted as the run's)."""
    import os

    handles = nvml_handles()
    if handles is not None:
        mine = nvml_used_per_process(handles).get(os.getpid())
        if mine:
            return mine, "NVML per-process used memory of this process"
    import torch

    return int(torch.cuda.memory_reserved()), ("the allocator's reserved bytes (NVML reports "
                                               "no per-process figure here)")


# --- the background sampler --------------------------------------------------------------------


@dataclass
class SamplerReading:
    source: str  # "nvml" | "amdsmi" | "rss"
    baseline_bytes: int
    peak_bytes: int
    num_samples: int
    interval_s: float
    hwm_bytes: int | None = None  # CPU: the kernel's exact peak RSS since the reset (VmHWM)

    @property
    def peak_minus_baseline_bytes(self) -> int:
        return max(0, self.peak_bytes - self.baseline_bytes)


class MemorySampler:
    """Samples a memory reading on a daemon thread; keeps the peak. Start before the run."""

    def __init__(self, source: str, reader: Callable[[], int], baseline_bytes: int | None = None,
                 interval_s: float = SAMPLE_INTERVAL_S):
        self.source, self.reader, self.interval_s = source, reader, interval_s
        self.baseline_bytes = baseline_bytes
        self.peak_bytes = 0
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm_reset = False

    def start(self) -> MemorySampler:
        if self.baseline_bytes is None:
            self.baseline_bytes = self.reader()
        if self.source == "rss":
            self._hwm_reset = _reset_hwm()
        self.peak_bytes = max(self.baseline_bytes, self.reader())
        if self._hwm_reset:
            return self  # the kernel keeps the exact peak: no thread, no sampling cost
        self._thread = threading.Thread(target=self._run, name="tunepilot-memory-sampler",
                                        daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        try:
            v = self.reader()
        except Exception:
            return
        self.num_samples += 1
        if v > self.peak_bytes:
            self.peak_bytes = v

    def stop(self) -> SamplerReading:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        self.sample()
        hwm = _read_hwm() if self.source == "rss" and self._hwm_reset else None
        peak = max(self.peak_bytes, hwm or 0)
        return SamplerReading(self.source, int(self.baseline_bytes or 0), int(peak),
                              self.num_samples, self.interval_s, hwm)


def make_sampler(info: DeviceInfo, baselines: dict[str, int] | None = None
                 ) -> MemorySampler | None:
    """The sampler for this device, or None where nothing device-wide can be read."""
    if info.kind == "cpu":
        import psutil

        proc = psutil.Process()
        return MemorySampler("rss", lambda: proc.memory_info().rss)
    if info.kind == "cuda":
        nvml = _nvml()
        uuid = own_uuid(info)
        handle = _nvml_handle(nvml, uuid) if nvml is not None else None
        if handle is None:
            return None
        base = (baselines or {}).get(_norm_uuid(uuid)) if uuid else None
        return MemorySampler("nvml", lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).used),
                             baseline_bytes=base)
    smi = _amdsmi()
    if smi is None:
        return None
    try:
        handle = smi.amdsmi_get_processor_handles()[0]
        vram = smi.AmdSmiMemoryType.VRAM
        return MemorySampler("amdsmi",
                             lambda: int(smi.amdsmi_get_gpu_memory_usage(handle, vram)))
    except Exception:
        return None


def own_uuid(info: DeviceInfo) -> str | None:
    """The UUID of the device this process runs on (cuda:N: the N-th visible one; a rank of a
    sharded pilot is not on cuda:0)."""
    try:
        idx = int(str(info.torch_device).split(":")[1])
    except (IndexError, ValueError):
        idx = 0
    return info.uuids[idx] if len(info.uuids) > idx else (info.uuids[0] if info.uuids else None)


def _reset_hwm() -> bool:
    """Reset this process's peak RSS (Linux >= 4.0: echo 5 > /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _read_hwm() is not None
    except OSError:
        return False


def _read_hwm() -> int | None:
    try:
        with open("/proc/self/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


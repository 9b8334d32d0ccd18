"""The device stamp: what a result was measured on, collected once per run.

A speed number means little without the machine, the backend, the library versions and the
engine options behind it, so every result carries a stamp. `device_key` hashes the parts that
change performance (so results and calibrations are reused only on a matching machine and
stack); `machine_class` is the coarse label reports group by; `doctor_report` checks that the
stack works before a long run.

Nothing here may fail a run: every probe (subprocess, /proc, MLX) falls back to None.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

_TIMEOUT = 3.0  # seconds for any one subprocess
_MIN_FREE = 2 << 30  # below this much free memory, doctor warns

# What changes performance. Not the timestamp, thermal state, git commit or engine options
# (options are keyed separately by whoever stores results).
KEY_FIELDS = (
    "device_name", "device_memory_bytes", "backend", "os", "mlx_version", "mlx_lm_version", "dspark_lab_version",
)


def _run(cmd: list[str], timeout: float = _TIMEOUT, cwd: str | None = None) -> str | None:
    """stdout of a command, or None if it is absent, fails, or takes too long."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
    except Exception:  # a broken install's metadata
        return None


def _jsonable(obj):
    """Engine options and MLX info made JSON-safe (paths, tuples, dataclasses, enums, devices)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        return [_jsonable(v) for v in items]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    value = getattr(obj, "value", None)  # Enum
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(obj)


# --- host facts --------------------------------------------------------------------------------


def _cpu_model() -> str | None:
    if sys.platform == "darwin":
        return _run(["sysctl", "-n", "machdep.cpu.brand_string"])
    info = _read("/proc/cpuinfo")
    if info:
        # x86 says "model name"; some ARM kernels only say "Hardware" or "Model".
        for key in ("model name", "Hardware", "Model", "cpu model"):
            m = re.search(rf"^{key}\s*:\s*(.+)$", info, re.MULTILINE)
            if m and m.group(1).strip():
                return m.group(1).strip()
    return platform.processor() or platform.machine() or None


def _meminfo_bytes(field: str) -> int | None:
    info = _read("/proc/meminfo")
    m = re.search(rf"^{field}:\s*(\d+)\s*kB", info or "", re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def _system_memory() -> int | None:
    if sys.platform == "darwin":
        out = _run(["sysctl", "-n", "hw.memsize"])
        return int(out) if out and out.isdigit() else None
    total = _meminfo_bytes("MemTotal")
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return total


def free_memory() -> int | None:
    """Memory available to a new allocation, in bytes (None where the OS does not say)."""
    if sys.platform == "darwin":
        out = _run(["vm_stat"])
        if not out:
            return None
        page = re.search(r"page size of (\d+) bytes", out)
        pages = sum(
            int(m.group(1))
            for name in ("Pages free", "Pages inactive", "Pages speculative", "Pages purgeable")
            if (m := re.search(rf"^{name}:\s*(\d+)", out, re.MULTILINE))
        )
        return pages * int(page.group(1)) if page else None
    return _meminfo_bytes("MemAvailable")


def _os_version() -> str | None:
    if sys.platform == "darwin":
        return platform.mac_ver()[0] or None
    release = _read("/etc/os-release") or ""
    m = re.search(r'^PRETTY_NAME="?([^"\n]+)"?', release, re.MULTILINE)
    return m.group(1) if m else None


# --- MLX ---------------------------------------------------------------------------------------


def _mlx_facts() -> dict:
    """Backend and device facts from MLX itself; empty values when MLX is unusable."""
    facts = {"backend": None, "default_device": None, "device_info": None}
    try:
        import mlx.core as mx
    except Exception:
        return facts
    try:
        device = mx.default_device()
        facts["default_device"] = str(device)
        if device.type == mx.cpu:
            facts["backend"] = "cpu"
        elif getattr(mx, "metal", None) is not None and mx.metal.is_available():
            facts["backend"] = "metal"
        elif getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
            facts["backend"] = "cuda"
        else:
            facts["backend"] = "gpu"
    except Exception:
        pass
    try:
        if hasattr(mx, "device_info"):
            facts["device_info"] = _jsonable(dict(mx.device_info()))
        elif facts["backend"] == "metal":  # older MLX
            facts["device_info"] = _jsonable(dict(mx.metal.device_info()))
    except Exception:
        pass
    return facts


def _device_memory(mlx: dict, system_memory: int | None) -> int | None:
    """Memory of the device MLX computes on: the GPU's own, or the system's (CPU, and Metal's
    unified memory where MLX does not say)."""
    info = mlx["device_info"] or {}
    if mlx["backend"] in ("metal", "cuda", "gpu"):
        memory = info.get("memory_size") or info.get("total_memory")
        if mlx["backend"] == "metal" and not memory:
            memory = system_memory
        return memory
    return system_memory


def device_memory() -> int | None:
    """Bytes of memory on the device MLX computes on (None where neither MLX nor the OS says)."""
    return _device_memory(_mlx_facts(), _system_memory())


# --- power and thermal -------------------------------------------------------------------------


def _number(text: str):
    text = text.strip()
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_nvidia_smi(out: str) -> list[dict]:
    """Rows of `nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw
    --format=csv,noheader,nounits`, one dict per GPU."""
    gpus = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        name, sm, mem, temp, power = parts
        gpus.append({
            "name": name, "clocks_sm_mhz": _number(sm), "clocks_mem_mhz": _number(mem),
            "temperature_c": _number(temp), "power_draw_w": _number(power),
        })
    return gpus


def parse_pmset_therm(out: str) -> dict:
    """`pmset -g therm`: lines like "CPU_Speed_Limit = 100" (absent when nothing is throttled)
    and notes such as "No thermal warning level has been recorded"."""
    state: dict = {}
    for m in re.finditer(r"^\s*(\w+)\s*=\s*(\S+)\s*$", out, re.MULTILINE):
        state[m.group(1)] = _number(m.group(2)) if _number(m.group(2)) is not None else m.group(2)
    warnings = [line.strip() for line in out.splitlines() if re.search(r"warning level", line, re.IGNORECASE)]
    if warnings:
        state["warnings"] = warnings
    return state


def _power_thermal() -> dict | None:
    state: dict = {}
    if sys.platform == "darwin":
        therm = _run(["pmset", "-g", "therm"])
        if therm is not None:
            state["pmset_therm"] = parse_pmset_therm(therm)
        ps = _run(["pmset", "-g", "ps"])
        if ps:
            m = re.search(r"drawing from '([^']+)'", ps)
            state["power_source"] = m.group(1) if m else None
    if shutil.which("nvidia-smi"):
        out = _run([
            "nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw",
            "--format=csv,noheader,nounits",
        ])
        if out:
            state["nvidia_smi"] = parse_nvidia_smi(out)
    governor = _read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    if governor:
        state["cpu_governor"] = governor.strip()  # "powersave" can halve CPU-bound speed
    return state or None


# --- git -----------------------------------------------------------------------------------------


def _git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the dspark-lab checkout this code runs from; (None, None) from a wheel."""
    try:
        import dspark_lab

        root = Path(dspark_lab.__file__).resolve().parent.parent
    except Exception:
        return None, None
    if not (root / ".git").exists():  # an installed wheel, or a venv inside someone else's repo
        return None, None
    commit = _run(["git", "rev-parse", "HEAD"], cwd=str(root))
    if not commit or not re.fullmatch(r"[0-9a-f]{40,64}", commit):
        return None, None
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=str(root))
    return commit, (bool(status) if status is not None else None)


# --- MLX's environment ---------------------------------------------------------------------------

# MLX reads its tuning settings from the environment once, when it first uses the device: on CUDA,
# how many operations go into one CUDA graph (MLX_MAX_OPS_PER_BUFFER, 20 by default) and how many
# graphs it keeps (MLX_CUDA_GRAPH_CACHE_SIZE); on Metal, the command buffer sizes. A launch-bound
# decode step's speed depends on them, so a result carries the ones that were set. dspark-lab's own
# setting of that kind goes with them: the rows kernel's layout (engine/rows_kernel.LAYOUT_VARIABLE,
# written out here so that a stamp needs no MLX), under which a sweep's MODEL@rows-kernel trials
# measure another kernel than the default's: a result says which, and its device key differs, so
# calibrations and probe verdicts keyed on it stay apart. (Summaries and the registry pool a
# machine class's runs whatever their keys; choose runs with --run to keep layouts apart there.)
MLX_ENV_PREFIX = "MLX_"
ROWS_LAYOUT_VARIABLE = "DSPARK_LAB_ROWS_LAYOUT"
ENGINE_ENV = (ROWS_LAYOUT_VARIABLE,)
# The layout the rows kernel builds where the variable is unset (engine/rows_kernel.DEFAULT_LAYOUT,
# written out here too), and the one every stamp measured before the default changed in the
# forty-seventh round. On CUDA, where the kernel runs, a stamp names the layout in force wherever
# it is not the earlier default: trials of the mma layout never share a device key with the words
# layout's, and a stamp of the words layout keeps the key such stamps always had.
ROWS_LAYOUT_DEFAULT, ROWS_LAYOUT_BEFORE = "mma", "words"


def mlx_env(environ=None, backend: str | None = None, compute_capability: int | None = None) -> dict[str, str]:
    """The MLX_* variables set in this process's environment, and dspark-lab's ENGINE_ENV where set
    (empty: the defaults); on the `backend` "cuda", the rows kernel's layout wherever it is not the
    words layout, set or not (the mma layout gives way to words on a device whose
    `compute_capability` major is below 8, as engine/rows_kernel.quantized_rows_matmul does)."""
    environ = os.environ if environ is None else environ
    env = {k: environ[k] for k in sorted(environ) if k.startswith(MLX_ENV_PREFIX) or k in ENGINE_ENV}
    if backend == "cuda":
        layout = env.pop(ROWS_LAYOUT_VARIABLE, None) or ROWS_LAYOUT_DEFAULT
        if layout == "mma" and isinstance(compute_capability, int) and compute_capability < 8:
            layout = ROWS_LAYOUT_BEFORE
        if layout != ROWS_LAYOUT_BEFORE:
            env = dict(sorted({**env, ROWS_LAYOUT_VARIABLE: layout}.items()))
    return env


# --- the stamp -----------------------------------------------------------------------------------


def collect_device_stamp(engine_options: dict | None = None) -> dict:
    """Everything about this machine and stack that a result should carry. JSON-serializable;
    never raises (facts the machine will not tell are None)."""
    mlx = _mlx_facts()
    info = mlx["device_info"] or {}
    backend = mlx["backend"]
    cpu_model = _cpu_model()
    system_memory = _system_memory()
    memory = _device_memory(mlx, system_memory)
    if backend in ("metal", "cuda", "gpu"):
        device_name = info.get("device_name") or (cpu_model if backend == "metal" else None)
    else:
        device_name = cpu_model or info.get("device_name")
    try:
        import dspark_lab

        dspark_version = dspark_lab.__version__
    except Exception:
        dspark_version = _version("dspark-lab")
    commit, dirty = _git_state()
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": backend,
        "default_device": mlx["default_device"],
        "device_name": device_name,
        "device_memory_bytes": memory if isinstance(memory, int) else None,
        "device_info": info or None,
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "system_memory_bytes": system_memory,
        "os": platform.system(),
        "os_version": _os_version(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "python_version": platform.python_version(),
        "mlx_version": _version("mlx"),
        "mlx_lm_version": _version("mlx-lm"),
        "mlx_vlm_version": _version("mlx-vlm"),
        "dspark_lab_version": dspark_version,
        "git_commit": commit,
        "git_dirty": dirty,
        "engine_options": _jsonable(dict(engine_options or {})),
        "mlx_env": mlx_env(backend=backend, compute_capability=info.get("compute_capability_major")),
        "power_thermal": _power_thermal(),
    }


def device_key(stamp: dict) -> str:
    """Short stable hash of the fields that change performance (KEY_FIELDS, and MLX's environment
    settings where any is set)."""
    identity = {k: stamp.get(k) for k in KEY_FIELDS}
    if stamp.get("mlx_env"):  # only when set: stamps from before it was recorded keep their keys
        identity["mlx_env"] = stamp["mlx_env"]
    # Whole GiB: MemTotal moves by a few MB between kernels on the same machine.
    mem = identity["device_memory_bytes"]
    identity["device_memory_bytes"] = round(mem / 2**30) if isinstance(mem, (int, float)) else mem
    blob = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def machine_class(stamp: dict) -> str:
    """Coarse label for grouping results: "NVIDIA H200 (cuda)", "Apple M3 Max 64GB (metal)",
    "cpu: AMD EPYC 7763 64-Core Processor"."""
    backend = stamp.get("backend") or "unknown"
    name = stamp.get("device_name") or stamp.get("cpu_model") or "unknown device"
    if backend == "cpu":
        return f"cpu: {stamp.get('cpu_model') or name}"
    if backend == "metal":
        mem = stamp.get("device_memory_bytes") or stamp.get("system_memory_bytes")
        size = f" {round(mem / 2**30)}GB" if isinstance(mem, (int, float)) and mem > 0 else ""
        return f"{name}{size} ({backend})"
    return f"{name} ({backend})"


# --- doctor --------------------------------------------------------------------------------------


def _requirement_check(dist: str) -> tuple[str, str, str]:
    """Is the installed `dist` within what dspark-lab's metadata requires?"""
    installed = _version(dist)
    label = f"{dist} version"
    if installed is None:
        fix = "pip install -e '.[cpu]' (Linux CPU), '.[cuda]' (NVIDIA) or '.' (macOS)" if dist == "mlx" else f"pip install {dist}"
        return label, "fail", f"{dist} is not installed; {fix}."
    try:
        requires = metadata.requires("dspark-lab") or []
    except metadata.PackageNotFoundError:
        return label, "warn", f"{installed}; dspark-lab is not installed, so its requirements cannot be checked (pip install -e .)."
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:
        return label, "ok", f"{installed} (requirements not checked: the `packaging` module is missing)."
    specs = []
    for line in requires:
        try:
            req = Requirement(line)
        except Exception:
            continue
        if canonicalize_name(req.name) == canonicalize_name(dist) and str(req.specifier):
            specs.append(req.specifier)  # mlx appears once per extra (cpu, cuda), same range
    if not specs:
        return label, "ok", f"{installed} (dspark-lab names no version range for it)."
    wanted = " or ".join(sorted({str(s) for s in specs}))
    if any(s.contains(installed, prereleases=True) for s in specs):
        return label, "ok", f"{installed} (wants {wanted})."
    return label, "fail", f"{installed} is outside what dspark-lab wants ({wanted}); reinstall with pip install -e '.[cpu]' (or '.[cuda]' / '.')."


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def doctor_report() -> list[tuple[str, str, str]]:
    """(check, "ok" | "warn" | "fail", detail) for everything a run depends on."""
    rows: list[tuple[str, str, str]] = []
    mlx_ok = False
    try:
        import mlx.core as mx

        result = (mx.arange(4, dtype=mx.float32) * 2).sum().item()
        if result != 12:
            rows.append(("mlx", "fail", f"a tiny computation gave {result}, not 12; the MLX install is broken. Reinstall mlx."))
        else:
            mlx_ok = True
            rows.append(("mlx", "ok", f"imports and computes on {mx.default_device()}."))
    except Exception as e:
        fix = "pip install -e '.[cpu]' on Linux without a GPU, '.[cuda]' with an NVIDIA GPU, '.' on macOS"
        rows.append(("mlx", "fail", f"{type(e).__name__}: {e}. {fix}."))

    facts = _mlx_facts() if mlx_ok else {"backend": None}
    backend = facts["backend"]
    if backend is None:
        rows.append(("backend", "fail", "no MLX backend could be named; see the mlx check above."))
    else:
        detail = backend
        if backend == "cpu":
            detail += f" ({_cpu_model() or 'unknown CPU'})"
        elif (facts.get("device_info") or {}).get("device_name"):
            detail += f" ({facts['device_info']['device_name']})"
        status = "ok"
        if backend == "cpu" and sys.platform == "darwin" and platform.machine() == "arm64":
            status, detail = "warn", detail + "; this Mac has a GPU, but MLX runs on the CPU (mx.set_default_device?)."
        elif backend == "cpu" and shutil.which("nvidia-smi"):
            status, detail = "warn", detail + "; an NVIDIA GPU driver is present but MLX runs on the CPU. pip install -e '.[cuda]'."
        rows.append(("backend", status, detail))

    rows.append(_requirement_check("mlx"))
    rows.append(_requirement_check("mlx-lm"))

    free, total = free_memory(), _system_memory()
    if free is None:
        rows.append(("memory", "warn", "this OS does not say how much memory is free."))
    else:
        detail = f"{_gib(free)} free" + (f" of {_gib(total)}" if total else "")
        rows.append(("memory", "ok" if free >= _MIN_FREE else "warn", detail if free >= _MIN_FREE else f"only {detail}; close other programs or use a smaller model."))

    info = facts.get("device_info") or {}
    if backend == "cuda" and isinstance(info.get("free_memory"), int):
        gpu_free, gpu_total = info["free_memory"], info.get("total_memory")
        detail = f"{_gib(gpu_free)} free" + (f" of {_gib(gpu_total)}" if isinstance(gpu_total, int) else "")
        ok = gpu_free >= _MIN_FREE
        rows.append(("gpu memory", "ok" if ok else "warn", detail if ok else f"only {detail}; another process holds the GPU."))

    offline = os.environ.get("HF_HUB_OFFLINE", "")
    if offline.strip().lower() in ("1", "true", "yes", "on"):
        rows.append(("HF_HUB_OFFLINE", "ok", f"{offline}: repo ids load from the local cache only, nothing is downloaded."))
    else:
        rows.append(("HF_HUB_OFFLINE", "ok", "not set: a repo id that is not cached is downloaded from the Hugging Face hub."))

    env = mlx_env(backend=backend, compute_capability=(facts.get("device_info") or {}).get("compute_capability_major"))
    rows.append(("MLX environment", "ok", ", ".join(f"{k}={v}" for k, v in env.items()) + ": results carry these, and their device key names them"
                 if env else "no MLX_* setting: MLX's defaults."))
    rows.append(_cache_check())
    return rows


def _cache_check() -> tuple[str, str, str]:
    try:
        from ..engine.pypi_models import cache_root

        root = cache_root()
    except Exception:
        env = os.environ.get("DSPARK_LAB_CACHE")
        root = Path(env).expanduser() if env else Path.home() / ".cache" / "dspark-lab"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".doctor-"):
            pass
    except OSError as e:
        return "cache dir", "fail", f"{root} is not writable ({e.strerror or e}); set DSPARK_LAB_CACHE to a writable folder."
    return "cache dir", "ok", f"{root} is writable."

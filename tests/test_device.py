"""Device stamp, device key, machine class and doctor: complete, stable, and never failing."""

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from dspark_lab.lab import device
from dspark_lab.lab.device import (
    KEY_FIELDS, collect_device_stamp, device_key, doctor_report, machine_class, parse_nvidia_smi, parse_pmset_therm,
)

STAMP_KEYS = {
    "timestamp", "backend", "default_device", "device_name", "device_memory_bytes", "device_info", "cpu_model",
    "cpu_count", "system_memory_bytes", "os", "os_version", "kernel", "arch", "python_version", "mlx_version",
    "mlx_lm_version", "mlx_vlm_version", "dspark_lab_version", "git_commit", "git_dirty", "engine_options",
    "mlx_env", "power_thermal",
}


@pytest.fixture(scope="module")
def stamp():
    return collect_device_stamp({"mode": "lookup", "cap": 4, "model": Path("/models/x"), "caps": (1, 2)})


def test_stamp_has_every_key_and_is_json(stamp):
    assert set(stamp) == STAMP_KEYS
    again = json.loads(json.dumps(stamp))
    assert again["engine_options"] == {"mode": "lookup", "cap": 4, "model": "/models/x", "caps": [1, 2]}
    assert stamp["backend"] in ("cpu", "metal", "cuda")
    assert stamp["mlx_version"] and stamp["mlx_lm_version"] and stamp["dspark_lab_version"]
    assert stamp["device_name"] and stamp["device_memory_bytes"] > 0
    assert stamp["timestamp"].endswith("+00:00")


def test_stamp_git_commit_from_checkout(stamp):
    root = Path(device.__file__).resolve().parents[2]
    if not (root / ".git").exists():
        pytest.skip("not running from a git checkout")
    if stamp["git_commit"] is None:
        pytest.skip("git is not installed")
    assert len(stamp["git_commit"]) == 40 and isinstance(stamp["git_dirty"], bool)


def test_device_key_stable_and_ignores_volatile_fields(stamp):
    second = collect_device_stamp({"mode": "greedy"})
    assert device_key(stamp) == device_key(second)
    changed = dict(stamp, timestamp="2001-01-01T00:00:00+00:00", git_commit="0" * 40, git_dirty=False,
                   power_thermal={"nvidia_smi": [{"temperature_c": 90}]}, engine_options={"x": 1})
    assert device_key(changed) == device_key(stamp)
    assert len(device_key(stamp)) == 12


@pytest.mark.parametrize("field", ["mlx_version", "mlx_lm_version", "dspark_lab_version", "device_name", "backend", "os"])
def test_device_key_changes_with_identity(stamp, field):
    assert field in KEY_FIELDS
    assert device_key(dict(stamp, **{field: "something else"})) != device_key(stamp)


def test_mlx_environment_is_stamped_and_keys_the_device(monkeypatch):
    """MLX_* settings (read once by MLX: e.g. the ops per CUDA graph) change a decode step's speed,
    so a stamp records them and its key differs from the same machine's with MLX's defaults; a stamp
    without any (or from before they were recorded) keeps the key it always had."""
    for k in [k for k in os.environ if k.startswith("MLX_")]:
        monkeypatch.delenv(k)
    plain = collect_device_stamp()
    assert plain["mlx_env"] == {}
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "100")
    monkeypatch.setenv("NOT_MLX", "1")
    tuned = collect_device_stamp()
    assert tuned["mlx_env"] == {"MLX_MAX_OPS_PER_BUFFER": "100"}
    assert device_key(tuned) != device_key(plain)
    assert device_key({k: v for k, v in plain.items() if k != "mlx_env"}) == device_key(plain)
    rows = {name: (status, detail) for name, status, detail in doctor_report()}
    assert rows["MLX environment"] == ("ok", "MLX_MAX_OPS_PER_BUFFER=100: results carry these, and their device key names them")
    # The rows kernel's layout, named in the environment, keys the device too: its routed trials measure another kernel.
    from dspark_lab.engine.rows_kernel import LAYOUT_VARIABLE
    from dspark_lab.lab.device import ENGINE_ENV

    assert LAYOUT_VARIABLE in ENGINE_ENV
    monkeypatch.setenv(LAYOUT_VARIABLE, "mma")
    mma = collect_device_stamp()
    assert mma["mlx_env"] == {"DSPARK_LAB_ROWS_LAYOUT": "mma", "MLX_MAX_OPS_PER_BUFFER": "100"}
    assert device_key(mma) != device_key(tuned)


def test_on_cuda_the_stamp_names_the_rows_layout_unless_it_is_the_words_layout_of_earlier_stamps(monkeypatch):
    """The mma layout became the default (forty-seventh round): a CUDA stamp names it whether the
    variable is set or not, so its routed trials never pool with earlier stamps' (the words layout,
    named nowhere); a stamp that runs the words layout keeps the key those had; off CUDA, where no
    rows kernel runs, only what is set is recorded."""
    from dspark_lab.engine.rows_kernel import DEFAULT_LAYOUT
    from dspark_lab.lab.device import ROWS_LAYOUT_DEFAULT, mlx_env

    assert ROWS_LAYOUT_DEFAULT == DEFAULT_LAYOUT  # the stamp's copy, written out so that a stamp needs no MLX
    plain = {"MLX_MAX_OPS_PER_BUFFER": "20"}
    assert mlx_env(plain, backend="cuda") == {"DSPARK_LAB_ROWS_LAYOUT": "mma", "MLX_MAX_OPS_PER_BUFFER": "20"}
    assert mlx_env({**plain, "DSPARK_LAB_ROWS_LAYOUT": "mma"}, backend="cuda") == mlx_env(plain, backend="cuda")
    assert mlx_env({**plain, "DSPARK_LAB_ROWS_LAYOUT": "words"}, backend="cuda") == plain
    assert mlx_env({**plain, "DSPARK_LAB_ROWS_LAYOUT": "wide"}, backend="cuda")["DSPARK_LAB_ROWS_LAYOUT"] == "wide"
    assert mlx_env(plain, backend="metal") == mlx_env(plain, backend="cpu") == plain
    assert mlx_env(plain, backend="cuda", compute_capability=7) == plain  # before Ampere the engine builds the words layout
    assert mlx_env(plain, backend="cuda", compute_capability=9) == mlx_env(plain, backend="cuda")
    earlier = {"backend": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "mlx_env": {}}  # a words-layout stamp before the change
    assert device_key(dict(earlier, mlx_env=mlx_env({"DSPARK_LAB_ROWS_LAYOUT": "words"}, backend="cuda"))) == device_key(earlier)
    assert device_key(dict(earlier, mlx_env=mlx_env({}, backend="cuda"))) != device_key(earlier)


def test_device_key_memory_in_whole_gib(stamp):
    gib = 64 * 2**30
    assert device_key(dict(stamp, device_memory_bytes=gib)) == device_key(dict(stamp, device_memory_bytes=gib - 5_000_000))
    assert device_key(dict(stamp, device_memory_bytes=gib)) != device_key(dict(stamp, device_memory_bytes=2 * gib))


def test_machine_class():
    assert machine_class({"backend": "cuda", "device_name": "NVIDIA H200", "device_memory_bytes": 150_000_000_000}) == "NVIDIA H200 (cuda)"
    assert machine_class({"backend": "metal", "device_name": "Apple M3 Max", "device_memory_bytes": 64 * 2**30}) == "Apple M3 Max 64GB (metal)"
    assert machine_class({"backend": "cpu", "device_name": "AMD EPYC", "cpu_model": "AMD EPYC"}) == "cpu: AMD EPYC"
    assert machine_class({}) == "unknown device (unknown)"


def test_machine_class_of_this_machine(stamp):
    label = machine_class(stamp)
    assert label.endswith(f"({stamp['backend']})") or label.startswith("cpu: ")


def test_doctor_mlx_ok_here(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_LAB_CACHE", str(tmp_path / "cache"))  # leave the real cache alone
    rows = doctor_report()
    checks = {name: (status, detail) for name, status, detail in rows}
    assert all(status in ("ok", "warn", "fail") for _, status, _ in rows)
    assert checks["mlx"][0] == "ok"
    assert checks["backend"][0] in ("ok", "warn") and checks["backend"][1]
    assert checks["mlx version"][0] == "ok" and checks["mlx-lm version"][0] == "ok"
    assert checks["HF_HUB_OFFLINE"][1].startswith("1")  # conftest sets it
    assert checks["cache dir"][0] == "ok" and "memory" in checks


def test_doctor_cache_dir_not_writable(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("DSPARK_LAB_CACHE", str(blocker / "cache"))  # a folder inside a file
    status, detail = {n: (s, d) for n, s, d in doctor_report()}["cache dir"]
    assert status == "fail" and "DSPARK_LAB_CACHE" in detail


def test_no_tools_on_path(tmp_path, monkeypatch):
    # No git, nvidia-smi, pmset or sysctl: the stamp still comes back, with Nones.
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("DSPARK_LAB_CACHE", str(tmp_path / "cache"))
    s = collect_device_stamp()
    assert set(s) == STAMP_KEYS and s["git_commit"] is None and s["git_dirty"] is None
    json.dumps(s)
    doctor_report()


@pytest.mark.parametrize("failure", [FileNotFoundError("gone"), subprocess.TimeoutExpired("x", 3), PermissionError("no")])
def test_subprocess_failures_never_escape(monkeypatch, failure):
    def boom(*args, **kwargs):
        raise failure

    monkeypatch.setattr(device.subprocess, "run", boom)
    monkeypatch.setattr(device.shutil, "which", lambda name: f"/usr/bin/{name}")  # pretend every tool exists
    s = collect_device_stamp()
    assert s["git_commit"] is None
    assert s["power_thermal"] is None or "nvidia_smi" not in s["power_thermal"]
    json.dumps(s)


def test_fake_nvidia_smi_is_read(tmp_path, monkeypatch):
    tool = tmp_path / "nvidia-smi"
    tool.write_text("#!/bin/sh\necho 'NVIDIA H200, 1980, 3201, 34, 118.52'\necho 'NVIDIA H200, [N/A], 3201, 35, [N/A]'\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gpus = collect_device_stamp()["power_thermal"]["nvidia_smi"]
    assert gpus[0] == {"name": "NVIDIA H200", "clocks_sm_mhz": 1980, "clocks_mem_mhz": 3201, "temperature_c": 34, "power_draw_w": 118.52}
    assert gpus[1]["clocks_sm_mhz"] is None and gpus[1]["power_draw_w"] is None


def test_parsers():
    assert parse_nvidia_smi("garbage\n\n") == []
    therm = parse_pmset_therm(
        "Note: No thermal warning level has been recorded\n"
        "Note: No performance warning level has been recorded\n"
        "2024-01-01 CPU Power notify\n\tCPU_Scheduler_Limit \t= 100\n\tCPU_Available_CPUs \t= 12\n\tCPU_Speed_Limit \t= 80\n"
    )
    assert therm["CPU_Speed_Limit"] == 80 and therm["CPU_Available_CPUs"] == 12 and len(therm["warnings"]) == 2


def fake_mlx(backend, info):
    return lambda: {"backend": backend, "default_device": "Device(gpu, 0)", "device_info": info}


def test_cuda_stamp_and_doctor_from_device_info(tmp_path, monkeypatch):
    # The shape MLX's CUDA backend reports (NVML memory); no GPU needed to check our side.
    info = {"device_name": "NVIDIA H200", "architecture": "sm_90", "total_memory": 150_000_000_000, "free_memory": 1 << 30}
    monkeypatch.setattr(device, "_mlx_facts", fake_mlx("cuda", info))
    monkeypatch.setenv("DSPARK_LAB_CACHE", str(tmp_path / "cache"))
    s = collect_device_stamp()
    assert s["device_name"] == "NVIDIA H200" and s["device_memory_bytes"] == 150_000_000_000
    assert machine_class(s) == "NVIDIA H200 (cuda)"
    checks = {n: (st, d) for n, st, d in doctor_report()}
    assert checks["backend"] == ("ok", "cuda (NVIDIA H200)")
    assert checks["gpu memory"][0] == "warn" and "1.0 GiB free" in checks["gpu memory"][1]


def test_metal_stamp_without_device_name(monkeypatch):
    monkeypatch.setattr(device, "_mlx_facts", fake_mlx("metal", {"architecture": "applegpu_g15s", "memory_size": 64 * 2**30}))
    monkeypatch.setattr(device, "_cpu_model", lambda: "Apple M3 Max")
    s = collect_device_stamp()
    assert machine_class(s) == "Apple M3 Max 64GB (metal)"

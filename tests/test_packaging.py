"""A wheel carries the heads the shipped registry names (setup.py copies fixtures/NAME into
dspark_lab/heads/NAME), and load_pair's resolution finds them there when no checkout is beside
the package: a plain `pip install` runs `generate --mode auto` with the measured heads."""

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from scripts import ROOT, load_script


def _setup_module():
    return load_script("dspark_setup", ROOT / "setup.py")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_build_copies_only_the_registrys_heads_and_refuses_a_missing_one(tmp_path):
    mod = _setup_module()
    root = tmp_path / "repo"
    (root / "dspark_lab" / "data").mkdir(parents=True)
    for name in ("named", "unnamed"):
        (root / "fixtures" / name).mkdir(parents=True)
        for f in mod.HEAD_FILES:
            (root / "fixtures" / name / f).write_text(f"{name} {f}")
    registry = root / "dspark_lab" / "data" / "registry.json"
    pairs = [{"drafter": "fixtures/named"}, {"drafter": "fixtures/named"}, {"drafter": "/elsewhere/head"}, {"mode": "lookup", "drafter": None}]
    registry.write_text(json.dumps({"pairs": pairs}))
    assert mod.registry_heads(registry) == ["named"]
    [copied] = mod.copy_heads(tmp_path / "build", root=root)
    assert copied == tmp_path / "build" / "dspark_lab" / "heads" / "named"
    assert sorted(p.name for p in copied.iterdir()) == sorted(mod.HEAD_FILES)
    assert not (tmp_path / "build" / "dspark_lab" / "heads" / "unnamed").exists()

    (root / "fixtures" / "named" / "model.safetensors").unlink()
    with pytest.raises(SystemExit, match="names fixtures/named, but model.safetensors is not there"):
        mod.copy_heads(tmp_path / "build2", root=root)


def test_a_wheel_carries_the_registrys_heads_and_load_pair_finds_them_there(tmp_path):
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs the git checkout (its files, tracked and not ignored, are what a wheel is built from)")
    tracked = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    src = tmp_path / "src"  # a copy: pip builds a local folder in place and would leave build/ in the checkout
    for rel in filter(None, tracked):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / rel, src / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)], check=True,
                   capture_output=True)
    [wheel] = (tmp_path / "dist").glob("dspark_lab-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)

    named = sorted(_setup_module().registry_heads())
    assert named, "the shipped registry names no committed head"
    shipped = site / "dspark_lab" / "heads"
    assert sorted(p.name for p in shipped.iterdir()) == named  # the heads it names, and only those
    for name in named:
        assert _sha(shipped / name / "model.safetensors") == _sha(ROOT / "fixtures" / name / "model.safetensors")

    # The installed package, with no checkout beside it and run from elsewhere, resolves the
    # registry's fixtures/NAME to its own copy.
    code = ("import json, sys, dspark_lab\n"
            "from dspark_lab.engine.speculative import _registry_drafter\n"
            "print(json.dumps([dspark_lab.__file__, *[_registry_drafter('fixtures/' + n, 'm') for n in sys.argv[1:]]]))\n")
    out = subprocess.run([sys.executable, "-c", code, *named], cwd=tmp_path, env={"PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1",
                         "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True).stdout
    package, *found = json.loads(out.strip().splitlines()[-1])
    assert Path(package).resolve().is_relative_to(site.resolve())
    assert [Path(f).resolve() for f in found] == [(shipped / n).resolve() for n in named]

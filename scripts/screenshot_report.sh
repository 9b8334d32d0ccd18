#!/usr/bin/env bash
# Render a dspark-lab HTML report in headless Chromium and save a PNG screenshot of it.
#
#   scripts/screenshot_report.sh report.html [out.png] [WIDTHxHEIGHT]
#
# Defaults: out.png next to the report, 1400x3000. Needs `chromium` (Debian: apt-get install
# chromium) or google-chrome on PATH. The report is self-contained, so the browser is kept off
# the network (no background networking, component updates or sync) and gets a throwaway
# profile; --virtual-time-budget lets vega finish drawing before the capture.
set -euo pipefail

html=${1:?usage: scripts/screenshot_report.sh report.html [out.png] [WIDTHxHEIGHT]}
out=${2:-${html%.html}.png}
size=${3:-1400x3000}

browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [[ -z "$browser" ]]; then
  echo "no chromium or google-chrome on PATH; install one (Debian: apt-get install chromium)" >&2
  exit 1
fi
[[ -f "$html" ]] || { echo "no such report: $html" >&2; exit 1; }

profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
"$browser" --headless --no-sandbox --disable-gpu --disable-background-networking --disable-component-update \
  --disable-sync --no-first-run --hide-scrollbars --user-data-dir="$profile" --virtual-time-budget=10000 \
  --window-size="${size/x/,}" --screenshot="$(realpath -m "$out")" "file://$(realpath "$html")" >/dev/null 2>&1
[[ -s "$out" ]] || { echo "chromium wrote no screenshot to $out" >&2; exit 1; }
echo "$out"

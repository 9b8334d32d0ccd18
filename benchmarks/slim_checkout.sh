#!/usr/bin/env bash
# Make device calls carry less: put the checkout on a local branch without the folders the GPU
# machine never reads, and put it back afterwards.
#   bash benchmarks/slim_checkout.sh on     # before packing ship parts and making the calls
#   bash benchmarks/slim_checkout.sh off    # after the last call: back to the branch you were on
# Why: every device call carries the checkout's tracked files beside its part, 64 MiB in all.
# With docs/results (each round's generated rows), tests and the fixture head the checkout is
# 35 MiB, which leaves 27 MB parts: the Qwen 1.5B took 34 calls, about 300 device seconds with
# the machine's start. Without those folders (0.75 MB) parts are 62 MB (ship_parts.sh sizes them
# from the tracked files, so pack while slim): 15 calls, and all shipping took 165 s (fifteenth
# round, docs/performance.md). The device runs dspark_lab and benchmarks/ only.
# The branch is a local commit that only removes files; it must never be pushed, and `off`
# deletes it. To edit main meanwhile, use a second worktree: git worktree add ../wt main
set -euo pipefail
root="$(git rev-parse --show-toplevel)"; cd "$root"
branch=device-slim
mark="$(git rev-parse --git-dir)/device-slim-from"  # the branch to return to
leave_out=(${SLIM_LEAVE_OUT:-docs tests fixtures})
case ${1:-} in
  on)
    [ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "the checkout has uncommitted changes: commit or stash them first (the slim branch is made from HEAD)" >&2; exit 1; }
    [ "$(git branch --show-current)" != "$branch" ] || { echo "already slim (on $branch); 'off' goes back" >&2; exit 1; }
    git branch --show-current > "$mark"
    git checkout -q -b "$branch"
    present=(); for d in "${leave_out[@]}"; do [ -e "$d" ] && present+=("$d"); done
    [ ${#present[@]} -eq 0 ] || git rm -r -q -- "${present[@]}"
    git -c user.name=slim -c user.email=slim@localhost commit -q --allow-empty -m "device calls only, never to land: ${leave_out[*]} left out"
    tracked=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
    echo "slim: on $branch, $((tracked / 1000)) kB tracked (left out: ${present[*]:-nothing}); pack ship parts now; 'off' when the calls are done"
    ;;
  off)
    [ "$(git branch --show-current)" = "$branch" ] || { echo "not slim (not on $branch): nothing to undo" >&2; exit 1; }
    [ -z "$(git status --porcelain --untracked-files=no)" ] || { echo "changes made on the slim branch would be lost: move them to the real branch first" >&2; exit 1; }
    back=$(cat "$mark" 2>/dev/null || true)
    [ -n "$back" ] || { echo "do not know which branch to return to ($mark is missing): git checkout BRANCH && git branch -D $branch" >&2; exit 1; }
    git checkout -q "$back"
    git branch -q -D "$branch"
    rm -f "$mark"
    echo "back on $back (the ship parts already cut stay in .device/: they fit a slim checkout's calls only)"
    ;;
  *) echo "usage: bash benchmarks/slim_checkout.sh on|off" >&2; exit 2 ;;
esac

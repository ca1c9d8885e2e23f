#!/usr/bin/env bash
# For the offline GPU machine (after `source .devkit/setup.sh`): runs named commands one after another under one
# deadline and keeps the compile cache coming back with the results.
#
#   bash tools/device_measure.sh SECONDS 'name=command' ['name=command' ...]
#
# * Each command runs with `timeout` set to what is left of SECONDS; its stdout + stderr go to $OUT/<i>_<name>.log
#   and a line "<name> rc=<rc> at=<seconds since start>" to $OUT/steps.txt (rc 124: it ran out of time).
# * The kernel compile cache ($CUTE_MXFP8_CACHE_DIR, default /tmp/mxc) starts from .kcache/kcache.tar.xz where the
#   call carries one, and is tarred into $OUT/kcache.tar.xz every 20 s and at the end, so that a call cut short still
#   brings back what it compiled.  It packs only when an entry is newer than the last pack (or than the carried
#   cache), so timed commands that compile nothing run undisturbed, and no file comes back when nothing was compiled.
#   Keep the file in the git-ignored .kcache/ and carry it: the cache key holds the kernel sources' digest and the
#   toolchain's versions, so entries stay valid until a kernel changes.
# * At most 8 files come back from $OUT: steps.txt, kcache.tar.xz and up to 6 logs.
set -u
deadline=$(( $(date +%s) + ${1:?usage: device_measure.sh SECONDS name=command ...} )); shift
start=$(date +%s)
: "${OUT:?OUT must be set (the device tool sets it)}"
export CUTE_MXFP8_CACHE_DIR=${CUTE_MXFP8_CACHE_DIR:-/tmp/mxc} PYTHONUNBUFFERED=1
mkdir -p "$CUTE_MXFP8_CACHE_DIR"
touch -d @0 /tmp/kcache.mark
if [ -f .kcache/kcache.tar.xz ]; then
    tar -xJf .kcache/kcache.tar.xz -C "$CUTE_MXFP8_CACHE_DIR" && touch /tmp/kcache.mark  # (tar keeps the mtimes)
fi
pack() {  # only when an entry changed since the last pack, so that timed commands after the compiles run undisturbed
    [ -z "$(find "$CUTE_MXFP8_CACHE_DIR" -type f -newer /tmp/kcache.mark -print -quit)" ] && return
    # one pack at a time: the final pack waits for a background one still running (its tar outlives the killed
    # loop and holds the lock until it exits), so the two never write the archive together
    (
        command -v flock > /dev/null && flock 9
        touch /tmp/kcache.mark.new
        tar -cJf /tmp/kcache.tar.xz -C "$CUTE_MXFP8_CACHE_DIR" . 2>/dev/null && cp /tmp/kcache.tar.xz "$OUT/kcache.tar.xz" \
            && mv /tmp/kcache.mark.new /tmp/kcache.mark
    ) 9> /tmp/kcache.lock
}
( while sleep 20; do pack; done ) &
packer=$!
i=0
for spec in "$@"; do
    i=$((i + 1)); name=${spec%%=*}; cmd=${spec#*=}
    left=$(( deadline - $(date +%s) ))
    if [ "$left" -le 5 ]; then echo "$name skipped (no time left)" >> "$OUT/steps.txt"; continue; fi
    timeout "$left" bash -c "$cmd" > "$OUT/${i}_${name}.log" 2>&1
    echo "$name rc=$? at=$(( $(date +%s) - start ))" >> "$OUT/steps.txt"
done
kill "$packer" 2>/dev/null
pack
cat "$OUT/steps.txt"

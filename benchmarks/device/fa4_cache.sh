#!/usr/bin/env bash
# FlashAttention-4's disk cache of compiled kernels (kernels/fa4.py: ~/.cache/longctx/fa4) from
# one machine to the next, so that a fresh machine loads the variants instead of compiling them
# (8B shape, documents, CP = 4 on 4 x H100: 44 variants compiled in 76.6 s, loaded in 0.8 s).
#   at the end of a call:  bash benchmarks/device/fa4_cache.sh save      # -> $OUT/fa4cache.tar.gz
#   here, afterwards:      mkdir -p .carry/fa4cache && cp <files_at>/fa4cache.tar.gz .carry/fa4cache/
#   on the next machine (in the stash call, whose carry has ~12 MB to spare, or any call):
#                          bash benchmarks/device/fa4_cache.sh restore   # carry .carry/fa4cache
# The cache is keyed by the kernels' compile arguments; entries of another FA4 or GPU kind are
# simply not found. A tarball over the carry limit (64 MiB with the rest) cannot travel.
set -eu
dir=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-$HOME/.cache/longctx/fa4}
case "${1:-}" in
  save)
    [ -d "$dir" ] || { echo "[fa4_cache] no cache at $dir"; exit 0; }
    tar czf "$OUT/fa4cache.tar.gz" -C "$dir" .
    echo "[fa4_cache] saved $(find "$dir" -type f | wc -l) files, $(du -h "$OUT/fa4cache.tar.gz" | cut -f1)"
    ;;
  restore)
    archive=.carry/fa4cache/fa4cache.tar.gz
    [ -f "$archive" ] || { echo "[fa4_cache] no $archive"; exit 0; }
    mkdir -p "$dir" && tar xzf "$archive" -C "$dir"
    echo "[fa4_cache] restored $(find "$dir" -type f | wc -l) files into $dir"
    ;;
  *) echo "usage: fa4_cache.sh save|restore" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Where the document layer's time goes at P = 4, 2, 1 (issue 40), one call on a 4-GPU machine after
# fa4_carry.sh's stash call (carry .carry/fa4-2 and .carry/wheels): benchmarks/document_layer_profile.py
# on 4 GPUs; then on GPUs 0,1 (P = 2, then P = 1) while, with RECIPE=1, the fine-tuning recipe
# (issue 42, device_recipe.sh) runs on GPUs 2,3. MIXES, OPTIONS and CPROFILE (the mix whose first
# option runs under cProfile) go to the script; WORLDS picks the sizes (default "4 2 1"). Results
# tarred under $OUT (at most 8 files return).
set -u
source benchmarks/device/device_env.sh || exit 3
mkdir -p "$OUT/profile" "$OUT/logs"
profile() {  # profile NPROC DEVICES
  CUDA_VISIBLE_DEVICES=$2 timeout "${LIMIT:-200}" torchrun --standalone --nproc-per-node "$1" \
    benchmarks/document_layer_profile.py --out "$OUT/profile" ${MIXES:+--mixes $MIXES} \
    ${OPTIONS:+--options $OPTIONS} ${CPROFILE:+--cprofile $CPROFILE} > "$OUT/logs/profile_ws$1.log" 2>&1
  echo "profile ws$1 rc=$?"; grep -h '^{' "$OUT/logs/profile_ws$1.log" | cut -c1-260; tail -2 "$OUT/logs/profile_ws$1.log"
}
worlds=" ${WORLDS:-4 2 1} "
[[ $worlds == *" 4 "* ]] && profile 4 0,1,2,3
if [ "${RECIPE:-0}" = 1 ]; then
  (CUDA_VISIBLE_DEVICES=2,3 OUT="$OUT/recipe" timeout "${RECIPE_LIMIT:-400}" bash benchmarks/device/device_recipe.sh \
    > "$OUT/logs/recipe.log" 2>&1; echo "recipe rc=$?" >> "$OUT/logs/recipe.log") &
fi
[[ $worlds == *" 2 "* ]] && profile 2 0,1
[[ $worlds == *" 1 "* ]] && profile 1 0
wait
[ "${RECIPE:-0}" = 1 ] && grep -h "\[recipe\]\|recipe rc" "$OUT/logs/recipe.log"
(cd "$OUT" && tar czf profile.tar.gz profile logs && rm -rf profile logs)
[ -d "$OUT/recipe" ] && (cd "$OUT" && tar czf recipe.tar.gz recipe && rm -rf recipe)
ls "$OUT"

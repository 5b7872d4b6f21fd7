# Source this on a GPU machine without network access (the device tool's image):
#   source benchmarks/device/device_env.sh && python benchmarks/attention.py
# Tries an editable install; where the offline build tooling cannot do one, stages a copy
# of the checkout in which longctx/models and longctx/kernels are real subpackages, and
# runs from there. Either way `import longctx.models, longctx.kernels` works afterwards.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Pure-Python wheels the image lacks (datasets, dill, multiprocess, gguf, jsonargparse,
# docstring-parser, typeshed-client, importlib_resources), carried along in
# .carry/wheels (pip download --no-deps --only-binary=:all: --python-version 3.12 ...).
if [ -d .carry/wheels ]; then
  python -m pip install -q --no-deps --no-index .carry/wheels/*.whl >/tmp/longctx_wheels.log 2>&1 \
    || echo "[device_env] carried wheels did not install: $(tail -1 /tmp/longctx_wheels.log)"
fi
# Wheels an earlier call on this machine left in /tmp/xwheels (torchao for FP8 runs rides along
# with the FlashAttention-4 stash call, whose carry has room: fa4_carry.sh).
if ls /tmp/xwheels/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-deps --no-index /tmp/xwheels/*.whl >/tmp/longctx_xwheels.log 2>&1 \
    || echo "[device_env] stashed wheels did not install: $(tail -1 /tmp/longctx_xwheels.log)"
fi
# Tokenizers train.py would otherwise train on the device first (tens of seconds each: the 1B
# configs' spm-32768, the recipe's spm-8192), carried as .carry/tok (copied from
# ~/.cache/longctx/tokenizers on a machine that has run them).
if [ -d .carry/tok ]; then
  mkdir -p ~/.cache/longctx/tokenizers && cp .carry/tok/* ~/.cache/longctx/tokenizers/
fi
# FlashAttention-4 (optional "fa4" backend): its compiler wheel is over one call's carry, so
# benchmarks/device/fa4_carry.sh stages it in two halves: call 1 carries .carry/fa4-1 and runs
# `bash .carry/fa4-1/fa4_device.sh stash`; call 2 carries .carry/fa4-2 and sources this file,
# which installs it into /tmp/fa4site. Later calls on the same (warm) machine need neither half.
if [ -d /tmp/fa4site/flash_attn ]; then
  export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
elif [ -f .carry/fa4-2/fa4_device.sh ]; then
  source .carry/fa4-2/fa4_device.sh install || echo "[device_env] FlashAttention-4 not installed"
fi
if ! python -m pip install --no-deps --no-build-isolation -e . -q >/tmp/longctx_pip.log 2>&1 \
   || ! python -c "import longctx.models, longctx.kernels" 2>/dev/null; then
  echo "[device_env] editable install unavailable ($(tail -1 /tmp/longctx_pip.log)); staging a copy"
  rm -rf /tmp/longctx_stage && mkdir -p /tmp/longctx_stage
  cp -r . /tmp/longctx_stage/
  cp -r models /tmp/longctx_stage/longctx/models
  cp -r kernels /tmp/longctx_stage/longctx/kernels
  cd /tmp/longctx_stage
  export PYTHONPATH=/tmp/longctx_stage${PYTHONPATH:+:$PYTHONPATH}
fi
python -c "import longctx.models, longctx.kernels; print('[device_env] longctx from', longctx.__file__)"
# REQUIRE_FA4=1: stop here where FlashAttention-4 is not importable (a call that landed on a fresh
# machine, without the stash call's first half) instead of letting "auto" run other kernels.
if [ "${REQUIRE_FA4:-0}" = 1 ] && ! python -c "import flash_attn.cute" 2>/dev/null; then
  echo "[device_env] REQUIRE_FA4=1 but FlashAttention-4 is not installed here (a fresh machine?): run the stash call again"
  return 3 2>/dev/null || exit 3
fi

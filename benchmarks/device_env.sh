# Source this on a GPU machine without network access (the device tool's image):
#   source benchmarks/device_env.sh && python benchmarks/attention.py
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

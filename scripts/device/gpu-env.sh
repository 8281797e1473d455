# Sourced on the GPU machine: installs the carried MLX CUDA wheels into
# /tmp/site (once) and points the dynamic loader and Python at them.
# The mlx-cuda-13 wheel (87 MB) exceeds one call's carry limit, so it travels
# split in two parts (docs/gpu.md, "How it was run here", explains).
set -e
STAGE=/tmp/stage
mkdir -p "$STAGE"
for d in .gpu1 .gpu2; do [ -d "$d" ] && cp -n "$d"/* "$STAGE"/ 2>/dev/null || true; done
if [ ! -d /tmp/site/mlx ] && ls "$STAGE"/cuda13.part.* >/dev/null 2>&1 && [ "$(ls "$STAGE"/cuda13.part.* | wc -l)" = 2 ]; then
  cat "$STAGE"/cuda13.part.* > "$STAGE"/mlx_cuda_13-0.32.2-py3-none-manylinux_2_35_x86_64.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "$STAGE"/mlx_cuda_13-*.whl "$STAGE"/mlx-0.32.2-*.whl "$STAGE"/mlx_lm-*.whl
fi
export PYTHONPATH=/tmp/site
NV=$(python3 -c "import nvidia, os; print(':'.join(os.path.join(p, d, 'lib') for p in nvidia.__path__ for d in os.listdir(p)))")
export LD_LIBRARY_PATH=/tmp/site/mlx/lib:$NV:${LD_LIBRARY_PATH:-}
export MLX_PYTHON=python3 REPO_ROOT=$PWD
set +e

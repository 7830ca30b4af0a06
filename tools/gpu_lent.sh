#!/bin/bash
# On a lent GPU machine, from the repository root, with .whl/ carried (tools/gpu_wheels.py):
# install the wheels into the machine's own python (no network), then `make gpu-check`.
#     bash tools/gpu_lent.sh --codecs   # a call of its own carrying .whl-codecs/: imagecodecs
#     bash tools/gpu_lent.sh            # then, the machine still warm, carrying .whl/: the
#                                       # check, results under $OUT (or experiments/results)
set -u
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
t0=$(date +%s)
if [ "${1:-}" = "--codecs" ]; then  # libdeflate for tifffile, as a user's install has it
    exec "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl-codecs/*.whl
fi
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl \
    || { echo "installing .whl/ failed: fetch them here with tools/gpu_wheels.py"; exit 3; }
# Lightning's cluster detection imports mpi4py, whose MPI_Init aborts without a launcher:
# the commands avoid it (seg_at_scale.parallel.environment), tests' own Trainers do not
"$PY" -m pip uninstall -y -q mpi4py 2>/dev/null
# the checkout on the machine's path, as `pip install -e .` would (that needs a build)
echo "$PWD" > "$("$PY" -c 'import site; print(site.getsitepackages()[0])')/seg_at_scale_checkout.pth"
"$PY" -c "import seg_at_scale.cli, segmentation_models_pytorch, rasterio, monai" || exit 3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "installed in $(( $(date +%s) - t0 )) s; load $(cut -d' ' -f1-3 /proc/loadavg)"
"$PY" -c "import imagecodecs" 2>/dev/null && echo "DEFLATE: libdeflate (imagecodecs)" \
    || echo "DEFLATE: zlib (no imagecodecs: run gpu_lent.sh --codecs first for a user's speed)"
make gpu-check PY="$PY" NO_VENV=1 OUT="${OUT:-experiments/results}"

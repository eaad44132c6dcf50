#!/usr/bin/env bash
# A/B main vs branch fp8-dequant-out: eager fp8 T5 wall, alternating processes
cd "$(dirname "$0")/.."
mkdir -p /tmp/site /tmp/cupy_cache; pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
tar xzf .device/cupy_cache.tgz -C /tmp/cupy_cache
export PYTHONPATH=/tmp/site FLAME_DEVICE=cuda PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupy_cache
rm -rf /tmp/base && mkdir /tmp/base && cp -r flame_core flame_nn flame_models cuda_src /tmp/base/ && cp -r .device/base_main/* /tmp/base/
(cd /tmp/base && python3 -c "import flame_core.kernels.fp8 as f; print(f.__file__)")
python3 .device/s20_ab.py save
for r in 1 2 3; do
  (cd /tmp/base && PYTHONPATH=/tmp/base:/tmp/site python3 $OLDPWD/.device/s20_ab.py main 2>&1 | grep AB)
  PYTHONPATH=$PWD:/tmp/site python3 .device/s20_ab.py branch 2>&1 | grep AB
done

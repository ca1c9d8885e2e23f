source .devkit/setup.sh >/dev/null; export CUTE_MXFP8_CACHE_DIR=/tmp/mxc
nvidia-smi --query-gpu=name --format=csv,noheader
# tests with the ops as configured (token-group build reloading) and with it kept
python -m pytest -q -m gpu tests/test_fast_mode.py -k "grouped_cast_kernels_bit_exact or cast_kernels_bit_exact" -x -p no:cacheprovider > $OUT/t_reload.log 2>&1 &
python - > $OUT/t_kept.log 2>&1 <<'PY' &
import torch, pytest, sys
from cute_mxfp8.ops import cute_kernels as CK
CK.TILE_KEEP_RUN[torch.bfloat16, True] = True
sys.exit(pytest.main(["-q", "-m", "gpu", "tests/test_fast_mode.py", "-k", "grouped_cast_kernels_bit_exact or fast_mode_mlp_on_sm90", "-x", "-p", "no:cacheprovider"]))
PY
wait
tail -3 $OUT/t_reload.log $OUT/t_kept.log
python tools/fast_mode_casts.py --out $OUT 2>&1 | tee $OUT/casts.log

source .devkit/setup.sh >/dev/null; export CUTE_MXFP8_CACHE_DIR=/tmp/mxc
python tools/fast_mode_casts.py --out $OUT 2>&1 | tee $OUT/casts.log

# call 2: why the first step compiles modules from source (a check), a throwaway warm-up process,
# then round 1 of before / after at 8, 32 and 64 layers and FSDP2 + per-block compile at 32
source docs/bench/compile_time/s69/common.sh
python3 - > $R/pyc.txt 2>&1 <<'PY'
import os, sys, sysconfig
import torch._inductor.scheduler as m
print("dont_write_bytecode", sys.dont_write_bytecode, "pycache_prefix", sys.pycache_prefix,
      "PYTHONDONTWRITEBYTECODE", os.environ.get("PYTHONDONTWRITEBYTECODE"))
print(m.__file__, m.__cached__, "cached exists", os.path.exists(m.__cached__),
      "dir writable", os.access(os.path.dirname(m.__file__), os.W_OK))
PY
cat $R/pyc.txt
(timeout 60 python3 scripts/profile_compile.py --device cuda --world 1 --blocks 2 --pack-blocks \
  --out $R/warm > $R/warm.log 2>&1; echo "warm rc=$? $(date +%T)"); rm -rf $R/warm
row after a8a 8 50 shardc-packed
row before b8a 8 50 shardc-packed
row after a32a 32 60 shardc-packed
row fsdp2 f32a 32 50 fsdp2-compile
row after a64a 64 75 shardc-packed
row before b64a 64 75 shardc-packed
rows2 a8a b8a a32a f32a a64a b64a > $R/rows2.txt 2>&1; cut -c1-330 $R/rows2.txt
cd $OUT && tar czf call2.tgz r && rm -rf r

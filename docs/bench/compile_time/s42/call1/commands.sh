# s42 call 1 (issue 18): shardc.shard(..., pack_blocks=True) ("shardc-packed": each block's
# shards in one buffer, gathered as one tensor) against the default shardc, cold then warm at 8
# and 32 layers (packed also 64), fsdp2-compile at 32; one H200, torch 2.11, world 1, 1b config,
# each row a fresh process with its own cache directories.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
nvidia-smi -L > $R/commit.txt
(find shardc -name "*.py" | sort | xargs md5sum | md5sum | sed "s/-/main/") >> $R/commit.txt
ct() {  # name, timeout, args...
  local name=$1 t=$2; shift 2
  echo "== $name $(date +%T)"
  timeout $t python3 benchmarks/compile_time.py --nproc 1 --model 1b --steps 3 --timeout-s 150 --out $R --name $name "$@" > $R/$name.log 2>&1; echo "rc=$? $(date +%T)"
  rm -rf $R/*_caches
  grep -E "^\| *[0-9]+ \|" $R/$name.md | cut -c1-160
}
ct packed 290 --depths 8 32 64 --modes shardc-packed --caches cold warm
ct shardc 200 --depths 8 32 --modes shardc --caches cold warm
ct fsdp2 80 --depths 32 --modes fsdp2-compile --caches cold

# gpu_env.sh: docs/bench/predict/s21_default/commands.sh
# The thirtieth session, three nvidia-h200 starts: call 1 gpu_1.sh (with gpu_copy_slowdown.py), call 2 gpu_2.sh, call 3 gpu_3.sh

# gpu_1.sh
# s30 call 1 (issue 22, per saved activation): (a) how much pinned host<->device copies on a side stream slow compute on the
# default stream (the cost model prices every busy lane with the profile's overlap_slowdown, calibrated on NCCL);
# (b) the 1b config, 8 layers, batch 4, world 1, budget 10.17 GiB (10920751988 B): main without the parts lever (gpu_old/,
# git archive of HEAD) against the working tree with it, alternating, each row its own torchrun, 5 timed steps after 2.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
timeout 120 python3 gpu_copy_slowdown.py > $R/slowdown.txt 2>&1; cat $R/slowdown.txt
ROOT=$PWD
for i in 1 2; do
  for v in old new; do
    if [ $v = old ]; then D=$ROOT/gpu_old; else D=$ROOT; fi
    ( cd $D && PYTHONPATH=$D timeout 200 python3 benchmarks/budget_sweep.py --nproc 1 --model 1b --budgets 10920751988 --fresh \
        --run-estimate-s 60 --run-timeout-s 180 --out $R/${v}$i -- --n-layers 8 ) > $R/${v}$i.log 2>&1
    echo "== $v $i"; grep -E "^\{" $R/${v}$i.log | cut -c1-400; grep -E "Traceback|Error" $R/${v}$i.log | head -3
  done
done
cd $OUT && tar czf c1.tgz r && rm -rf r

# gpu_copy_slowdown.py
"""How much a host<->device copy on a side stream slows compute on the default stream (one GPU):
a bf16 matmul loop and a memory-bound add loop, alone and beside queued pinned copies each way."""
import torch


def timed(fn, reps=3):
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e))
    return sorted(out)[len(out) // 2]


a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
x = torch.randn(1 << 28, device="cuda")  # 1 GiB
y = torch.randn(1 << 28, device="cuda")
host = torch.empty(512 << 20, dtype=torch.uint8, pin_memory=True)
dev = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
side = torch.cuda.Stream()


def mm():
    for _ in range(60):
        a @ b


def add():
    for _ in range(60):
        torch.add(x, y, out=x)


def beside_copies(fn, to_device, n=14):
    """``fn``'s time on the default stream while ``n`` copies, queued first, run on the side
    stream (they outlast it); its events are recorded on the default stream only."""
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(n):
            (dev.copy_(host, non_blocking=True) if to_device
             else host.copy_(dev, non_blocking=True))
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e)


def copies_alone(to_device, n=14):
    def run():
        for _ in range(n):
            (dev.copy_(host, non_blocking=True) if to_device else host.copy_(dev, non_blocking=True))
    return run


mm(); add(); torch.cuda.synchronize()
for name, fn in (("matmul", mm), ("add", add)):
    alone = timed(fn)
    for way, to_device in (("d2h", False), ("h2d", True)):
        cp = timed(copies_alone(to_device))
        both = sorted(beside_copies(fn, to_device) for _ in range(3))[1]
        print(f"{name:6s} alone {alone:8.2f} ms | 14 {way} copies of 512 MiB alone {cp:8.2f} ms "
              f"| beside them {both:8.2f} ms | slowdown {both / alone:.3f}")

# gpu_2.sh (call 2, a second start)
# s30 call 2 (issue 22, per saved activation), same start as call 1: the 1b config, 8 layers, batch 4, world 1, main without the parts lever
# (gpu_old/) against the working tree (the parts lever, the copy lane without the compute slowdown, needless parts dropped), alternating,
# each row its own torchrun with empty Inductor/Triton caches, 5 timed steps after 2: twice at 11.1 GiB (11918534246 B: the new planner
# offloads parts of 5 blocks and recomputes none, the old one recomputes one block), once more at 10.17 GiB (10920751988 B).
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
ROOT=$PWD
row() {  # version, budget, label
  if [ $1 = old ]; then D=$ROOT/gpu_old; else D=$ROOT; fi
  C=$(mktemp -d)
  ( cd $D && PYTHONPATH=$D TORCHINDUCTOR_CACHE_DIR=$C/inductor TRITON_CACHE_DIR=$C/triton timeout 170 python3 benchmarks/budget_sweep.py --nproc 1 --model 1b \
      --budgets $2 --fresh --run-estimate-s 60 --run-timeout-s 160 --out $R/$3 -- --n-layers 8 ) > $R/$3.log 2>&1
  echo "== $3"; grep -E "^\{" $R/$3.log | cut -c1-330; grep -E "Traceback|Error" $R/$3.log | head -3
}
for i in 1 2; do row old 11918534246 old_111_$i; row new 11918534246 new_111_$i; done
row old 10920751988 old_1017_3; row new 10920751988 new_1017_3
cd $OUT && tar czf c2.tgz r && rm -rf r

# gpu_3.sh (call 3, a third start)
# s30 call 3 (issue 22): a warm start under the peak budget after the fix (shardc.compile.backend.restore_region: a restored plan
# that steps the optimizer in chunks steps it in chunks again). The 1b config, 8 layers, batch 4, world 1, 10.17 GiB
# (10920751988 B): the working tree twice with one Inductor/Triton cache directory (cold, then warm: AOTAutograd's cache hit
# restores the plan), then main without the fix (gpu_old/) the same way.
source gpu_env.sh
R=$OUT/r; rm -rf $R; mkdir -p $R
git log --oneline -1 > $R/commit.txt 2>&1; git status --short >> $R/commit.txt; git diff | sha256sum >> $R/commit.txt; nvidia-smi -L >> $R/commit.txt; nproc >> $R/commit.txt
ROOT=$PWD
for v in new old; do
  if [ $v = old ]; then D=$ROOT/gpu_old; else D=$ROOT; fi
  C=$(mktemp -d)
  for t in cold warm; do
    ( cd $D && PYTHONPATH=$D TORCHINDUCTOR_CACHE_DIR=$C/inductor TRITON_CACHE_DIR=$C/triton SHARDC_LOG=INFO timeout 170 python3 benchmarks/budget_sweep.py \
        --nproc 1 --model 1b --budgets 10920751988 --fresh --run-estimate-s 60 --run-timeout-s 160 --out $R/${v}_$t -- --n-layers 8 ) > $R/${v}_$t.log 2>&1
    echo "== $v $t"; grep -E "^\{" $R/${v}_$t.log | cut -c1-330; grep -E "Traceback|Error" $R/${v}_$t.log | head -3
    ls $C/inductor/shardc/plans 2>/dev/null | head -3
  done
done
cd $OUT && tar czf c3.tgz r && rm -rf r

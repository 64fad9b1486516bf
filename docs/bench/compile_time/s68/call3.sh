# call 3 (the session's last device time, a fresh machine): one round of the after tree at 8 / 64
# / 32 layers, after a throwaway warm-up process (CUDA context, torch and Inductor imported) so
# that the first timed row does not pay the machine's cold start (call 1's first row timed out)
source docs/bench/s61_not_run/prelude.sh
(timeout 40 python3 -c "import torch, torch._inductor.compile_fx; torch.zeros(1, device='cuda').sum().item()"; echo "warm-up rc=$? $(date +%T)")
HERE=$PWD
row() { (PYTHONPATH=$HERE timeout $3 python3 benchmarks/compile_time.py $B --caches cold \
  --out $R --name $1 --depths $2 --modes $4 > $R/$1.log 2>&1); echo "$1 rc=$? $(date +%T)"; rm -rf $R/*_caches; }
row a8d 8 50 shardc-packed
row a64d 64 75 shardc-packed
row a32d 32 60 shardc-packed
for f in a8d a64d a32d; do python3 -c "
import json, sys
d = json.load(open('$R/$f.json'))['runs'][0]['record']
print('$f', 'first %.2f' % d['first_step_s'], {k: round(v, 2) for k, v in d['first_step_phases_s'].items()}, 'steady %.1f ms' % (1e3 * d['steady_step_s']), d.get('loss'), d.get('plan_hashes'))
" 2>&1 | cut -c1-250; done
cd $OUT && tar czf call3.tgz r && rm -rf r

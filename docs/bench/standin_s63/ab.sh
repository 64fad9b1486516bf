cd /work/main
for i in 1 2 3; do
  for t in before after; do
    d=/work/main; [ $t = before ] && d=/tmp/s63/wt_before
    (cd $d && PYTHONPATH=$d timeout 900 $PY /work/main/docs/bench/standin_s63/seq2seq_first_step.py 2>&1 | grep -E "TOTAL|AOTAutograd joint graph|backend total" | sed "s/^/$t $i /")
  done
done

fixes() {  # lo hi -> 0 if fixed
  .venv/bin/python .probe/reuse_edit.py /tmp/ind_reuse1_orig /tmp/ind_edit $1-$2 > /dev/null
  out=$(TORCHINDUCTOR_CACHE_DIR=/tmp/ind_edit timeout 900 .venv/bin/python .probe/sunkpart.py 1 2>&1 | grep "worst param")
  echo "$1-$2: $out" >&2
  case "$out" in *e-08*|*e-09*|*"(0.0"*) return 0;; *) return 1;; esac
}
lo=0; hi=310   # invariant: [0,hi) fixes, [0,lo) does not
while [ $((hi - lo)) -gt 1 ]; do
  mid=$(( (lo + hi) / 2 ))
  if fixes 0 $mid; then hi=$mid; else lo=$mid; fi
done
echo "prefix needs up to site $((hi-1))" >&2
fixes $((hi-1)) $hi && echo "site $((hi-1)) alone fixes" >&2

#!/bin/bash
# usage: go_hf.sh LOGNAME VARIANTS WORLDS MODE
cd "$(dirname "$0")/../../.."
log=docs/bench/probes_s75/logs/$1.txt; shift
echo "# $(date -u) PYTHONPATH=.:tests:docs/bench/probes_s75 python docs/bench/probes_s75/hf_probe.py $*" >> $log
SHARDC_TEST_JOIN_TIMEOUT_S=${JOIN:-600} PYTHONPATH=.:tests:docs/bench/probes_s75 /work/main/.venv/bin/python docs/bench/probes_s75/hf_probe.py "$@" 2>&1 | grep -v "right-padding was detected" >> $log

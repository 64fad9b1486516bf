#!/bin/bash
# usage: go.sh LOGNAME SCENARIOS WORLDS MODE [pack|nopack]
cd "$(dirname "$0")/../../.."
log=docs/bench/probes_s75/logs/$1.txt; shift
echo "# $(date -u) PYTHONPATH=.:tests:docs/bench/probes_s75 python docs/bench/probes_s75/run.py $*" >> $log
SHARDC_TEST_JOIN_TIMEOUT_S=${JOIN:-600} PYTHONPATH=.:tests:docs/bench/probes_s75 /work/main/.venv/bin/python docs/bench/probes_s75/run.py "$@" >> $log 2>&1

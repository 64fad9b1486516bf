cd /work/main
for round in 1 2 3; do
  for layers in 2 8; do
    for variant in before after; do
      if [ $variant = before ]; then PP=/tmp/s75before; else PP=/work/main; fi
      line=$(PYTHONPATH=$PP timeout 600 .venv/bin/python docs/bench/s75/dropout_compile.py $layers 2>/dev/null | tail -1)
      echo "$round $variant $line"
    done
  done
done

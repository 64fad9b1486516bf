"""The training-step benchmark behind ``benchmarks/train_bench.py`` (its command line).

One concern per module, in the order a run uses them:

``workload``     model configurations, the seeded model, synthetic batches
``setup``        ``Setup``, what a mode hands the training loop, and shared helpers
``baselines``    FSDP2 (eager / compiled blocks) and the communication-free bound
``simplefsdp``   the SimpleFSDP baseline (DTensor parametrization, Inductor overlap scheduler)
``shardc_mode``  shardc through its public API, and its plan summary
``modes``        the modes by name
``runner``       one mode run and measured on one rank; the ranks' results merged
``kernels``      exposed communication from profiler kernel intervals
``goals``        the issue's goals and the diagnosis sentences
``report``       the markdown report (and re-rendering an old JSON)
``provenance``   command, shardc source digest, git, NCCL
``units``        number formatting

Imported as the top-level package ``train`` with ``benchmarks/`` on ``sys.path``, which
``train_bench.py`` arranges. It imports shardc's public API only (``shardc``,
``shardc.models.llama``).
"""

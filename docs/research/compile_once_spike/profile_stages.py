"""cProfile the first step of scratch/exp_compile.py and print where time goes, by a few
functions of interest (cumulative seconds). Usage: python scratch/profile_stages.py LAYERS MODE"""
import cProfile
import pstats
import sys

sys.argv = ["exp_compile.py", "--layers", sys.argv[1], "--mode", sys.argv[2]]
sys.path.insert(0, "scratch")
import exp_compile  # noqa: E402

prof = cProfile.Profile()
prof.runcall(exp_compile.main)
st = pstats.Stats(prof)
WANT = ("to_local", "__torch_dispatch__", "_gather_setup_context", "_gather_backward",
        "gather_param", "read", "call_user_compiler", "aot_dispatch_autograd", "create_joint",
        "min_cut_rematerialization_partition", "plan_region", "apply_plan", "_compile_inner",
        "run_fw_bw_metadata", "flatten_subclass", "unwrap_tensor_subclasses",
        "wrap_tensor_subclasses", "__tensor_flatten__", "_build_guards", "build_guards",
        "InstructionTranslator.run", "run_ctx_mgr", "trace_joint", "_create_graph",
        "inner_fn", "joint_helper", "fake_tensor", "FakeTensorMode.dispatch", "proxy_call",
        "_fx_compiler", "recompile", "python_code")
rows = []
for (fname, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
    if func in WANT or any(w in func for w in ("tensor_flatten", "subclass")):
        rows.append((ct, nc, f"{fname.split('site-packages/')[-1]}:{line}:{func}"))
for ct, nc, name in sorted(rows, reverse=True)[:40]:
    print(f"{ct:8.2f}s {nc:8d}  {name}")

"""Clone the buffers of selected '# reuse' lines in Inductor's generated backward modules.
reuse_edit.py ORIG_DIR DEST_DIR SPEC ; SPEC 'all' or 'file_index:line_index,...' or 'lo-hi' over a global numbering"""
import os, re, shutil, sys
orig, dest, spec = sys.argv[1:4]
shutil.rmtree(dest, ignore_errors=True); shutil.copytree(orig, dest)
files = sorted(os.path.relpath(os.path.join(d, f), dest) for d, _, fs in os.walk(dest) for f in fs
               if f.endswith(".py") and "partitioned_bw_subgraph" in open(os.path.join(d, f)).read())
sites = []
for fi, rel in enumerate(files):
    lines = open(os.path.join(dest, rel)).read().split("\n")
    for li, l in enumerate(lines):
        if l.rstrip().endswith("# reuse"):
            sites.append((rel, li))
if spec == "list":
    for i, (rel, li) in enumerate(sites):
        print(i, rel, li, open(os.path.join(dest, rel)).read().split("\n")[li].strip()[:160])
    sys.exit()
if spec == "all": chosen = set(range(len(sites)))
else:
    lo, hi = map(int, spec.split("-")); chosen = set(range(lo, hi))
pat_plain = re.compile(r"^(\s*)(\w+) = (\w+); del (\w+)  # reuse$")
pat_re = re.compile(r"^(\s*)(\w+) = reinterpret_tensor\((\w+), (.*); del (\w+)  # reuse$")
by_file = {}
for i in chosen:
    by_file.setdefault(sites[i][0], []).append(sites[i][1])
n = 0
for rel, lis in by_file.items():
    p = os.path.join(dest, rel); lines = open(p).read().split("\n")
    for li in lis:
        l = lines[li]
        m = pat_plain.match(l)
        if m:
            lines[li] = f"{m[1]}{m[2]} = {m[3]}.clone(); del {m[4]}  # reuse"; n += 1; continue
        m = pat_re.match(l)
        if m:
            lines[li] = f"{m[1]}{m[2]} = reinterpret_tensor({m[3]}.clone(), {m[4]}; del {m[5]}  # reuse"; n += 1; continue
        print("unmatched", rel, li, l)
    open(p, "w").write("\n".join(lines))
print("edited", n, "of", len(sites), "sites")

import collections, gzip, pickle
s = pickle.load(gzip.open("snap.pickle.gz", "rb"))
tr = s["device_traces"][0]
live = {}; cur = 0; best = (0, None, None)
for i, e in enumerate(tr):
    a = e["action"]
    if a == "alloc":
        live[e["addr"]] = e; cur += e["size"]
        if cur > best[0]: best = (cur, i, dict(live))
    elif a in ("free_requested",):
        if e["addr"] in live: cur -= live.pop(e["addr"])["size"]
print("events", len(tr), "peak", best[0], "at", best[1])
def where(e):
    fr = e.get("frames") or []
    keep = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in fr if "shardc" in f["filename"] or "test_offload" in f["filename"] or "optim" in f["filename"]]
    return " < ".join(keep[:4]) or (fr[0]['name'] if fr else "?")
groups = collections.Counter(); cnt = collections.Counter()
for e in best[2].values():
    k = where(e); groups[k] += e["size"]; cnt[k] += 1
for k, v in groups.most_common(25): print(f"{v/1e6:9.1f} MB {cnt[k]:4d}  {k[:300]}")
# what happened just before peak
for e in tr[best[1]-5:best[1]+1]: print(e["action"], e["size"], where(e)[:200])

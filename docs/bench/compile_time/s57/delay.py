"""Offline: delay each block's fp32 gradient (and the bf16 gradient's free) by one block."""
import gzip, json, sys
from shardc.memory.allocator_history import replay
G32, G16 = 205537280, 102768640
h = json.load(gzip.open(sys.argv[1]))
ev0 = h["events"]
# unique ids per request, so that reordered frees name their own request
ev, live, nid = [], {}, 1
for e in ev0:
    if e[0] == "a":
        live[e[1]] = nid; ev.append(["a", nid, e[2]]); nid += 1
    elif e[0] == "f":
        ev.append(["f", live.pop(e[1])])
    else:
        ev.append(e)
base = replay(h)
print("recorded: reserved %.2f GiB allocated %.2f GiB misplaced %d" % (base.peak_reserved / 2**30, base.peak_allocated / 2**30, base.misplaced))
g32 = [i for i, e in enumerate(ev) if e[0] == "a" and e[2] == G32]
g16 = [i for i, e in enumerate(ev) if e[0] == "a" and e[2] == G16]
moves = {}  # event index -> new anchor index (insert before)
for i in g32:
    prev16 = max(j for j in g16 if j < i)
    addr16 = ev[prev16][1]
    free16 = next((k for k in range(i, len(ev)) if ev[k][0] == "f" and ev[k][1] == addr16), None)
    free32 = next((k for k in range(i, len(ev)) if ev[k][0] == "f" and ev[k][1] == ev[i][1]), len(ev))
    if free16 is None:
        continue
    nxt16 = [j for j in g16 if j > free16]
    if not nxt16 or (g32.index(i) + 1 < len(g32) and False):
        continue
    anchor = nxt16[0]
    # only within the same backward: the next bf16 grad must come before the next fp32 grad + some
    later32 = [j for j in g32 if j > i]
    if not later32 or anchor > later32[0] or free32 < anchor:
        continue
    moves[i] = anchor
    moves[free16] = anchor
    # the fp32 gradient's own frees stay where they are (after the optimizer step)
new = []
pending = {}
for a, k in ((a, k) for k, a in moves.items()):
    pending.setdefault(a, []).append(k)
for j, e in enumerate(ev):
    for k in sorted(pending.get(j, [])):
        new.append(ev[k])
    if j not in moves:
        new.append(e)
h2 = dict(h, events=new)
r = replay(h2)
print("delayed %d: reserved %.2f GiB allocated %.2f GiB misplaced %d" % (len(moves) // 2, r.peak_reserved / 2**30, r.peak_allocated / 2**30, r.misplaced))

"""Scan partitioned graphs' body calls for outputs that alias inputs or other outputs.
Installed as a wrapper of pipeline.read_repeated_outputs_once; prints one line per finding."""
import torch
from torch import fx
from shardc.compile import pipeline
from shardc.passes.body import body_calls

VIEWS = {"view", "reshape", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select",
         "alias", "unsqueeze", "squeeze", "as_strided", "detach", "_reshape_alias", "view_as", "unflatten", "split", "chunk", "narrow"}

def base(n):
    seen = []
    while isinstance(n, fx.Node) and n.op == "call_function":
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        if name not in VIEWS:
            break
        seen.append(name); n = n.args[0]
    return n, seen

FOUND = []
def scan(gm, tag):
    for call in body_calls(gm):
        body = getattr(gm, call.args[0].target)
        out = next(iter(body.graph.find_nodes(op="output"))).args[0]
        if not isinstance(out, (tuple, list)):
            continue
        read = {u.args[1] for u in call.users}
        bases = {}
        anchor_chain = {}
        for i, o in enumerate(out):
            if not isinstance(o, fx.Node):
                continue
            b, chain = base(o)
            kind = None
            if b.op == "placeholder":
                kind = f"input {b.name}" + (f" via {chain}" if chain else "")
            if b in bases:
                kind = (kind or "") + f" same base as output {bases[b]} (anchor chain {anchor_chain[bases[b]]})" + (f" via {chain}" if chain else "")
            if b not in bases:
                bases[b] = i
                anchor_chain[i] = chain
            if kind:
                FOUND.append((tag, call.args[0].target, i, i in read, kind))
                extra = ""
                if chain:
                    extra = f" base={b.format_node()[:200]}"
                line = f"ALIAS {call.args[0].target} out {i} {'read' if i in read else 'unread'} {kind}{extra}"
                print(line, flush=True)
                import os
                with open("/tmp/alias_found.txt", "a") as f:
                    f.write(os.environ.get("PYTEST_CURRENT_TEST", "?") + " | " + line + "\n")

orig = pipeline.read_repeated_outputs_once
def wrapped(gm):
    scan(gm, "graph")
    return orig(gm)
pipeline.read_repeated_outputs_once = wrapped

"""Graph rewrites: each module holds one pass (a function from a graph, plus explicit inputs, to
a graph) and no global state."""

"""For people: the plan's renderings, ``shardc.explain``, the CLI, planning from a template."""

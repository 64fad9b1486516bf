import os, sys
if os.environ.get("ALIAS_SCAN"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import alias_scan  # noqa: F401
    except Exception as e:  # compile workers etc.
        pass

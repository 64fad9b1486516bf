import sys

from harness import run

if __name__ == "__main__":
    module = sys.argv[1]
    names = sys.argv[2].split(",")
    worlds = tuple(int(w) for w in sys.argv[3].split(",")) if len(sys.argv) > 3 else (1, 2, 3)
    mode = sys.argv[4] if len(sys.argv) > 4 else "fx"
    tol = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-5
    summary = []
    for name in names:
        summary += run(name, module, worlds, tol=tol, mode=mode)
    print("SUMMARY", summary)

import sys

from harness import run

if __name__ == "__main__":
    module, name, world, variants = sys.argv[1], sys.argv[2], int(sys.argv[3]), tuple(sys.argv[4].split(","))
    mode = sys.argv[5] if len(sys.argv) > 5 else "fx"
    print(run(name, module, (world,), variants=variants, mode=mode))

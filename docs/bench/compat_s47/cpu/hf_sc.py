import sys

sys.path.insert(0, "/work/main/tests"); sys.path.insert(0, "/work/main")
import real_models as rm
from dist_utils import run_ranks

if __name__ == "__main__":
    for w in (1, 2):
        r = run_ranks(rm.run_scenarios, w, ["hf_checkpoint"])
        out = r[0]["hf_checkpoint"]
        print(w, "exception" in out, str(out.get("exception", ""))[:300].replace("\n", " "))

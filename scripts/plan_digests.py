"""Print the plan digests that a refactoring must leave unchanged.

    PYTHONPATH=$PWD python scripts/plan_digests.py [--out DIR] [--json PLAN.json ...]

Two plans are made on a fake process group (no GPU, no data moved): the demo model of
``examples/train_llama.py`` at 2 ranks (4 sequences of 24 tokens per rank, FX execution), and
``python -m shardc plan llama-8b --world-size 64`` (the CLI's defaults). ``--json`` adds the
digest of plans dumped by a real run (``SHARDC_DUMP`` / the demo's ``out/demo/plan``).

The digest is :func:`semantic_digest`: the plan's comparable data (``shardc`` template's
``comparable_plan``: no node names, notes or hash) with what only records the format removed
(the plan version, the explicit link between an HSDP all-reduce and its reduce-scatter, which the
collective ids already imply, and predictions a plan does not have), so a plan written in a newer
format of the same content has the same digest. ``--out`` also writes each plan's JSON there.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))

# Keys that say how a plan is written, not what it plans (see the module docstring).
_FORMAT_ONLY = ("version", "hash", "notes")
_COLLECTIVE_FORMAT_ONLY = ("link",)


def semantic_data(data: dict) -> dict:
    """A plan's JSON data reduced to its content (see the module docstring)."""
    data = json.loads(json.dumps(data))
    for key in _FORMAT_ONLY:
        data.pop(key, None)
    for ops in data["graphs"].values():
        for op in ops:
            op.pop("name", None)
    for c in data["collectives"]:
        c["overlaps"] = len(c["overlaps"]) if isinstance(c["overlaps"], list) else c["overlaps"]
        for key in _COLLECTIVE_FORMAT_ONLY:
            c.pop(key, None)
    data["predicted"] = _numbers(data.get("predicted") or {})
    return data


def _numbers(value):
    """Predictions as floats (nested ones too: per-rank or per-stage predictions are dicts),
    without the ones a plan does not have (None)."""
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_numbers(v) for v in value]
    return float(value) if isinstance(value, (int, float)) else value


def semantic_digest(data: dict) -> str:
    blob = json.dumps(semantic_data(data), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _plans() -> dict[str, object]:
    from train_llama import CONFIG

    from shardc.tools.cli import parse_model_spec, plan_model

    cluster = {"peak_flops": 400e12, "bus_bandwidth": 100e9, "latency_s": 10e-6,
               "mem_bandwidth": 3.0e12}  # the CLI's defaults
    demo, _ = plan_model(CONFIG, 2, 4, 24, {})
    cfg = parse_model_spec("llama-8b")
    llama8b, _ = plan_model(cfg, 64, 1, cfg.max_seq_len, {"cluster": cluster})
    return {"demo (2 ranks)": demo, "llama-8b --world-size 64": llama8b}


def _read(path: str) -> dict:
    raw = Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="also write each plan's JSON here")
    parser.add_argument("--json", nargs="*", default=[], help="dumped plan JSON files to digest")
    parser.add_argument("--skip-models", action="store_true", help="only the --json files")
    args = parser.parse_args(argv)
    rows = []
    if not args.skip_models:
        for name, plan in _plans().items():
            data = plan.to_dict()
            rows.append((name, semantic_digest(data)))
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                slug = name.split(" ")[0]
                Path(args.out, f"{slug}.json").write_text(json.dumps(data, indent=1))
    rows += [(path, semantic_digest(_read(path))) for path in args.json]
    for name, digest in rows:
        print(f"{digest}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

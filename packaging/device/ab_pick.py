"""The setting whose restores reached first token soonest (median) in an ab.sh receipts file (RECEIPTS=FILE), for
a run that follows in the same device call: prints it (VAR=VALUE), or nothing when no restore of it succeeded.
Usage: python3 packaging/device/ab_pick.py FILE [--json]"""

import json
import statistics
import sys


def medians(path: str) -> dict[str, float]:
    by: dict[str, list[float]] = {}
    for line in open(path):
        row = json.loads(line)
        result = (row["receipt"].get("result") or {})
        if row["receipt"].get("state") == "succeeded" and result.get("time_to_first_token_s"):
            by.setdefault(row["setting"], []).append(float(result["time_to_first_token_s"]))
    return {s: statistics.median(v) for s, v in by.items()}


if __name__ == "__main__":
    m = medians(sys.argv[1])
    if "--json" in sys.argv:
        print(json.dumps(dict(sorted(m.items(), key=lambda kv: kv[1]))))
    elif m:
        print(min(m, key=m.__getitem__))

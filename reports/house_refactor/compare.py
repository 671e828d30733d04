"""Print the paired before/after figures of run.sh: overall tok/s and speedup per method, and whether every
method's greedy tokens equal plain's and the other build's on every prompt."""
import json
import sys

before, after = (json.load(open(p))["runs"]["0.0"] for p in sys.argv[1:3])
print("| method | before tok/s | after tok/s | after/before | before vs plain | after vs plain | tok/fwd after |"
      " greedy = plain (after) | after tokens = before tokens |")
print("|---|---|---|---|---|---|---|---|---|")
for m in before["summary"]:
    b, a = before["summary"][m]["overall"], after["summary"][m]["overall"]
    rb, ra = before["records"][m], after["records"][m]
    same_plain = sum(x["token_ids"] == y["token_ids"] for x, y in zip(ra, after["records"]["plain"]))
    same_build = sum(x["token_ids"] == y["token_ids"] for x, y in zip(ra, rb))
    acc = sum(r["accepted"] or 0 for r in ra)
    fwd = sum((r["target_forwards"] or 1) - 1 for r in ra)
    tau = (acc + fwd) / fwd if fwd and ra[0]["drafted"] is not None else 1.0
    print(f"| {m} | {b['tokens_per_s']:.1f} | {a['tokens_per_s']:.1f} | {a['tokens_per_s'] / b['tokens_per_s']:.2f} |"
          f" {b['speedup']:.2f}x | {a['speedup']:.2f}x | {tau:.2f} | {same_plain}/{len(ra)} | {same_build}/{len(ra)} |")

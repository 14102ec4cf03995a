#!/usr/bin/env python3
"""Where a distributed step's communication is exposed, from a `kiln bench --timeline FILE` trace.

Per traced step: the span, the time the compute kernels cover, the time the collectives (NCCL's
kernels) cover, the part of it beside compute and the part alone (exposed: the compute stream had
nothing running); then, for the median step, the exposed time per collective and output type, and
the longest exposed stretches with the compute kernels around them.

    python3 bench/timeline_overlap.py TRACE.json [--windows 12]
"""
import argparse
import bisect
import collections
import json


def union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def uncovered(s, e, cover, starts):
    """The part of [s, e] outside the union `cover` (sorted, disjoint; `starts` its starts)."""
    t, cur = 0.0, s
    i = max(0, bisect.bisect_right(starts, s) - 1)
    while cur < e and i < len(cover):
        a, b = cover[i]
        i += 1
        if b <= cur:
            continue
        if a >= e:
            break
        if a > cur:
            t += a - cur
        cur = max(cur, b)
    return t + max(0.0, e - cur)


def is_comm(e):
    return "nccl" in e["args"].get("kernel", "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--windows", type=int, default=12)
    a = ap.parse_args()
    events = [e for e in json.load(open(a.trace))["traceEvents"] if e.get("ph") == "X"]
    steps = collections.defaultdict(list)
    for e in events:
        steps[e["args"].get("step", 0)].append(e)
    rows = []
    for step, evs in sorted(steps.items()):
        comp = union([(e["ts"], e["ts"] + e["dur"]) for e in evs if not is_comm(e)])
        starts = [s for s, _ in comp]
        comm = [e for e in evs if is_comm(e)]
        comm_u = union([(e["ts"], e["ts"] + e["dur"]) for e in comm])
        alone = sum(uncovered(s, e, comp, starts) for s, e in comm_u)
        span = max(e["ts"] + e["dur"] for e in evs) - min(e["ts"] for e in evs)
        rows.append((span, step, evs, comp, starts, comm, alone))
        print(f"step {step}: span {span / 1e3:8.2f} ms  compute {sum(e - s for s, e in comp) / 1e3:8.2f}  "
              f"communication {sum(e - s for s, e in comm_u) / 1e3:7.2f} (beside compute "
              f"{(sum(e - s for s, e in comm_u) - alone) / 1e3:7.2f}, exposed {alone / 1e3:7.2f})")
    span, step, evs, comp, starts, comm, _ = sorted(rows, key=lambda r: r[0])[len(rows) // 2]
    t0 = min(e["ts"] for e in evs)
    per = collections.defaultdict(lambda: [0, 0.0, 0.0])
    exposed = []
    for e in comm:
        x = uncovered(e["ts"], e["ts"] + e["dur"], comp, starts)
        k = (e["name"], e["args"].get("outputs", ""))
        per[k][0] += 1
        per[k][1] += e["dur"]
        per[k][2] += x
        exposed.append((x, e))
    print(f"median step {step}: exposed communication by collective and output")
    print(f"  {'exposed ms':>10} {'time ms':>8} {'count':>6}  collective -> output")
    for (name, out), (n, d, x) in sorted(per.items(), key=lambda kv: -kv[1][2]):
        print(f"  {x / 1e3:10.2f} {d / 1e3:8.2f} {n:6d}  {name} -> {out}")
    print(f"largest exposed collectives (ms from the step's start; the compute kernel before and after):")
    ordered = sorted(evs, key=lambda e: e["ts"])
    compute = [e for e in ordered if not is_comm(e)]
    cstarts = [e["ts"] for e in compute]
    for x, e in sorted(exposed, key=lambda p: -p[0])[:a.windows]:
        i = bisect.bisect_left(cstarts, e["ts"])
        before = compute[i - 1] if i > 0 else None
        after = compute[i] if i < len(compute) else None
        desc = lambda k: f"node {k['args'].get('node')} {k['name']}" if k else "-"
        print(f"  {x / 1e3:6.3f} of {e['dur'] / 1e3:6.3f} at {(e['ts'] - t0) / 1e3:8.2f}: node {e['args'].get('node')} "
              f"{e['name']} -> {e['args'].get('outputs', '')}; after {desc(before)}, before {desc(after)}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Where two step timelines differ most.

    tools/trace_diff.py A.json B.json [--top 15]

A and B are Chrome trace-event files as write_chrome_trace writes them
(attention/step_trace.hpp; bench_cp_attention --trace): a process a rank,
"X" events named "<call> <name> [<group>]". Typical pairs: one batch's run
before and after a schedule change, ours against a peer, or a measured run
against a predicted one.

Printed, in milliseconds:
- each file's step: from its first event's start to its last event's end,
  on its slowest rank;
- per event kind ("<call> <name>", groups together): the busiest rank's total
  in A and in B, and B / A;
- the events of both files matched one to one (the same rank and name, the
  k-th of that name on that rank in each), the `--top` whose durations differ
  most, with both starts and durations; events only one file has are counted;
  and the median over matched events of at least 1 % of A's step of
  |B - A| / A, their durations (how close a prediction B is to a measured A).

Standard library only; exits 2 with one line on a file it cannot read.
"""

import argparse
import collections
import json
import statistics
import sys


def fail(message):
    """One line on stderr, exit status 2."""
    print(f"trace_diff: {message}", file=sys.stderr)
    sys.exit(2)


def read_events(path):
    """The "X" events of a trace file as (rank, name, start_us, duration_us, bytes)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{path}: {e}")
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        fail(f"{path}: no traceEvents list (a Chrome trace-event file is expected)")
    out = []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        try:
            rank, name, start, duration = int(e["pid"]), str(e["name"]), float(e["ts"]), float(e["dur"])
        except (KeyError, TypeError, ValueError):
            fail(f"{path}: traceEvents[{i}] is an \"X\" event without pid, name, ts and dur")
        out.append((rank, name, start, duration, int((e.get("args") or {}).get("bytes", 0))))
    return out


def kind(name):
    """An event's kind: its name without a trailing group number."""
    head, _, tail = name.rpartition(" ")
    return head if head and tail.lstrip("-").isdigit() else name


def step_ms(events):
    """The slowest rank's span, first start to last end, in ms."""
    spans = collections.defaultdict(lambda: [float("inf"), float("-inf")])
    for rank, _, start, duration, _ in events:
        s = spans[rank]
        s[0], s[1] = min(s[0], start), max(s[1], start + duration)
    return max((end - start for start, end in spans.values()), default=0.0) / 1e3


def busiest_totals(events):
    """Per event kind, the largest total duration over ranks (ms)."""
    totals = collections.defaultdict(float)
    for rank, name, _, duration, _ in events:
        totals[(kind(name), rank)] += duration
    out = collections.defaultdict(float)
    for (k, _), t in totals.items():
        out[k] = max(out[k], t / 1e3)
    return out


def matched(a, b):
    """Pairs of events of A and B with the same rank and name, the k-th with the k-th; and the counts left over."""
    def numbered(events):
        seen, out = collections.Counter(), {}
        for rank, name, start, duration, nbytes in sorted(events, key=lambda e: (e[0], e[2])):
            seen[(rank, name)] += 1
            out[(rank, name, seen[(rank, name)])] = (start, duration, nbytes)
        return out

    na, nb = numbered(a), numbered(b)
    pairs = [(key, na[key], nb[key]) for key in na.keys() & nb.keys()]
    return pairs, len(na.keys() - nb.keys()), len(nb.keys() - na.keys())


def report(a_path, b_path, top, out=sys.stdout):
    a, b = read_events(a_path), read_events(b_path)
    print(f"A: {a_path}: {len(a)} events, step {step_ms(a):.3f} ms", file=out)
    print(f"B: {b_path}: {len(b)} events, step {step_ms(b):.3f} ms", file=out)
    ta, tb = busiest_totals(a), busiest_totals(b)
    print("\nper event kind, the busiest rank's total (ms):\n", file=out)
    print("| kind | A | B | B / A |", file=out)
    print("|---|---|---|---|", file=out)
    for k in sorted(ta.keys() | tb.keys(), key=lambda k: -max(ta.get(k, 0.0), tb.get(k, 0.0))):
        x, y = ta.get(k, 0.0), tb.get(k, 0.0)
        print(f"| {k} | {x:.3f} | {y:.3f} | {y / x:.2f} |" if x > 0 else f"| {k} | {x:.3f} | {y:.3f} | - |", file=out)
    pairs, only_a, only_b = matched(a, b)
    pairs.sort(key=lambda p: -abs(p[2][1] - p[1][1]))
    print(f"\n{len(pairs)} events matched (rank, name, k-th); {only_a} only in A, {only_b} only in B. "
          f"The {min(top, len(pairs))} whose durations differ most (ms):\n", file=out)
    print("| rank | event | k | A start | A duration | B start | B duration | B - A |", file=out)
    print("|---|---|---|---|---|---|---|---|", file=out)
    for (rank, name, k), (sa, da, _), (sb, db, _) in pairs[:top]:
        print(f"| {rank} | {name} | {k} | {sa / 1e3:.3f} | {da / 1e3:.3f} | {sb / 1e3:.3f} | {db / 1e3:.3f} | {(db - da) / 1e3:+.3f} |", file=out)
    floor = 0.01 * step_ms(a) * 1e3
    sizable = [abs(db - da) / da for _, (_, da, _), (_, db, _) in pairs if da >= floor and da > 0]
    if sizable:
        print(f"\nMedian |B - A| / A over the {len(sizable)} matched events of at least 1 % of A's step: "
              f"{statistics.median(sizable):.2f}", file=out)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Where two step timelines (Chrome trace-event JSON) differ most.")
    parser.add_argument("a", help="the first timeline (e.g. before, or measured)")
    parser.add_argument("b", help="the second timeline (e.g. after, or predicted)")
    parser.add_argument("--top", type=int, default=15, help="matched events to list (default 15)")
    args = parser.parse_args(argv)
    if args.top < 0:
        parser.error(f"--top is {args.top}; it must be at least 0")
    report(args.a, args.b, args.top)


if __name__ == "__main__":
    main()

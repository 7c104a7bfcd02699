"""tools/trace_diff.py on two small timelines: the step of each, the busiest
rank's totals per event kind, the matched events ordered by how much their
durations differ, the median difference of the sizable ones, and a clear
refusal of a file that is no trace."""

import json
import pathlib
import subprocess
import sys

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "trace_diff.py"


def trace(path, events):
    """A Chrome trace-event file as write_chrome_trace writes it: events (rank, name, ts, dur) in microseconds."""
    out = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}} for r in sorted({e[0] for e in events})]
    out += [{"name": n, "cat": n.split()[0], "ph": "X", "pid": r, "tid": 0, "ts": ts, "dur": dur, "args": {"bytes": 8, "group": -1}}
            for r, n, ts, dur in events]
    path.write_text(json.dumps({"traceEvents": out, "displayTimeUnit": "ms"}))
    return str(path)


def run(*args):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


def test_the_events_that_differ_most_come_first(tmp_path):
    a = trace(tmp_path / "a.json", [(0, "forward post 0", 0, 100), (0, "forward kernel", 100, 400), (1, "forward post 0", 0, 300),
                                    (1, "forward kernel", 300, 200), (1, "forward kernel", 500, 100)])
    b = trace(tmp_path / "b.json", [(0, "forward post 0", 0, 100), (0, "forward kernel", 100, 900), (1, "forward post 0", 0, 250),
                                    (1, "forward kernel", 250, 200), (1, "backward kernel", 450, 50)])
    r = run(a, b, "--top", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "A: " in lines[0] and "5 events, step 0.600 ms" in lines[0]
    assert "B: " in lines[1] and "5 events, step 1.000 ms" in lines[1]
    assert "| forward kernel | 0.400 | 0.900 | 2.25 |" in r.stdout  # rank 0 is the busiest in both; rank 1's two kernels sum to 0.300
    assert "| forward post | 0.300 | 0.250 | 0.83 |" in r.stdout  # the group number is not part of the kind
    assert "4 events matched (rank, name, k-th); 1 only in A, 1 only in B." in r.stdout
    rows = [l for l in lines if l.startswith("| 0 ") or l.startswith("| 1 ")]
    assert rows == ["| 0 | forward kernel | 1 | 0.100 | 0.400 | 0.100 | 0.900 | +0.500 |",
                    "| 1 | forward post 0 | 1 | 0.000 | 0.300 | 0.000 | 0.250 | -0.050 |"]
    # |B - A| / A of the four matched events: 0, 1.25, 0.17, 0; every one at least 1 % of A's step.
    assert "Median |B - A| / A over the 4 matched events of at least 1 % of A's step: 0.08" in r.stdout


def test_a_file_that_is_no_trace_is_refused_in_one_line(tmp_path):
    good = trace(tmp_path / "a.json", [(0, "forward kernel", 0, 1)])
    (tmp_path / "bad.json").write_text('{"traceEvents": [{"ph": "X", "pid": 0}]}')
    r = run(good, str(tmp_path / "bad.json"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == f'trace_diff: {tmp_path / "bad.json"}: traceEvents[0] is an "X" event without pid, name, ts and dur'
    r = run(good, str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "missing.json" in r.stderr

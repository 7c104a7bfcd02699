"""The binding's overhead: cpdispatch.plan, plan_for_rank and balance from
Python against the same C++ calls timed in C++ on the same plans (what is
left is reading the dict and building the arrays and dicts), and against
cpdispatch-plan reading the plan's JSON (process start, parse, plan, write).

    PYTHONPATH=build/python /usr/bin/python3 benchmarks/python/bench_binding.py --cli build/bin/cpdispatch-plan

The C++ column comes from time_planning.cpp next to this script, a small
pybind11 extension this script compiles (-O3, as a Release build) into
--timer-dir when it is missing or older than its sources: the shipped module
has no timing hooks. It reads the plan from its JSON text, then times the
planning calls alone.

Plans: documents form, 4 documents per rank on average, up to 4 shards each,
about a quarter of them continuing on the next rank, random attention ranks.
Times are the best of --repeats calls (milliseconds per call). "(Plan kept)"
is plan or plan_for_rank on a cpdispatch.Plan read once; "Plan(dict)" is that read
alone (its overhead column compares it with the per-rank planning).
"""

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sysconfig
import tempfile
import time

import cpdispatch

HERE = os.path.dirname(os.path.abspath(__file__))


def load_timer(directory, compiler):
    """_time_planning, compiled from time_planning.cpp when missing or older than its sources."""
    source = os.path.join(HERE, "time_planning.cpp")
    include = os.path.join(HERE, "..", "..", "include")
    target = os.path.join(directory, "_time_planning" + sysconfig.get_config_var("EXT_SUFFIX"))
    newest = max(os.path.getmtime(os.path.join(root, f)) for root, _, files in os.walk(include) for f in files)
    if not os.path.exists(target) or os.path.getmtime(target) < max(newest, os.path.getmtime(source)):
        os.makedirs(directory, exist_ok=True)
        subprocess.run([compiler, "-O3", "-DNDEBUG", "-std=c++20", "-shared", "-fPIC", "-I", include, "-I", sysconfig.get_paths()["include"],
                        source, "-o", target], check=True)
    spec = importlib.util.spec_from_file_location("_time_planning", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documents_plan(world, seed):
    rng = random.Random(seed)
    docs = []
    for _ in range(4 * world):
        home = rng.randrange(world)
        shards = []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.25:
                home = min(world - 1, home + 1)
            shards.append({"rank": home, "len": rng.randint(64, 1024), "dst": rng.randrange(world)})
        docs.append({"shards": shards})
    return {"kind": "qkv", "world_size": world, "documents": docs}


def balance_batch(world, seed):
    rng = random.Random(seed)
    docs = [{"pieces": [{"rank": r, "len": rng.randint(64, 2048)}]} for r in range(world) for _ in range(3)]
    return {"world_size": world, "max_cp_degree": 4, "documents": docs}


def best(repeats, call):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def cli_seconds(cli, plan, args, repeats):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(plan, f)
    try:
        return best(repeats, lambda: subprocess.run([cli, f.name, "--compact", *args], stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.DEVNULL, check=True))
    except subprocess.CalledProcessError:
        return float("nan")  # refused (e.g. its JSON output would exceed --max-memory)
    finally:
        os.unlink(f.name)


def row(name, world, python_s, cpp_s, cli_s):
    overhead = 100.0 * (python_s - cpp_s) / cpp_s
    cli = "        -" if cli_s is None else "  refused" if cli_s != cli_s else f"{1e3 * cli_s:9.3f}"
    print(f"{name:14s} {world:5d} {1e3 * python_s:10.3f} {1e3 * cpp_s:9.3f} {overhead:9.1f}% {cli}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="8,64,512,1024,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cli", help="cpdispatch-plan, for the last column")
    parser.add_argument("--no-balance", action="store_true")
    parser.add_argument("--timer-dir", default=os.path.join(tempfile.gettempdir(), "cpdispatch-bench-timer"),
                        help="where the C++ timing extension is built")
    parser.add_argument("--cxx", default=os.environ.get("CXX", "c++"), help="the compiler that builds it")
    args = parser.parse_args()
    timer = load_timer(args.timer_dir, args.cxx)
    print("call            W    python_ms    cpp_ms  overhead    cli_ms")
    for world in (int(w) for w in args.worlds.split(",")):
        plan = documents_plan(world, seed=world)
        cli = (lambda *a: cli_seconds(args.cli, plan, a, max(2, args.repeats // 2))) if args.cli else (lambda *a: None)
        text = json.dumps(plan)
        cpp_plan = timer.time_plan(text, -1, False, args.repeats)
        kept = cpdispatch.Plan(plan)
        row("plan", world, best(args.repeats, lambda: cpdispatch.plan(plan)), cpp_plan, cli())
        row("  (Plan kept)", world, best(args.repeats, lambda: cpdispatch.plan(kept)), cpp_plan, None)
        row("plan dedup", world, best(args.repeats, lambda: cpdispatch.plan(plan, dedup=True)),
            timer.time_plan(text, -1, True, args.repeats), cli("--dedup"))
        rank = world // 2
        cpp_rank = timer.time_plan(text, rank, False, args.repeats)
        row("plan_for_rank", world, best(args.repeats, lambda: cpdispatch.plan_for_rank(plan, rank)), cpp_rank, cli("--rank", str(rank)))
        row("  (Plan kept)", world, best(args.repeats, lambda: cpdispatch.plan_for_rank(kept, rank)), cpp_rank, None)
        row("Plan(dict)", world, best(args.repeats, lambda: cpdispatch.Plan(plan)), cpp_rank, None)
        if not args.no_balance:
            batch = balance_batch(world, seed=world)
            row("balance", world, best(max(1, args.repeats // 2), lambda: cpdispatch.balance(batch)),
                timer.time_balance(json.dumps(batch), max(1, args.repeats // 2)), None)


if __name__ == "__main__":
    main()

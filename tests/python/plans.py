"""Random plans of every form for the tests (valid by construction)."""

import random


def rank_plan(rng, max_world=5):
    world = rng.randint(1, max_world)
    ranks = []
    for _ in range(world):
        docs = []
        for _ in range(rng.randint(0, 3)):
            n = rng.randint(1, 3)
            docs.append({"shard_len": [rng.randint(1, 6) for _ in range(n)], "dst": [rng.randrange(world) for _ in range(n)]})
        ranks.append({"docs": docs})
    return {"kind": "qkv", "world_size": world, "ranks": ranks}


def documents_plan(rng, max_world=5):
    world = rng.randint(1, max_world)
    docs = []
    for _ in range(rng.randint(1, 5)):
        home = rng.randrange(world)
        shards = []
        for _ in range(rng.randint(1, 4)):
            home = min(world - 1, home + rng.randint(0, 1))  # a document packed across consecutive ranks
            shards.append({"rank": home, "len": rng.randint(1, 6), "dst": rng.randrange(world)})
        docs.append({"shards": shards})
    return {"kind": "qkv", "world_size": world, "documents": docs}


def query_plan(rng, copies, max_world=5):
    world = rng.randint(1, max_world)
    shards = rng.randint(1, 4)
    seq_len, dispatch = [], []
    for _ in range(world):
        used = rng.randint(0, shards)
        lens = [rng.randint(1, 6) for _ in range(used)] + [0] * (shards - used)
        seq_len.append(lens)
        if copies == 0:
            dispatch.append([rng.randrange(world) if n else -1 for n in lens])
            continue
        row = []
        for n in lens:
            cell = [rng.randrange(world) if n and rng.random() < 0.6 else -1 for _ in range(copies)]
            if n and max(cell) < 0:
                cell[rng.randrange(copies)] = rng.randrange(world)
            row.append(cell)
        dispatch.append(row)
    return {"kind": "query", "world_size": world, "seq_len": seq_len, "dispatch": dispatch}


def random_plans(seed, count):
    """(name, plan, dedup) triples over every form."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        out.append((f"ranks-{i}", rank_plan(rng), rng.random() < 0.5))
        out.append((f"documents-{i}", documents_plan(rng), rng.random() < 0.5))
        out.append((f"query2d-{i}", query_plan(rng, 0), False))
        out.append((f"query3d-{i}", query_plan(rng, rng.randint(1, 3)), False))
    return out

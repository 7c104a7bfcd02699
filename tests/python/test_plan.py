"""cpdispatch.plan / plan_for_rank / balance against the cpdispatch-plan CLI,
and the errors bad input raises."""

import gc
import json
import random
import subprocess

import pytest

from conftest import require
from plans import documents_plan, random_plans, rank_plan

np = require("numpy")
cpdispatch = require("cpdispatch")

PLANS = random_plans(seed=20240601, count=6)

# docs/plan-format.md example 4.7: a head-parallel document (section 2f) beside dispatched ones.
HEAD_PARALLEL = {"kind": "qkv", "world_size": 4, "head_parallel_degree": 2, "documents": [
    {"shards": [{"rank": 0, "len": 3}, {"rank": 1, "len": 2}], "head_parallel": True},
    {"shards": [{"rank": 1, "len": 2, "dst": 2}, {"rank": 2, "len": 4, "dst": 3}]},
    {"shards": [{"rank": 3, "len": 1, "dst": 0}]}]}


def run_cli(cli, document, *args):
    done = subprocess.run([cli, *args, "-", "--compact"], input=json.dumps(document), capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def as_json(value, where="result"):
    """The result with every array as nested lists, checking each is int64
    (int32 under "varlen", which the CLI does not write and is dropped)."""
    if isinstance(value, dict):
        return {k: as_json(v, f"{where}.{k}") for k, v in value.items() if k != "varlen"}
    if isinstance(value, list):
        return [as_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, np.ndarray):
        assert value.dtype == np.int64, f"{where} is {value.dtype}"
        return value.tolist()
    assert not isinstance(value, np.generic), f"{where} is a NumPy scalar"
    return value


@pytest.mark.parametrize("name,plan,dedup", PLANS, ids=[p[0] for p in PLANS])
def test_plan_equals_cli(cli, name, plan, dedup):
    expected = run_cli(cli, plan, *(["--dedup"] if dedup else []))
    assert as_json(cpdispatch.plan(plan, dedup=dedup)) == expected
    # JSON text takes the library's JSON reader, a plain dict the direct read: the same plan
    assert as_json(cpdispatch.plan(json.dumps(plan), dedup=dedup)) == expected


@pytest.mark.parametrize("name,plan,dedup", PLANS, ids=[p[0] for p in PLANS])
def test_plan_for_rank_equals_cli(cli, name, plan, dedup):
    kept = cpdispatch.Plan(plan)  # read once, planned per rank
    for rank in range(plan["world_size"]):
        expected = run_cli(cli, plan, "--rank", str(rank), *(["--dedup"] if dedup else []))
        assert as_json(cpdispatch.plan_for_rank(plan, rank, dedup=dedup)) == expected
        assert as_json(cpdispatch.plan_for_rank(kept, rank, dedup=dedup)) == expected


def test_a_plan_read_once_plans_as_its_dict(cli):
    plan = documents_plan(random.Random(9))
    kept = cpdispatch.Plan(plan, dedup=True)
    assert (kept.world_size, kept.kind, kept.dedup) == (plan["world_size"], "qkv", True)
    assert as_json(cpdispatch.plan(kept)) == run_cli(cli, plan, "--dedup")
    assert cpdispatch.position_ids(kept, 0).tolist() == cpdispatch.position_ids(plan, 0).tolist()
    with pytest.raises(ValueError, match=r"documents\[0\]\.shards\[0\]\.len: expected an integer"):
        cpdispatch.Plan({"world_size": 1, "documents": [{"shards": [{"rank": 0, "len": "x", "dst": 0}]}]})
    bad_value = cpdispatch.Plan({"world_size": 1, "documents": [{"shards": [{"rank": 0, "len": -1, "dst": 0}]}]})
    with pytest.raises(ValueError, match=r"documents\[0\]\.shards\[0\]\.len"):
        cpdispatch.plan_for_rank(bad_value, 0)
    query = cpdispatch.Plan({"world_size": 1, "seq_len": [[1]], "dispatch": [[0]]})
    with pytest.raises(ValueError, match="dedup"):
        cpdispatch.plan(query, dedup=True)


def test_plan_takes_json_text_and_the_dedup_key(cli):
    plan = documents_plan(random.Random(7))
    text = json.dumps(dict(plan, dedup=True))
    result = cpdispatch.plan(text)
    assert "kv_wire_fwd" in result
    assert as_json(result) == run_cli(cli, plan, "--dedup")


def test_varlen_is_int32_cu_seqlens():
    plan = rank_plan(random.Random(3), max_world=4)
    whole = cpdispatch.plan(plan)
    for rank in range(plan["world_size"]):
        varlen = cpdispatch.plan_for_rank(plan, rank)["varlen"]
        for key in ("cu_seqlens_q", "cu_seqlens_kv"):
            assert varlen[key].dtype == np.int32
            assert varlen[key].tolist() == whole["attn"][key][rank].tolist()
        assert varlen["max_seqlen_q"] == whole["attn"]["max_seqlen_q"][rank]
        assert varlen["max_seqlen_kv"] == whole["attn"]["max_seqlen_kv"][rank]


def test_arrays_own_the_planner_storage():
    # The arrays keep the C++ storage alive (a base object), not a NumPy copy.
    whole = cpdispatch.plan(rank_plan(random.Random(5)))
    arr = whole["kv_fwd"]["dst_offset"]
    assert not arr.flags.owndata and arr.base is not None
    assert arr.flags.c_contiguous and arr.flags.writeable
    del whole
    assert arr.sum() >= 0  # still valid after the dict is gone


@pytest.mark.parametrize("form", ["documents", "ranks"])
def test_balance_equals_cli(cli, form):
    rng = random.Random(11)
    world = 4
    if form == "documents":
        batch = {"world_size": world, "max_cp_degree": 3, "documents": [
            {"pieces": [{"rank": r, "len": rng.randint(2, 40)}]} for r in range(world) for _ in range(2)]}
        batch["documents"].append({"pieces": [{"rank": 0, "len": 30}, {"rank": 1, "len": 25}]})
    else:
        batch = {"world_size": world, "max_cp_degree": 2, "ranks": [{"docs": [rng.randint(1, 60) for _ in range(3)]} for _ in range(world)]}
    expected = run_cli(cli, batch, "balance")
    balanced = cpdispatch.balance(batch)
    assert balanced == expected
    assert as_json(cpdispatch.plan(balanced)) == run_cli(cli, expected)


BALANCE_OPTIONS = [("recv_capacity", {"recv_capacity": [150, 150, 150, 150]}), ("bytes", {"q_bytes": 3, "kv_bytes": 5, "dedup": True}),
                   ("window", {"mask": {"type": "sliding_window", "window": 6}}), ("full", {"mask": {"type": "full"}})]


@pytest.mark.parametrize("form", ["documents", "ranks"])
@pytest.mark.parametrize("name,options", BALANCE_OPTIONS, ids=[o[0] for o in BALANCE_OPTIONS])
def test_balance_with_options_equals_cli_key_for_key(cli, form, name, options):
    rng = random.Random(len(name))
    world = 4
    if form == "documents":
        docs = [{"pieces": [{"rank": r, "len": rng.randint(2, 40)}]} for r in range(world) for _ in range(2)]
        batch = {"world_size": world, "max_cp_degree": 3, "documents": docs + [{"pieces": [{"rank": 2, "len": 30}, {"rank": 3, "len": 9}]}]}
    else:
        batch = {"world_size": world, "max_cp_degree": 2, "ranks": [{"docs": [rng.randint(1, 60) for _ in range(3)]} for _ in range(world)]}
    batch.update(options)
    # json.dumps keeps the key order: the dict is built in the order json.loads gives the CLI's keys
    assert json.dumps(cpdispatch.balance(batch)) == json.dumps(run_cli(cli, batch, "balance"))


def run_cli_error(cli, document, *args):
    done = subprocess.run([cli, *args, "-", "--compact"], input=json.dumps(document), capture_output=True, text=True, check=False)
    assert done.returncode != 0, done.stdout
    return done.stderr.strip().removeprefix("cpdispatch-plan: ")


PIECE = {"rank": 0, "len": 4}
BAD_BATCHES = [
    ({"world_size": 0, "max_cp_degree": 1, "documents": []}, "world_size"),
    ({"world_size": 2, "documents": [{"pieces": [PIECE]}]}, "max_cp_degree"),
    ({"world_size": 2, "max_cp_degree": 2, "documents": [{"pieces": [PIECE, {"rank": 2, "len": 4}]}]}, "documents[0].pieces[1].rank"),
    ({"world_size": 2, "max_cp_degree": 2, "documents": [{"pieces": [PIECE]}, {"pieces": [{"rank": 1, "len": 0}]}]}, "documents[1].pieces[0].len"),
    ({"world_size": 2, "max_cp_degree": 2, "documents": [{"pieces": [{"rank": 0, "len": "4"}]}]}, "documents[0].pieces[0].len"),
    ({"world_size": 2, "max_cp_degree": 2, "documents": [{"pieces": [{"rank": 0, "len": 1.5}]}]}, "documents[0].pieces[0].len"),
    ({"world_size": 2, "max_cp_degree": 2, "documents": [{"pieces": [{"rank": 0, "len": 1 << 70}]}]}, "documents.pieces.len"),
    ({"world_size": 2, "max_cp_degree": 1, "documents": [{"pieces": [PIECE, PIECE]}]}, "documents[0].pieces has 2 entries"),
    ({"world_size": 2, "max_cp_degree": 1, "documents": [{"pieces": []}]}, "documents[0].pieces is empty"),
    ({"world_size": 2, "max_cp_degree": 1, "documents": [{"pieces": [dict(PIECE, dst=0)]}]}, "documents[0].pieces[0]"),
    ({"world_size": 2, "max_cp_degree": 1, "ranks": [{"docs": [3]}]}, "ranks has 1 entry"),
    ({"world_size": 2, "max_cp_degree": 1, "ranks": []}, "ranks has 0 entries"),
    ({"world_size": 2, "max_cp_degree": 1, "ranks": [{"docs": [3]}, {"docs": [2, 0]}]}, "ranks[1].docs[1]"),
    ({"world_size": 1, "max_cp_degree": 1, "ranks": [{"docs": [3]}], "documents": []}, "both"),
    ({"world_size": 1, "max_cp_degree": 1}, "missing"),
    ({"world_size": 2, "max_cp_degree": 1, "ranks": [{"docs": [3]}, {"docs": [2]}], "recv_capacity": []}, "recv_capacity has 0 entries"),
    ({"world_size": 2, "max_cp_degree": 1, "ranks": [{"docs": [3]}, {"docs": [2]}], "recv_capacity": [9, -1]}, "recv_capacity[1]"),
    ({"world_size": 2, "max_cp_degree": 1, "ranks": [{"docs": [3]}, {"docs": [2]}], "recv_capacity": [1, 1]}, "recv_capacity"),
    ({"world_size": 1, "max_cp_degree": 1, "ranks": [{"docs": [3]}], "q_bytes": -1}, "q_bytes"),
    ({"world_size": 1, "max_cp_degree": 1, "ranks": [{"docs": [3]}], "dedup": 1}, "dedup"),
    ({"world_size": 1, "max_cp_degree": 1, "ranks": [{"docs": [3]}], "mask": {"type": "window"}}, "mask.type"),
    ({"world_size": 0, "max_cp_degree": 1, "ranks": [], "mask": {"type": "window"}}, "world_size"),
    ({"world_size": 1, "max_cp_degree": 1, "ranks": [{"docs": [3]}], "max_cp_dgree": 2}, "max_cp_dgree"),
]


@pytest.mark.parametrize("batch,field", BAD_BATCHES, ids=[b[1] for b in BAD_BATCHES])
def test_a_bad_balance_input_raises_the_clis_message(cli, batch, field):
    with pytest.raises(ValueError) as raised:
        cpdispatch.balance(batch)
    assert field in str(raised.value)
    if field != "documents.pieces.len":  # json.dumps writes 2**70, which the CLI's parser reads as a float
        assert str(raised.value) == run_cli_error(cli, batch, "balance")


def test_balance_keyword_options_join_the_batch(cli):
    batch = {"world_size": 2, "documents": [{"pieces": [{"rank": 0, "len": 50}]}, {"pieces": [{"rank": 1, "len": 3}]}]}
    assert cpdispatch.balance(batch, max_cp_degree=2, dedup=True) == run_cli(cli, dict(batch, max_cp_degree=2, dedup=True), "balance")


@pytest.mark.parametrize("enabled", [True, False])
def test_balance_leaves_the_cycle_collector_as_it_found_it(enabled):
    batch = {"world_size": 2, "max_cp_degree": 2, "documents": [{"pieces": [{"rank": 0, "len": 50}]}]}
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        cpdispatch.balance(batch)
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()


def test_numpy_values_are_accepted():
    plan = {"world_size": np.int64(2), "seq_len": np.array([[3, 2], [4, 0]]), "dispatch": np.array([[1, 0], [0, -1]])}
    assert cpdispatch.plan(plan)["fwd"]["num_recv_tokens"].tolist() == [[2, 4, 6], [3, 0, 3]]


def test_position_ids_count_from_each_document_start():
    plan = {"world_size": 2, "documents": [
        {"shards": [{"rank": 0, "len": 3, "dst": 1}, {"rank": 1, "len": 2, "dst": 0}, {"rank": 1, "len": 4, "dst": 1}]},
        {"shards": [{"rank": 0, "len": 5, "dst": 0}]}]}
    assert cpdispatch.position_ids(plan, 0).tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert cpdispatch.position_ids(plan, 1).tolist() == [3, 4, 5, 6, 7, 8]
    per_rank = {"world_size": 1, "ranks": [{"docs": [{"shard_len": [2, 3], "dst": [0, 0]}, {"shard_len": [1], "dst": [0]}]}]}
    assert cpdispatch.position_ids(per_rank, 0).tolist() == [0, 1, 2, 3, 4, 0]


BAD = [
    ({"world_size": 2, "ranks": [{"docs": [{"shard_len": [1], "dst": [5]}]}, {"docs": []}]}, "ranks[0].docs[0].dst[0]"),
    ({"world_size": 2, "ranks": [{"docs": []}]}, "ranks has 1 entry"),
    ({"world_size": 1, "ranks": [{"docs": [{"shard_len": [1], "dst": [0]}]}], "max_cp_dgree": 2}, "max_cp_dgree"),
    ({"world_size": 1, "documents": [{"shards": [{"rank": 0, "len": 0, "dst": 0}]}]}, "documents[0].shards[0].len"),
    ({"world_size": 1, "documents": [{"shards": [{"rank": 0, "len": "x", "dst": 0}]}]}, "documents[0].shards[0].len"),
    ({"world_size": 0, "seq_len": [], "dispatch": []}, "world_size"),
    ({"world_size": 1, "seq_len": [[1]], "dispatch": [[0]], "dedup": True}, "dedup"),
    ({"world_size": 1, "ranks": [{"docs": [{"shard_len": [1.5], "dst": [0]}]}]}, "ranks[0].docs[0].shard_len[0]"),
    ({"world_size": 1, "ranks": [{"docs": [{"shard_len": [object()], "dst": [0]}]}]}, "ranks.docs.shard_len"),
    ("{not json", "invalid JSON"),
    (dict(HEAD_PARALLEL, head_parallel_degree=3), "head_parallel_degree"),
    ({**HEAD_PARALLEL, "documents": [dict(HEAD_PARALLEL["documents"][0], head_parallel="yes")]}, "documents[0].head_parallel"),
]


@pytest.mark.parametrize("plan,field", BAD, ids=[b[1] for b in BAD])
def test_bad_input_raises_value_error_naming_the_field(plan, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        cpdispatch.plan(plan)


def test_bad_rank_and_bad_types_raise():
    plan = rank_plan(random.Random(1), max_world=2)
    with pytest.raises(ValueError, match="rank"):
        cpdispatch.plan_for_rank(plan, plan["world_size"])
    with pytest.raises(ValueError, match="expected a dict or JSON text"):
        cpdispatch.plan([1, 2])
    with pytest.raises(ValueError, match="dedup"):
        cpdispatch.plan({"world_size": 1, "seq_len": [[1]], "dispatch": [[0]]}, dedup=True)
    with pytest.raises(ValueError, match="max_cp_degree"):
        cpdispatch.balance({"world_size": 1, "max_cp_degree": 0, "documents": [{"pieces": [{"rank": 0, "len": 3}]}]})


def plain(value):
    """Every array as nested lists (any dtype), for comparing whole results."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


@pytest.mark.parametrize("name,plan,dedup", PLANS, ids=[p[0] for p in PLANS])
def test_a_rank_share_planned_once_serves_every_rank_call(name, plan, dedup):
    """cpdispatch.torch plans a rank's share once (RankShare) and hands it to
    every rank call: each gives on the share what it gives on the plan."""
    native = cpdispatch._cpdispatch
    core = cpdispatch.Plan(plan).parsed
    for rank in range(plan["world_size"]):
        share = native.RankShare(core, rank, dedup)
        assert (share.rank, share.dedup) == (rank, dedup or bool(plan.get("dedup", False)))
        calls = [("plan_for_rank", ()), ("token_indices", ())]
        if core.kind == "qkv":
            calls += [("stage_plan", (3,)), ("stage_plan", (1,)), ("invariant_layout", (1,))]
        for call, extra in calls:
            on_plan = getattr(native, call)(core, rank, dedup, *extra)
            assert plain(getattr(native, call)(share, rank, dedup, *extra)) == plain(on_plan), f"{call}{extra}, rank {rank}"


def test_a_rank_share_of_another_rank_or_without_dedup_is_refused():
    native = cpdispatch._cpdispatch
    plan = documents_plan(random.Random(7))
    share = native.RankShare(plan, 0, False)
    with pytest.raises(ValueError, match="rank = 1, but the share given is rank 0's"):
        native.token_indices(share, 1, False)
    with pytest.raises(ValueError, match="dedup = True, but the share given was planned without deduplication"):
        native.plan_for_rank(share, 0, True)
    assert plain(native.plan_for_rank(native.RankShare(plan, 0, True), 0, False)) == plain(native.plan_for_rank(plan, 0, True))


MASKED = [("full", {"type": "full"}), ("window1", {"type": "sliding_window", "window": 1}),
          ("window4", {"type": "sliding_window", "window": 4})]


@pytest.mark.parametrize("name,mask", MASKED, ids=[m[0] for m in MASKED])
def test_masked_plans_equal_cli(cli, name, mask):
    rng = random.Random(len(name))
    for make in (documents_plan, rank_plan):
        plan = dict(make(rng), mask=mask)
        result = cpdispatch.plan(plan, dedup=True)
        assert result["attn"]["mask"] == mask
        assert as_json(result) == run_cli(cli, plan, "--dedup")
        for rank in range(plan["world_size"]):
            assert as_json(cpdispatch.plan_for_rank(plan, rank)) == run_cli(cli, plan, "--rank", str(rank))


def test_head_parallel_plans_equal_cli(cli):
    result = cpdispatch.plan(HEAD_PARALLEL)
    assert result["hp_attn"]["documents"] == [[0], [0], [], []]
    assert result["hp_fwd"]["dst_offset"].tolist()[1][0] == [3, 3]
    assert result["q_fwd"]["dst_rank"].tolist()[0] == [-1, -1]
    assert as_json(result) == run_cli(cli, HEAD_PARALLEL)
    for rank in range(HEAD_PARALLEL["world_size"]):
        share = cpdispatch.plan_for_rank(HEAD_PARALLEL, rank)
        assert share["hp_attn"]["group_rank"] == rank % 2
        assert as_json(share) == run_cli(cli, HEAD_PARALLEL, "--rank", str(rank))
    plain = cpdispatch.plan(dict(HEAD_PARALLEL, documents=HEAD_PARALLEL["documents"][1:]))
    assert not {"hp_fwd", "hp_rev", "hp_attn"} & plain.keys()


def test_torch_refuses_head_parallel_documents():
    require("torch")
    from cpdispatch.torch import RankDispatch  # pylint: disable=import-outside-toplevel
    with pytest.raises(ValueError, match="head-parallel documents"):
        RankDispatch(HEAD_PARALLEL, rank=0)

"""cpdispatch.balance(..., head_parallel="auto"): the balancer makes the
document spread over all ranks head-parallel (section 2f), the plan it gives
plans and matches the CLI's, and bad head-parallel options raise naming the
field."""

import pytest

from conftest import require
from test_plan import run_cli

cpdispatch = require("cpdispatch")

# One 12000-token document over all 8 ranks, and a short one on each rank.
WIDE = {"world_size": 8, "max_cp_degree": 8, "q_bytes": 2, "kv_bytes": 2,
        "documents": [{"pieces": [{"rank": r, "len": 1500} for r in range(8)]}] +
                     [{"pieces": [{"rank": r, "len": 90 - 10 * r}]} for r in range(8)]}


def test_auto_marks_the_wide_document_and_round_trips():
    plan = cpdispatch.balance(WIDE, head_parallel="auto", heads_q=8)
    assert plan["head_parallel_degree"] == 8
    flags = [doc.get("head_parallel", False) for doc in plan["documents"]]
    assert flags == [True] + [False] * 8
    planned = cpdispatch.plan(plan)  # the plan it gives plans, with the head-parallel exchange
    assert "hp_fwd" in planned


def test_auto_equals_the_cli(cli):
    batch = dict(WIDE, head_parallel="auto", heads_q=8, heads_kv=2)
    assert cpdispatch.balance(batch) == run_cli(cli, batch, "balance")


def test_off_is_plain_balancing():
    assert cpdispatch.balance(WIDE, head_parallel="off", heads_q=8) == cpdispatch.balance(WIDE)
    assert "head_parallel_degree" not in cpdispatch.balance(WIDE)


@pytest.mark.parametrize("options, field", [
    ({"head_parallel": "maybe", "heads_q": 8}, "head_parallel"),
    ({"head_parallel": "auto"}, "heads_q"),
    ({"head_parallel": "auto", "heads_q": 6}, "head_parallel_degree"),
])
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        cpdispatch.balance(WIDE, **options)

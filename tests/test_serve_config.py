"""export/serve/config.py: every serve setting validated once, errors naming the flag and the fix."""

import argparse

import pytest

from export.serve.config import ServeConfig, ServeConfigError


def test_defaults_and_the_implied_number_of_ranks(tmp_path):
    c = ServeConfig(package=tmp_path)
    assert (c.host, c.port, c.nproc, c.replica_budget, c.resident_experts) == ("127.0.0.1", 8000, 1, 0.25, 1.0)
    assert ServeConfig(package=tmp_path, ep_size=2).nproc == 2  # `--ep-size 2` alone means 2 ranks
    assert ServeConfig(package=tmp_path, tp_size=4).nproc == 4
    assert ServeConfig(package=tmp_path, nproc=4, ep_size=2).nproc == 4
    with pytest.raises(Exception):  # frozen: passed whole, never changed on the way down
        c.port = 1


@pytest.mark.parametrize("flags, message", [
    ({"replica_budget": -0.5}, "--replica-budget -0.5: Input should be greater than or equal to 0"),
    ({"placement": "none", "resident_experts": 1.5}, "--resident-experts 1.5: Input should be less than or equal to 1"),
    ({"resident_experts": 0.5}, "--resident-experts needs --placement"),
    ({"placement": "reactive", "nproc": 2, "tp_size": 2}, "--placement works with expert parallelism only"),
    ({"placement": "reactive", "nproc": 4, "ep_size": 2}, "--placement needs --ep-size equal to the number of ranks"),
    ({"placement": "predictive"}, "has no predictor; run `moe-pipeline predictor train"),
    ({"placement": "best"}, "--placement 'best': Input should be 'none', 'reactive' or 'predictive'"),
    ({"max_batch": 0}, "--max-batch 0: Input should be greater than or equal to 1"),
    ({"bogus": 1}, "--bogus 1: Extra inputs are not permitted"),
])
def test_a_bad_setting_names_its_flag(tmp_path, flags, message):
    with pytest.raises(ServeConfigError) as err:
        ServeConfig.from_flags({"package": tmp_path, **flags})
    assert message in str(err.value)


def test_every_cli_flag_is_a_config_field():
    """`moe-pipeline serve`'s flags are exactly ServeConfig's fields (plus the launcher's --nproc), so a setting
    cannot be parsed and dropped on the way, and its default lives in one place."""
    from cli.main import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    dests = {a.dest for a in serve._actions if a.dest not in ("help", argparse.SUPPRESS)}
    assert dests == set(ServeConfig.model_fields) - {"api_key"}  # a key never on a command line
    defaults = serve.parse_args(["pkg"])
    assert set(vars(defaults)) == {"package", "nproc"}  # nothing else defaulted outside ServeConfig


def test_rank_messages_survive_the_json_trip():
    """What rank 0 sends the other ranks (export/serve/ranks.py) comes back as the same typed message."""
    import json

    from export.serve import ranks
    from export.serve.request import SamplingParams
    from export.serve.step import Books, Forward, NewSeq, Order, Orders, Row, RowResult, Sampling, Step, Sync

    table = [[[0], [1, 0]], [[0], [0], [1], [1]]]
    step = Step([Forward("prefill", [[Row(3, 0, [5, 7], [4, 1], True, None, 0, [7])], []],
                         {"table": table, "expect": [[1], [2, 3]]}),
                 Forward("decode", [[], [Row(0, 12, [9], [], True, 50256)]])],
                new=[NewSeq(3, 0, Sampling(0.7, 0.9, 2, 11))], freed=[5], ended=[5])
    for msg in (step, Step(), ranks.Ping(), ranks.Stop()):
        assert ranks.decode(json.loads(json.dumps(ranks.encode(msg)))) == msg
    ranks.send(ranks.Ping())  # one rank: nobody to tell, and no error
    mine = [RowResult(0, token=5, logprob=-0.25, top=[[5, -0.25]]), RowResult(3, error="ValueError: x")]
    assert ranks.gather_results(mine) == [mine]  # one rank: its own
    # each rank its own requests: a step's gather carries one Sync a rank (coordinator.py OwnRequests)
    orders = Orders([Order(4, 1, [15496, 995], SamplingParams(max_tokens=3, temperature=0.7, stop=["\n"], seed=9))],
                    abort=[2], ping=True)
    for sync in (Sync([3, 1], True, Books(2, 1, 5, 2, 40, 16, 1), orders),
                 Sync([], False, Books(), results=mine), Sync([0], False, Books())):
        assert Sync.from_json(json.loads(json.dumps(sync.to_json()))) == sync
    assert Sync.from_json(Sync([0], False, Books(), Orders()).to_json()).orders is None  # nothing to tell: none sent
    status = ranks.gather_status(0, 7)  # one rank: its own row
    assert [(s.rank, s.forwards) for s in status] == [(0, 7)] and status[0].rss_mib > 0
    assert set(status[0].to_dict()) == {"rank", "pid", "forwards", "rss_mib", "forward_s", "expert_s",
                                        "exchange_s"}  # no placement: no placement fields

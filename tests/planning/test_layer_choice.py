"""Choosing the layers to shard: evenly spread sets, the most memory under a bound, the least cost for a budget."""

from shardprep.planning.accounting import account_layers
from shardprep.planning.layer_choice import choose_layers, evaluate, least_overhead, spread_sets
from shardprep.planning.step_time import Segment, predict_step

SIZE = 16 * 8 * 1000  # one layer's |T|, a multiple of 16·N
N = 8


def memory(layers):
    return account_layers([SIZE] * len(layers), N)


def predictor(compute_ms, gather_ms, num_layers=16):
    """Predicted steps at one token count: a head segment, then equal layers."""

    def predict(layers):
        chosen = set(layers)
        segments = [Segment(0.2)] + [Segment(compute_ms, gather_ms if i in chosen else None) for i in range(num_layers)]
        return [predict_step(segments)]

    return predict


def test_spread_sets_cover_every_size_once_each_and_are_evenly_spaced():
    sets = list(spread_sets(list(range(16))))
    assert len(sets) == len(set(sets))
    assert {len(s) for s in sets} == set(range(1, 17))
    assert (0, 2, 4, 6, 8, 10, 12, 14) in sets and (1, 3, 5, 7, 9, 11, 13, 15) in sets
    assert (0, 4, 8, 12) in sets


def test_the_choice_saves_the_most_memory_within_the_overhead_bound():
    predict = predictor(compute_ms=1.0, gather_ms=1.6)  # a gather needs about two layers of compute to hide
    bound = 0.05
    chosen = choose_layers(range(16), memory, predict, max_overhead=bound)
    assert chosen is not None and chosen.worst_overhead <= bound
    # No evenly spread set that saves more stays within the bound.
    for s in spread_sets(list(range(16))):
        c = evaluate(s, memory, predict)
        if c.memory.saved_bytes > chosen.memory.saved_bytes:
            assert c.worst_overhead > bound
    # Every layer sharded would be gather-bound: far over the bound.
    assert evaluate(range(16), memory, predict).worst_overhead > 0.3


def test_a_budget_is_met_at_the_least_overhead():
    predict = predictor(compute_ms=1.0, gather_ms=1.6)
    budget = memory(range(10)).saved_bytes
    chosen = choose_layers(range(16), memory, predict, budget_bytes=budget)
    assert chosen.memory.saved_bytes >= budget
    for s in spread_sets(list(range(16))):
        c = evaluate(s, memory, predict)
        if c.memory.saved_bytes >= budget:
            assert c.worst_overhead >= chosen.worst_overhead
    assert choose_layers(range(16), memory, predict, budget_bytes=memory(range(16)).saved_bytes + 1) is None


def test_nothing_is_chosen_when_no_set_saves_memory_or_fits_the_bound():
    two_ranks = lambda s: account_layers([SIZE] * len(s), 2)  # noqa: E731
    assert choose_layers(range(4), two_ranks, None) is None  # 4 layers at N = 2: slots eat the saving
    slow = predictor(compute_ms=1.0, gather_ms=50.0)
    assert choose_layers(range(16), memory, slow, max_overhead=0.05) is None
    cheapest = least_overhead(range(16), memory, slow)
    assert cheapest is not None and len(cheapest.layers) == 3  # the fewest layers past N = 8's break-even

"""The step-time model: the two-stream schedule, the slot limit, HBM interference, and the floor."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardprep.planning.step_time import Interference, Segment, predict_step, schedule_step, step_floor


def test_a_model_with_nothing_sharded_takes_the_replicated_time():
    p = predict_step([Segment(0.5), Segment(2.0), Segment(3.0)], Interference(0.4, 0.2))
    assert p.step_ms == pytest.approx(5.5) and p.overhead == pytest.approx(0.0)


def test_gathers_shorter_than_the_compute_in_front_of_them_are_hidden():
    # Each gather (0.9 ms) runs while the layer before it computes (1 ms): nothing is exposed.
    layers = [Segment(1.0)] + [Segment(1.0, 0.9) for _ in range(6)]
    assert predict_step(layers).step_ms == pytest.approx(7.0)


def test_gather_bound_step_is_every_gather_then_the_last_layer():
    layers = [Segment(1.0, 2.0) for _ in range(8)]
    p = predict_step(layers)
    assert p.step_ms == pytest.approx(8 * 2.0 + 1.0)
    assert p.floor.term == "gathers+tail" and p.floor.ms == pytest.approx(p.step_ms)


def test_one_slot_makes_each_gather_wait_for_the_previous_layers_compute():
    layers = [Segment(1.0, 1.0) for _ in range(3)]
    # 2 slots: gathers back to back (done at 1, 2, 3), compute right behind: 4 ms.
    assert predict_step(layers, num_slots=2).step_ms == pytest.approx(4.0)
    # 1 slot: gather, compute, gather, compute, ...: 6 ms.
    assert predict_step(layers, num_slots=1).step_ms == pytest.approx(6.0)


def test_interference_slows_both_streams_while_they_overlap():
    # A 2 ms gather beside a 4 ms layer: compute at 1/1.5 speed, the gather at 1/1.25 speed, both busy
    # until the gather ends at 2.5 ms (compute has done 2.5/1.5 ms of work); then compute alone.
    p = predict_step([Segment(4.0), Segment(1.0, 2.0)], Interference(0.5, 0.25))
    assert p.step_ms == pytest.approx(2.5 + (4.0 - 2.5 / 1.5) + 1.0)


def test_floor_terms_and_measured_replacements():
    segments = [Segment(0.5), Segment(1.0, 3.0), Segment(1.0), Segment(1.0, 3.0), Segment(0.5)]
    f = step_floor(segments, Interference(0.2))
    assert f.replicated_ms == pytest.approx(4.0)
    assert f.compute_with_interference_ms == pytest.approx(4.0 + 0.2 * 4.0)
    assert f.gathers_then_tail_ms == pytest.approx(6.0 + 1.0 + 0.5)  # after the last gather: its layer and the tail
    g = step_floor(segments, Interference(0.2), replicated_ms=4.4, gather_only_ms=5.0)
    assert g.replicated_ms == 4.4 and g.gathers_then_tail_ms == pytest.approx(6.5)


segment = st.builds(Segment, st.floats(0.0, 5.0), st.one_of(st.none(), st.floats(0.0, 5.0)))


@given(st.lists(segment, min_size=1, max_size=12), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(1, 3))
def test_a_step_is_never_shorter_than_its_hard_lower_bounds(segments, kappa, lam, slots):
    p = predict_step(segments, Interference(kappa, lam), num_slots=slots)
    assert p.step_ms >= p.floor.replicated_ms - 1e-9
    assert p.step_ms >= p.floor.gathers_then_tail_ms - 1e-9


@given(st.lists(segment, min_size=1, max_size=12), st.floats(0.0, 1.0))
def test_more_interference_never_makes_a_step_faster(segments, kappa):
    assert predict_step(segments, Interference(kappa + 0.3)).step_ms >= predict_step(
        segments, Interference(kappa)).step_ms - 1e-9


@given(st.lists(segment, min_size=1, max_size=12), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(1, 3))
def test_the_schedule_keeps_the_streams_order_and_slots_and_ends_at_the_predicted_step(segments, kappa, lam, slots):
    s = schedule_step(segments, Interference(kappa, lam), num_slots=slots)
    assert s.step_ms == predict_step(segments, Interference(kappa, lam), num_slots=slots).step_ms
    assert [c.segment for c in s.compute] == list(range(len(segments))) and s.compute[-1].end_ms == s.step_ms
    sharded = [i for i, seg in enumerate(segments) if seg.gather_ms is not None]
    assert [g.segment for g in s.gathers] == sharded
    for stream in (s.compute, s.gathers):  # one piece of work at a time on each stream
        assert all(a.end_ms <= b.start_ms + 1e-9 and a.start_ms <= a.end_ms for a, b in zip(stream, stream[1:]))
    for k, g in enumerate(s.gathers):
        assert g.end_ms <= s.compute[g.segment].start_ms + 1e-9  # a layer computes on its gathered weights
        if k >= slots:  # its slot is free only once the compute of the layer S gathers earlier is done
            assert g.start_ms >= s.compute[sharded[k - slots]].end_ms - 1e-9

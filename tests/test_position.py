"""`Position` (kpipe/_engine/_position.py), with no processes: the plan, the head and its
readers, each pass's length and the saved state. Saved at every step and restored into a
fresh Position, reading goes on exactly as in the uninterrupted run -- across passes,
shards and lengths that change between passes (as grain's prefetch_test.py::test_checkpoint
checks its iterators)."""

import json
import random

import pytest

import kpipe
from _datasets import Squares
from conftest import reader_of
from kpipe._engine._position import STATE_FORMAT, PassLengths, Position

CONFIGS = [
    dict(shuffle=False, seed=0, num_shards=1, shard_index=0),
    dict(shuffle=True, seed=7, num_shards=1, shard_index=0),
    dict(shuffle=True, seed=7, num_shards=2, shard_index=1),
    dict(shuffle=True, seed=3, num_shards=3, shard_index=0),
]
LENGTHS = [7, 5, 9, 6]  # the dataset's len() in passes 0..3: its hook changes it at each pass end


def _read(position, lengths, stop=None):
    """Reads in order, pass after pass, as a manual loop does (`loader[i]` for each i, the
    dataset's hook at each pass end changing its length to the next pass's); returns the
    (key, dataset index) pairs, and the state before each read."""
    out, states = [], []
    while position.head[0] < len(lengths):
        if stop is not None and len(out) == stop:
            break
        head = position.head
        states.append(json.loads(json.dumps(position.state_dict())))  # as a backup file holds it
        key, sequential = position.direct_key(max(head[1], position.direct_position()[1]))
        out.append((key, position.index(key)))
        if position.handed_out_direct(key, sequential):
            ended = position.head[0]
            position.complete_pass()
            if ended + 1 < len(lengths):
                position.set_length(lengths[ended + 1])
    return out, states


@pytest.mark.parametrize("config", CONFIGS, ids=["ordered", "shuffled", "shard-1-of-2", "shard-0-of-3"])
def test_a_state_saved_at_every_step_resumes_the_same_reads(config):
    full, states = _read(Position(LENGTHS[0], **config), LENGTHS)
    shards = config["num_shards"]
    assert len(full) == sum(-(-n // shards) for n in LENGTHS)  # pads included: every shard ceil(n / W)
    for step, state in enumerate(states):
        assert state["format"] == STATE_FORMAT and state["num_batches"] == LENGTHS[state["pass"]]
        resumed = Position(LENGTHS[-1], **config)  # a new process: the dataset as it is now
        resumed.load_state_dict(state, same_length=False, name="Data")
        rest, _ = _read(resumed, LENGTHS)
        assert rest == full[step:], step


def test_shards_of_a_pass_are_disjoint_cover_every_batch_and_pad_to_equal_lengths():
    for n in (7, 12, 13):
        for shards in (1, 2, 3, 5):
            seen, lengths = [], []
            for w in range(shards):
                position = Position(n, shuffle=True, seed=11, num_shards=shards, shard_index=w)
                length = position.length_of(1)
                pads = [i for i in range(length) if position.planner.is_pad(i, n)]
                assert pads in ([], [length - 1])  # a pad only at the end of a pass
                seen += [position.index((1, i)) for i in range(length) if i not in pads]
                lengths.append(length)
            assert sorted(seen) == list(range(n)), (n, shards)  # every batch once
            assert lengths == [-(-n // shards)] * shards  # the same number of steps


def test_a_pad_is_handed_out_without_rows_and_other_batches_as_loaded():
    import numpy as np

    position = Position(3, num_shards=2, shard_index=1)  # positions 1 and a pad
    batch = (np.ones((4, 2), np.float32), {"y": np.arange(4)}, None, np.float32(2.0))
    assert position.as_handed_out((0, 0), batch) is batch
    x, y, none, scalar = position.as_handed_out((0, 1), batch)
    assert (x.shape, x.dtype, y["y"].shape, y["y"].dtype) == ((0, 2), np.float32, (0,), batch[1]["y"].dtype)
    assert none is None and scalar == 2.0
    assert position.index((0, 1)) == 0  # what a pad loads: a real batch, for its structure


def test_each_pass_has_the_length_recorded_for_it_and_later_ones_the_newest():
    position = Position(4)
    assert [position.length_of(p) for p in range(3)] == [4, 4, 4]
    position.record_length(1, 6)
    assert [position.dataset_length(p) for p in range(3)] == [4, 6, 6]
    assert position.walk((0, 3), 1) == (1, 0) and position.walk((0, 0), 10) == (2, 0)
    assert position.distance((0, 2), (1, 1), limit=100) == 3
    assert position.distance((0, 0), (3, 0), limit=4) == 5  # counted up to limit + 1 only
    position.forget_length(1)
    assert position.length_of(1) == 4
    position.forget_length(0)  # never the only one known
    assert position.length_of(0) == 4


def test_a_new_length_applies_from_the_first_pass_nothing_of_which_was_read():
    position = Position(4)
    position.set_length(6)  # before any read: pass 0 itself
    assert position.length_of(0) == 6
    key, sequential = position.direct_key(0)
    position.handed_out_direct(key, sequential)
    position.set_length(3)  # pass 0 is being read: from pass 1 on
    assert (position.length_of(0), position.length_of(1)) == (6, 3)


def test_successor_crosses_a_pass_end_only_when_told():
    position = Position(3)
    assert position.successor((0, 1), cross_passes=False) == (0, 2)
    assert position.successor((0, 2), cross_passes=False) is None
    assert position.successor((0, 2), cross_passes=True) == (1, 0)
    infinite = Position(None)
    assert infinite.length_of(0) is None and infinite.successor((0, 10**6), cross_passes=False) == (0, 10**6 + 1)
    assert infinite.index((0, 5)) == 5


def test_streams_hand_out_the_rest_of_the_head_pass_and_probes_nothing():
    position = Position(3)
    position.begin_probe()
    probe = position.open_stream()
    assert position.next_key(probe) == (0, 0)
    assert not position.handed_out(probe, (0, 0)) and not position.handed_in_pass
    position.end_probe()
    assert position.next_key(probe) is None  # a probe's stream ends with the probe
    stream = position.open_stream(hooks="keras")
    keys = []
    while (key := position.next_key(stream)) is not None:
        keys.append(key)
        if position.handed_out(stream, key):
            position.complete_pass()
    assert keys == [(0, 0), (0, 1), (0, 2)] and position.head == (1, 0)
    assert position.stream_position(stream, consumed=2) == (0, 2)  # its reader ran ahead of the consumer
    assert position.stream_position(stream) == (1, 0)


@pytest.mark.parametrize("change, message", [
    (dict(seed=8), "seed=8, but this loader has seed=7"),
    (dict(shuffle=False), "shuffle=False, but this loader has shuffle=True"),
    (dict(num_shards=3), "num_shards=3"),
    (dict(format=99), "newer kpipe"),
    (dict(position=9), "out of range for a pass of 4 batches"),  # ceil(7 / 2), a pad included
    (dict(num_batches=5), "saved for a dataset of 5 batches, but `Data` has 7"),
])
def test_a_state_of_another_configuration_is_refused_with_what_differs(change, message):
    position = Position(7, shuffle=True, seed=7, num_shards=2, shard_index=0)
    state = dict(position.state_dict(), **change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        position.check_state(state, same_length=True, name="Data")
    with pytest.raises(ValueError, match="must be a dict"):
        position.check_state([1, 2], same_length=True, name="Data")
    with pytest.raises(ValueError, match="lacks the entry 'pass'"):
        position.check_state({"format": STATE_FORMAT}, same_length=True, name="Data")


class _DictLengths:
    """The model PassLengths keeps to: a dict of every pass recorded (what Position kept
    before), the newest being the highest pass's."""

    def __init__(self, length):
        self.d = {0: length}

    def get(self, p):
        return self.d.get(p, self.d[max(self.d)])

    def set(self, p, n):
        self.d[p] = n

    def forget(self, p):
        if p in self.d and len(self.d) > 1:
            del self.d[p]

    def forget_after(self, p):
        for k in [k for k in self.d if k > p]:
            del self.d[k]


def test_pass_lengths_answer_as_a_dict_of_every_pass_would():
    rng = random.Random(5)
    for trial in range(300):
        model, runs = _DictLengths(4), PassLengths(4)
        for step in range(60):
            op, p, n = rng.random(), rng.randrange(0, 30), rng.choice([4, 4, 4, 6, 9])
            if op < 0.6:
                model.set(p, n), runs.set(p, n)
            elif op < 0.8:
                model.forget(p), runs.forget(p)
            elif op < 0.85:  # as set_length does: the passes after p forgotten, p's length set
                model.forget_after(p), runs.forget_after(p)
                model.set(p, n), runs.set(p, n)
            ctx = (trial, step, sorted(model.d.items()), runs.runs())
            assert [runs.get(q) for q in range(35)] == [model.get(q) for q in range(35)], ctx
            assert [runs.has(q) for q in range(35)] == [q in model.d for q in range(35)], ctx
            assert runs.newest == model.d[max(model.d)] and runs.count() == len(model.d), ctx
            assert all(a[1] + 1 < b[0] or a[2] != b[2] for a, b in zip(runs.runs(), runs.runs()[1:])), ctx  # merged


def test_a_loader_keeps_one_run_of_lengths_however_many_passes_it_reads():
    with kpipe.ProcessLoader(Squares(), workers=0) as loader:
        for epoch in range(300):
            for i in range(len(loader)):
                loader[i]
            loader.on_epoch_end()
        lengths = reader_of(loader).position.lengths
        assert lengths.count() >= 300 and lengths.runs() == [(0, lengths.count() - 1, len(loader))]


# -- the order each pass takes (kpipe/_order.py decides; Position keeps it) ----------------
def test_an_order_applies_from_the_first_pass_no_stream_began_and_state_carries_it():
    position = Position(6, shuffle=None, seed=1, seed_given=False)
    assert position.order_due and position.read_ahead_limit() < position.head[0]  # nothing loads yet
    assert position.follow(True, 42) == 0 and not position.order_due
    plan = [position.index((0, i)) for i in range(6)]
    assert sorted(plan) == list(range(6)) and plan != list(range(6))
    assert position.follow(True, 42) is None  # the same order: nothing to drop
    state = position.state_at((0, 2))
    assert (state["shuffle"], state["seed"]) == (True, 42)
    position.jump(0, 3)  # a restore inside pass 0: a new order starts at pass 1
    assert position.follow(False, 1) == 1 and position.index((0, 3)) == plan[3] and position.index((1, 3)) == 3
    fresh = Position(6, shuffle=None, seed=9, seed_given=False)  # no seed of its own: takes the state's
    fresh.load_state_dict(state, same_length=True, name="Data")
    assert [fresh.index((0, i)) for i in range(2, 6)] == plan[2:] and fresh.seed_of((0, 2)) == position.seed_of((0, 2))
    for own in (dict(seed=9, seed_given=True), dict(shuffle=False, seed=42)):
        with pytest.raises(ValueError, match="Restore it into a loader built with the same"):
            Position(6, **{"shuffle": None, **own}).check_state(state, same_length=True, name="Data")


def test_a_keyed_dataset_keeps_its_batches_in_order_and_gets_the_pass_seed():
    position = Position(3, shuffle=None, seed=5, keyed_by_pass=True, seed_given=False)
    assert [position.index((0, i)) for i in range(3)] == [(0, 0, None), (0, 1, None), (0, 2, None)]
    position.follow(True, 8)
    assert [position.index((2, i)) for i in range(3)] == [(2, 0, 8), (2, 1, 8), (2, 2, 8)]

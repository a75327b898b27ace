"""The item scheduler's rules on their own: pieces in batch order, least loaded first, at most
``pieces_in_hand`` per item worker, sub-batches for ``__getitems__``."""

from __future__ import annotations

from collections import Counter

from pipeload.engine.item_scheduler import (
    MIN_PIECE_ITEMS,
    ItemPace,
    ItemScheduler,
    item_placement,
    least_items,
    messages_would_busy_main,
    piece_size,
)


def test_an_idle_pool_spreads_the_first_batch_over_every_worker():
    scheduler = ItemScheduler(4, sub_batches=False)
    scheduler.add_batch(0, batch_worker=1, indices=list(range(8)), first_position=0)
    pieces = scheduler.assign()
    assert [p.item_worker for p in pieces] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [p.indices for p in pieces] == [[i] for i in range(8)]
    assert {p.batch_worker for p in pieces} == {1}
    assert [p.slot for p in pieces] == list(range(8))


def test_pieces_wait_until_a_worker_has_room_then_go_to_the_least_loaded():
    scheduler = ItemScheduler(2, sub_batches=False, pieces_in_hand=1)
    scheduler.add_batch(0, 0, [10, 11, 12, 13], first_position=0)
    assert [(p.item_worker, p.indices) for p in scheduler.assign()] == [(0, [10]), (1, [11])]
    assert scheduler.assign() == []  # both hold a piece: the rest wait
    scheduler.record_done(1)
    assert [(p.item_worker, p.indices) for p in scheduler.assign()] == [(1, [12])]
    scheduler.record_done(1)
    assert [(p.item_worker, p.indices) for p in scheduler.assign()] == [(1, [13])]


def test_a_piece_cut_to_its_first_items_leaves_the_rest_first_in_line():
    # The probes of a session's first batch: one item each, the rest of their pieces next.
    scheduler = ItemScheduler(2, sub_batches=False, pieces_in_hand=1)
    scheduler.add_batch(0, 0, [10, 11, 12, 13, 14, 15, 16, 17], first_position=64)
    first, second = scheduler.next_piece(1), scheduler.next_piece(1)
    assert scheduler.next_piece(1) is None  # both hold their probe
    assert [(p.item_worker, p.indices, p.slot, p.position) for p in (first, second)] == [
        (0, [10], 0, 64), (1, [11], 1, 65)]
    scheduler.pieces_in_hand = 2
    rest = scheduler.assign()
    assert [(p.indices, p.slot, p.position) for p in rest] == [([12, 13], 2, 66), ([14, 15], 4, 68)]
    scheduler.record_done(0)
    assert [p.indices for p in scheduler.assign()] == [[16, 17]]


def test_positions_count_samples_across_batches():
    scheduler = ItemScheduler(2, sub_batches=False, pieces_in_hand=10)
    scheduler.add_batch(0, 0, [7, 8, 9], first_position=0)
    scheduler.add_batch(1, 1, [3, 4], first_position=3)
    pieces = scheduler.assign()
    assert [(p.batch_number, p.slot, p.position) for p in pieces] == [
        (0, 0, 0), (0, 1, 1), (0, 2, 2), (1, 0, 3), (1, 1, 4)]


def test_sub_batches_give_each_worker_one_share():
    scheduler = ItemScheduler(3, sub_batches=True)
    scheduler.add_batch(0, 0, list(range(10)), first_position=20)
    pieces = scheduler.assign()
    assert [p.indices for p in pieces] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [(p.slot, p.position) for p in pieces] == [(0, 20), (4, 24), (8, 28)]
    assert Counter(p.item_worker for p in pieces) == Counter({0: 1, 1: 1, 2: 1})


def test_piece_size():
    assert piece_size(64, 8, sub_batches=False) == 4  # two pieces per item worker
    assert piece_size(2, 8, sub_batches=False) == 1
    assert piece_size(64, 8, sub_batches=True) == 8
    assert piece_size(0, 4, sub_batches=False) == 1
    assert piece_size(64, 14, sub_batches=False, least=8) == 8
    assert piece_size(5, 14, sub_batches=False, least=8) == 5  # no more than the batch
    assert piece_size(256, 4, sub_batches=False, least=8) == 32  # above the floor: as before


def test_a_batch_of_cheap_items_goes_in_pieces_of_at_least_the_floor_however_many_workers():
    # 14 item workers would cut 64 items into pieces of 3: a message each way for every 3
    # items is what the main process pays. Pieces of cheap items hold MIN_PIECE_ITEMS or more.
    scheduler = ItemScheduler(14, sub_batches=False, pieces_in_hand=10)
    scheduler.add_batch(0, 0, list(range(64)), first_position=0)
    scheduler.add_batch(1, 0, list(range(64, 128)), first_position=64, least=MIN_PIECE_ITEMS)
    scheduler.add_batch(2, 0, [128, 129, 130], first_position=128, least=MIN_PIECE_ITEMS)
    pieces = scheduler.assign()
    by_batch = {n: [p.indices for p in pieces if p.batch_number == n] for n in (0, 1, 2)}
    assert {len(indices) for indices in by_batch[0]} == {3, 1}  # the first batch: cut fine
    assert [len(indices) for indices in by_batch[1]] == [MIN_PIECE_ITEMS] * (64 // MIN_PIECE_ITEMS)
    assert by_batch[2] == [[128, 129, 130]]  # a batch under the floor: one piece
    assert [i for n in (0, 1, 2) for indices in by_batch[n] for i in indices] == list(range(131))
    assert len({p.item_worker for p in pieces if p.batch_number == 1}) == 64 // MIN_PIECE_ITEMS


def test_sub_batches_stay_one_share_per_worker_whatever_the_least():
    scheduler = ItemScheduler(3, sub_batches=True)
    scheduler.add_batch(0, 0, list(range(10)), first_position=0, least=MIN_PIECE_ITEMS)
    assert [p.indices for p in scheduler.assign()] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_pieces_are_cut_coarser_only_where_their_messages_would_busy_the_main_process():
    # 14 workers at 0.4 ms a JPEG (a 16-core machine): pieces of 3 would cost it ~0.7 of a CPU.
    assert messages_would_busy_main(0.0004, 14, 64)
    # The same workers at 3.5 ms an item (14 of them sharing 2 CPUs): messages are no burden.
    assert not messages_would_busy_main(0.0035, 14, 64)
    # Two workers cut a batch of 64 into 4 pieces: nothing to gain whatever the items.
    assert not messages_would_busy_main(0.0004, 2, 64)
    assert not messages_would_busy_main(0.010, 8, 16)  # items of 10 ms: never


def test_cheap_pieces_never_leave_fewer_pieces_in_flight_than_item_workers():
    assert least_items(64, 14, batches_in_flight=2) == MIN_PIECE_ITEMS  # 16 pieces for 14 workers
    # A batch of 16 over 8 workers, 2 in flight: pieces of 8 would be 4 pieces for 8 workers.
    assert least_items(16, 8, batches_in_flight=2) == 4
    assert least_items(4, 8, batches_in_flight=2) == 1
    assert least_items(256, 2, batches_in_flight=2) == MIN_PIECE_ITEMS


def test_the_pace_counts_from_the_later_of_the_send_and_the_workers_previous_report():
    pace = ItemPace(2)
    assert pace.item_s is None
    pace.sent(0, at=10.0)
    pace.sent(0, at=10.0)  # two in hand: the second waits behind the first
    pace.reported(0, count=4, at=10.004)
    assert abs(pace.item_s - 0.001) < 1e-12
    pace.reported(0, count=4, at=10.006)  # from the first report on, not from its send
    assert abs(pace.item_s - (0.001 + 0.25 * (0.0005 - 0.001))) < 1e-12
    pace.sent(1, at=20.0)
    pace.reported(1, count=2, at=20.1)  # items of 50 ms: the average moves towards them
    assert pace.item_s > 0.01


def test_a_new_epoch_forgets_pieces_in_hand_but_not_the_time_per_item():
    pace = ItemPace(1)
    pace.sent(0, at=1.0)
    pace.reported(0, count=1, at=1.0001)
    pace.sent(0, at=2.0)  # in hand when the epoch was cut short
    pace.forget_epoch()
    pace.reported(0, count=1, at=4.0)  # it comes back late: not timed (its send is forgotten)
    assert abs(pace.item_s - 0.0001) < 1e-9
    pace.sent(0, at=5.0)
    pace.reported(0, count=1, at=5.0001)
    assert abs(pace.item_s - 0.0001) < 1e-9


def test_an_empty_batch_has_no_pieces():
    scheduler = ItemScheduler(2, sub_batches=False)
    scheduler.add_batch(0, 0, [], first_position=0)
    assert scheduler.assign() == []


def test_a_batchs_items_are_laid_out_leaf_by_leaf_as_their_stack():
    placement = item_placement((100, 4000), count=3, room=1 << 20)
    # Leaf 0 of items 0..2 first (300 bytes, rounded up to 64), then leaf 1 of each.
    assert placement.leaf_offsets == (0, 320)
    assert placement.area_bytes == 12_352  # 320 + 12,000, rounded up to 64
    assert item_placement((100, 4000), count=3, room=12_000) is None  # does not fit
    assert item_placement((), count=3, room=1 << 20) is None  # nothing to place


def test_last_of_says_when_no_piece_of_a_batch_waits():
    scheduler = ItemScheduler(num_item_workers=1, sub_batches=False, pieces_in_hand=1)
    scheduler.add_batch(0, 0, list(range(4)), 0)  # two pieces of two items
    scheduler.next_piece()
    assert not scheduler.last_of(0)  # the second piece waits for the worker's hands
    scheduler.record_done(0)
    scheduler.next_piece()
    assert scheduler.last_of(0)

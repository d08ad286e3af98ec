"""WriterLayout's object grain (`heads_per_object`): object groups, what each reader reads, the parts' objects,
and the commit marker's text with and without the grain (markers written before still decode the same)."""
from __future__ import annotations

import pytest

from pdserve.kvstore import open_store
from pdserve.kvstore.layout import KVShard, WriterLayout, split_heads


def test_split_heads_runs_from_the_groups_first_head():
    assert split_heads((0, 4), 2) == [(0, 2), (2, 4)]
    assert split_heads((0, 3), 2) == [(0, 2), (2, 3)]  # the last object holds fewer
    assert split_heads((2, 5), 1) == [(2, 3), (3, 4), (4, 5)]
    assert split_heads((0, 4), 0) == [(0, 4)]
    assert split_heads((0, 4), 4) == split_heads((0, 4), 9) == [(0, 4)]


def test_object_groups_and_names():
    single = WriterLayout(2, 4, object_heads=2)
    assert single.single and not single.plain
    assert single.object_groups(4) == [(0, 2), (2, 4)]
    assert single.object_layers(4) == ["0.h0-2", "0.h2-4", "1.h0-2", "1.h2-4"]
    tp2 = WriterLayout(3, 4, (0, 2), (0, 2), object_heads=1)
    assert tp2.object_groups(4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert tp2.num_parts() == 4  # parts stay stage x writer head group, whatever the objects
    assert tp2.part_names(4) == ["0-2.h0-2", "0-2.h2-4", "2-3.h0-2", "2-3.h2-4"]
    assert tp2.part_objects(1, 4) == ["0.h2-3", "0.h3-4", "1.h2-3", "1.h3-4"]
    assert tp2.part_objects(2, 4) == ["2.h0-1", "2.h1-2"]
    assert sorted(n for p in range(4) for n in tp2.part_objects(p, 4)) == sorted(tp2.object_layers(4))
    assert WriterLayout(2, 4, (0,), (0, 2)).part_objects(0, 4) == ["0.h0-2", "1.h0-2"]  # no grain: as before
    assert WriterLayout(2).part_objects(0, 4) == [0, 1]


def test_reads_of_narrower_wider_and_same_readers():
    k2 = WriterLayout(1, 4, object_heads=2)
    assert k2.reads((0, 2), 4) == [((0, 2), (0, 2))]  # exactly its heads: the whole-object read
    assert k2.reads((2, 4), 4) == [((2, 4), (2, 4))]
    assert k2.reads((1, 2), 4) == [((0, 2), (1, 2))]  # narrower than an object: that object, its own head kept
    assert k2.reads((0, 4), 4) == [((0, 2), (0, 2)), ((2, 4), (2, 4))]  # wider: each object whole
    assert k2.reads((1, 3), 4) == [((0, 2), (1, 2)), ((2, 4), (2, 3))]
    k1 = WriterLayout(1, 4, object_heads=1)
    assert k1.reads((1, 2), 4) == [((1, 2), (1, 2))]
    assert [g for g, _ in k1.reads((0, 4), 4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert WriterLayout(1).reads((0, 2), 4) == [((0, 4), (0, 2))]  # no grain: the whole group, as before


def test_the_grain_that_spares_a_reader():
    assert WriterLayout(1).fitting_object_heads((0, 2), 4) == 2
    assert WriterLayout(1).fitting_object_heads((1, 2), 4) == 1
    assert WriterLayout(1, 8).fitting_object_heads((2, 6), 8) == 2  # 4 would cut [0, 4), [4, 8): not aligned
    assert WriterLayout(1, 8, (0,), (0, 4)).fitting_object_heads((4, 6), 8) == 2
    assert WriterLayout(1, 4, object_heads=2).fitting_object_heads((0, 4), 4) == 0  # reads no other heads
    for k in (1, 2):  # the grain it names does spare the reader
        assert WriterLayout(1, 4, object_heads=k).reads((0, 2), 4) == [((g, g + k), (g, g + k)) for g in range(0, 2, k)]


def test_marker_round_trips_and_old_markers_decode_the_same():
    for layout in (WriterLayout(30, 3, object_heads=1), WriterLayout(4, 8, (0, 2), (0, 4), "int8", 2),
                   WriterLayout(4, 8, (0, 2), (0, 4), "lossless"), WriterLayout(30), WriterLayout(30, 3, codec="fp8")):
        assert WriterLayout.decode(layout.encode()) == layout
    assert WriterLayout(30, 3, object_heads=1).encode() == "30;H=3;l=0;h=0;c=raw;o=1"
    assert WriterLayout(4, 8, (0, 2), (0, 4), "int8", 2).encode() == "4;H=8;l=0,2;h=0,4;c=int8;o=2"
    # a grain that splits nothing is no grain: the layout and its marker are exactly those of before
    assert WriterLayout(30, 3, object_heads=3) == WriterLayout(30, 3)
    assert WriterLayout(30, 3, object_heads=8).encode() == "30"
    assert WriterLayout(4, 8, (0, 2), (0, 4), object_heads=4).encode() == "4;H=8;l=0,2;h=0,4;c=raw"
    # 5-field markers, as every writer before the grain wrote them
    assert WriterLayout.decode("4;H=2;l=0,2;h=0,1;c=raw") == WriterLayout(4, 2, (0, 2), (0, 1))
    assert WriterLayout.decode("30;H=0;l=0;h=0;c=int8").object_heads == 0
    assert WriterLayout.decode("30") == WriterLayout(30)
    for bad in ("30;H=3;l=0;h=0;c=raw;o=0", "30;H=3;l=0;h=0;c=raw;o=x", "30;H=3;l=0;h=0;c=raw;x=1",
                "30;H=3;l=0;h=0;c=raw;o=1;o=1", "30;H=3;l=0;h=0;c=raw;o=3"):  # o=3 splits none of 3 heads
        with pytest.raises(ValueError, match="not a commit marker"):
            WriterLayout.decode(bad)


def test_a_grain_needs_the_head_count_and_is_not_negative():
    with pytest.raises(ValueError, match="head count"):
        WriterLayout(4, object_heads=1)
    with pytest.raises(ValueError, match="negative"):
        WriterLayout(4, 4, object_heads=-1)
    assert KVShard().resolve(4, 4).layout(4) == WriterLayout(4, 4)  # a node's own grid carries no grain


def test_the_store_option(tmp_path):
    url = f"file://{tmp_path}"
    assert open_store(url).heads_per_object == 0
    assert open_store(f"{url}?heads_per_object=2").heads_per_object == 2
    assert open_store(f"{url}?heads_per_object=2", heads_per_object=1).heads_per_object == 1  # keywords win
    for bad in ("-1", "x", "1.5"):
        with pytest.raises(ValueError, match="bad value for heads_per_object"):
            open_store(f"{url}?heads_per_object={bad}")
    with pytest.raises(ValueError, match="heads_per_object must be an integer >= 0"):
        open_store(url, heads_per_object=-2)

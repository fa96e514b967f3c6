"""bench/bench_detok_small_frames.py: both lanes run on the same frames, and the lane is the one taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_detok_small_frames import frame_times, main
from tests.test_detok_columns_one_id import record_few_rows_lane


def test_the_lane_takes_the_frames_of_its_stream_only(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = record_few_rows_lane(monkeypatch)  # the other stream, lane off, never offers it a frame
    times = frame_times(smollm2_dir, rows=2, num_frames=40, cold=False)
    assert set(times) == {"lane", "numpy"} and all(len(t) == 40 and min(t) > 0 for t in times.values())
    assert sum(taken) >= 20  # most frames of the lane's stream; none of the other's


def test_prints_one_table_row_per_rows_and_caches(smollm2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--frames", "40", "--rows", "1,3", "--model", str(smollm2_dir)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[:2] for row in rows] == [["| 1", "warm"], ["| 1", "flushed"], ["| 3", "warm"],
                                                      ["| 3", "flushed"]]
    assert all(float(row.split(" | ")[4].rstrip(" |")) > 0 for row in rows)

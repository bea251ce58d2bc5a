"""A server of one data-parallel rank (--data-parallel-rank R): its one engine is engine R, and says so."""

import pytest

from tinyserve.entrypoints.api.metrics import ServerMetrics
from tinyserve.frontend.dp_client import data_parallel_engine_indices
from tinyserve.wire.messages import EngineCoreOutputs, SchedulerStats


def test_a_data_parallel_rank_is_the_one_engine_index_of_its_server():
    assert data_parallel_engine_indices(2, None, in_process=False) == range(2)
    assert data_parallel_engine_indices(4, 3, in_process=False) == range(3, 4)
    assert data_parallel_engine_indices(4, None, in_process=True) == range(1)


@pytest.mark.parametrize(("size", "rank", "message"), [
    (1, 0, "data_parallel_rank needs data_parallel_size of at least 2, got 1"),
    (2, 2, r"data_parallel_rank must be in \[0, 2\), got 2"),
    (2, -1, r"data_parallel_rank must be in \[0, 2\), got -1"),
])
def test_a_data_parallel_rank_outside_its_group_is_refused(size, rank, message):
    with pytest.raises(ValueError, match=message):
        data_parallel_engine_indices(size, rank, in_process=False)


def test_the_metrics_of_a_one_rank_server_carry_that_engine_label_only():
    metrics = ServerMetrics("tiny", range(1, 2), max_model_len=64)
    metrics.on_outputs(EngineCoreOutputs(engine_index=1, scheduler_stats=SchedulerStats(num_waiting_reqs=4)))
    text = metrics.render().decode()
    assert 'tinyserve:num_requests_waiting{engine="1",model_name="tiny"} 4.0' in text
    assert 'engine="0"' not in text

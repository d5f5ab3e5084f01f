"""TensorBoard event files written without TensorFlow, read back with TensorBoard's own loaders."""

import pytest
from tb_util import assert_mirrors, scalars

from zeroth.config import load_config_dict
from zeroth.train import tensorboard as tb
from zeroth.train.metrics import MetricsWriter, clear

pytest.importorskip("tensorboard", reason="the dev extra installs tensorboard: pip install -e '.[dev]'")


@pytest.mark.parametrize(
    "data, crc",
    [
        (b"", 0x00000000),
        (b"123456789", 0xE3069283),
        (bytes(32), 0x8A9136AA),  # RFC 3720, B.4
        (b"\xff" * 32, 0x62A8AB43),
        (bytes(range(32)), 0x46DD794E),
    ],
)
def test_crc32c_matches_the_published_check_values(data, crc):
    assert tb.crc32c(data) == crc


def test_event_file_opens_with_tensorboards_loader(tmp_path):
    from tensorboard.backend.event_processing import event_file_loader

    w = tb.EventWriter(tmp_path)
    w.write_row(
        {"kind": "train", "step": 3, "time_unix_s": 1.7e9, "loss": 0.25, "lr": 0.01, "digest": "ab", "note": None}
    )
    w.close()
    events = list(event_file_loader.EventFileLoader(str(w.path)).Load())
    assert w.path.name.startswith("events.out.tfevents.")
    assert events[0].file_version == "brain.Event:2"
    assert (events[1].step, events[1].wall_time) == (3, 1.7e9)
    # TensorBoard's loader turns simple_value into scalar tensors of the scalars plugin
    assert {v.tag: v.tensor.float_val[0] for v in events[1].summary.value} == {
        "train/loss": 0.25,
        "train/lr": pytest.approx(0.01),
    }
    assert {v.metadata.plugin_data.plugin_name for v in events[1].summary.value} == {"scalars"}


@pytest.mark.parametrize("first_serial", [9, 99], ids=["9-then-10", "99-then-100"])
def test_a_file_written_in_the_same_second_sorts_after_the_earlier_ones(tmp_path, monkeypatch, first_serial):
    """TensorBoard reads a folder's event files in the order of their names. A resumed run's file
    created within the same second as the earlier one (the same unix second in both names), its
    serial number one digit longer (9 then 10), sorted first by name, so the earlier file's points
    after the restart were read last and kept: a resumed run's file must sort after every earlier
    file of its folder."""
    import itertools

    monkeypatch.setattr(tb, "_serial", itertools.count(first_serial))
    monkeypatch.setattr(tb.time, "time", lambda: 1_700_000_000.25)
    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": s, "time_unix_s": 100.0 + s, "loss": 1.0 / s} for s in range(1, 6)]
    with MetricsWriter(path, tensorboard=True) as w:
        for r in rows:
            w.write(r)
    again = {"kind": "train", "step": 4, "time_unix_s": 200.0, "loss": 0.5}
    with MetricsWriter(path, tensorboard=True, resumed_after=3) as w:
        w.write(again)
    names = sorted(p.name for p in tmp_path.glob("events.out.tfevents.*"))
    assert len(names) == 2 and names[0].endswith(f".{first_serial}"), names  # the earlier file first
    assert_mirrors(tmp_path, rows[:3] + [again], fields=("loss",))


def test_metrics_writer_mirrors_rows_and_a_resumed_run_replaces_the_later_points(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"kind": "train", "step": s, "time_unix_s": 100.0 + s, "loss": 1.0 / s, "payload_bytes_total": 10 * s}
        for s in range(1, 6)
    ]
    rows.append({"kind": "eval", "step": 5, "time_unix_s": 106.0, "eval_accuracy": 0.75, "eval_loss": float("nan")})
    with MetricsWriter(path, tensorboard=True) as w:
        for r in rows:
            w.write(r)
    assert_mirrors(tmp_path, rows)
    # resumed from step 3: the rows after it are written again; TensorBoard keeps only the new ones
    again = {"kind": "train", "step": 4, "time_unix_s": 200.0, "loss": 0.5, "payload_bytes_total": 41}
    with MetricsWriter(path, tensorboard=True, resumed_after=3) as w:
        w.write(again)
    assert_mirrors(tmp_path, rows[:3] + [again])
    assert "eval/accuracy" not in scalars(tmp_path) or not scalars(tmp_path)["eval/accuracy"]
    clear(path)
    assert not list(tmp_path.iterdir())
    with MetricsWriter(path) as w:  # off unless asked for
        w.write(rows[0])
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_run_tensorboard_is_a_config_field_on_by_default():
    assert load_config_dict({}).run.tensorboard is True
    assert load_config_dict({"run": {"tensorboard": False}}).run.tensorboard is False
    with pytest.raises(ValueError, match="run.tensorboard"):
        load_config_dict({"run": {"tensorboard": "yes"}})

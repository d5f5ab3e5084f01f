"""Read a run folder's TensorBoard event files with TensorBoard's own reader and compare them with metrics.jsonl."""

import math

import numpy as np


def scalars(folder) -> dict[str, list]:
    """``{tag: [(step, wall_time, value), ...]}`` as TensorBoard's ``EventAccumulator`` loads ``folder``."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {t: [(e.step, e.wall_time, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def assert_mirrors(folder, rows, fields=("loss", "eval_accuracy", "payload_bytes_total")) -> dict:
    """Each numeric ``field`` of the rows is the scalar ``<kind>/<name>`` at the row's step and time (float32)."""
    got = scalars(folder)
    for field in fields:
        for kind in sorted({r["kind"] for r in rows}):
            want = [
                (r["step"], r["time_unix_s"], r[field])
                for r in rows
                if r["kind"] == kind and isinstance(r.get(field), (int, float)) and not isinstance(r.get(field), bool)
            ]
            if not want:
                continue
            name = field[5:] if kind == "eval" and field.startswith("eval_") else field
            tag = f"{kind}/{name}"
            assert tag in got, (tag, sorted(got))
            assert [s for s, _, _ in got[tag]] == [s for s, _, _ in want], tag
            np.testing.assert_allclose([w for _, w, _ in got[tag]], [w for _, w, _ in want], rtol=0, atol=1e-6)
            for (_, _, a), (_, _, b) in zip(got[tag], want):
                assert a == float(np.float32(b)) or (math.isnan(a) and math.isnan(b)), (tag, a, b)
    return got

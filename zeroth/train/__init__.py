"""Training: the single-machine trainer, metrics files and checkpoints.

* :mod:`zeroth.train.trainer`: ZO (MeZO / Just One Byte with exact replay) and backprop methods,
  the training loop (:func:`~zeroth.train.trainer.train`).
* :mod:`zeroth.train.run`: the ``zeroth run`` command.
* :mod:`zeroth.train.metrics`: ``metrics.jsonl`` writer and readers.
* :mod:`zeroth.train.checkpoint`: orbax checkpoints with digest verification.

Submodules are imported on use (``from zeroth.train import trainer``) so importing the package
costs nothing.
"""

__all__ = ["trainer", "run", "metrics", "checkpoint"]

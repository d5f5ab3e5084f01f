"""Training: the loop with hooks, the single-machine trainer, metrics files and checkpoints.

* :mod:`zeroth.train.loop`: ``train(state, method, batches, hooks, steps=...)``, a loop that
  knows no model; everything besides stepping is a hook with a cadence.
* :mod:`zeroth.train.trainer`: a run from a config: the method of :mod:`zeroth.methods`, the
  batches, and the progress, metrics, evaluation and checkpoint hooks
  (:func:`~zeroth.train.trainer.train`).
* :mod:`zeroth.train.finetune`: the pretrained models' driver (the trainer plus ``summary.json``).
* :mod:`zeroth.train.metrics`: ``metrics.jsonl`` writer and readers, the schema every writer follows.
* :mod:`zeroth.train.tensorboard`: TensorBoard event files beside it, written without TensorFlow.
* :mod:`zeroth.train.checkpoint`: orbax checkpoints with digest verification.
* :mod:`zeroth.train.interrupt`: SIGINT/SIGTERM as a flag read between steps.
* :mod:`zeroth.train.runs`: run folders: the checks before a run writes, :func:`~zeroth.train.runs.load_run`.

Submodules are imported on use (``from zeroth.train import trainer``) so importing the package
costs nothing.
"""

__all__ = ["loop", "trainer", "finetune", "metrics", "tensorboard", "checkpoint", "interrupt", "runs"]

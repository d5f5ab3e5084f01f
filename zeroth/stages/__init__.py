"""A model cut into stages, and the data the stages read: shared by the two
model-parallel systems, the pipeline (AQ-SGD, seed 001) and the clusters (Ravnest, seed 003).

* :mod:`.partition`: a model cut into contiguous stages (zeroth's transformer, SmolLM2-135M);
  pure stage functions and each stage's parameters;
* :mod:`.examples`: the fixed example sets (SOTU windows, sentiment sentences) and their batches.
"""

"""A model cut into stages, and the data the stages read: shared by the two
model-parallel systems, the pipeline (AQ-SGD, seed 001) and the clusters (Ravnest, seed 003).

* :mod:`.partition`: a model cut into contiguous stages (zeroth's transformer, SmolLM2-135M);
  pure stage functions and each stage's parameters;
* :mod:`.examples`: the fixed example sets (SOTU windows, sentiment sentences) and their batches;
* :mod:`.build`: the example set, zeroth's transformer and the stage optimizer of a config;
* :mod:`.steps`: a stage's jitted forward, backward, loss and optimizer step;
* :mod:`.timing`: a stage's compute timed, on an emulated slower machine.
"""

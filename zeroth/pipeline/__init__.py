"""Pipeline-parallel backprop over slow links (AQ-SGD, seed 001).

* :mod:`.partition`: a model cut into contiguous stages (zeroth's transformer, SmolLM2-135M);
* :mod:`.engine`: one stage's GPipe micro-batch schedule, link codecs (:mod:`zeroth.compress`), AdamW;
* :mod:`.wire`: frames (``protos/zeroth/v1/pipeline.proto``) and their checks;
* :mod:`.link`: the gRPC link between two stages and the token-bucket link emulation;
* :mod:`.stage`: ``zeroth stage``, one stage process; :mod:`.launch`: ``zeroth run`` with a
  ``pipeline:`` section (all stages on 127.0.0.1);
* :mod:`.sim`: the same engines in one process, the single-process reference, emulated wall-clock;
* :mod:`.data`: the fixed example sets (SOTU windows, sentiment sentences);
* :mod:`.build`: config -> examples, partition, engines; :mod:`.compare`: one config, several
  compressions, a results JSON (``python -m zeroth.pipeline.compare``);
* :mod:`.proto_gen`: regenerates the checked-in stubs in :mod:`.proto`.
"""

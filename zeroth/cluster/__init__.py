"""Ravnest (seed 003): clusters formed by a genetic algorithm, zero-bubble asynchronous model
parallelism inside each cluster, parallel multi-ring averaging across clusters.

* :mod:`.formation`: nodes (RAM, bandwidth, compute speed) grouped into clusters by a genetic
  algorithm with a penalty fitness (checked against brute force and a greedy baseline); the model
  split inside a cluster into contiguous stages in proportion to RAM; a node's speed calibration;
* :mod:`.rings`: the parallel multi-ring all-reduce: which nodes of which clusters average which
  part of the parameters (one ring per segment between all clusters' cut points), one node's part
  of the rounds over a message exchange (the same bits on every member), and the bytes and seconds
  of one averaging against one ring over the whole model (``python -m zeroth.cluster.rings``);
* :mod:`.config`: the ``ravnest:`` section of a config; it sits at the config's layer, below this
  package: it imports only :mod:`zeroth.schema`.
"""

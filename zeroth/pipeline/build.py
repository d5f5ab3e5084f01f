"""From a config with a ``pipeline:`` section to the pieces every stage builds the same way
(the shared ones come from :mod:`zeroth.stages.build`).

* :func:`examples_of`: the fixed example set (:mod:`zeroth.stages.examples`);
* :func:`partition_of`: the model cut into stages (:mod:`zeroth.stages.partition`), from
  zeroth's exact initialization (``transformer``) or SmolLM2's weights (``smollm2_prompt``);
* :func:`optimizer_of`: each stage's ``optax.adamw`` (or the optimizer ``train.optimizer`` names),
  at the learning rate of ``train.schedule`` (:func:`lr_at`);
* :func:`run_id_of`: the id every frame carries (a digest of the training fields);
* :func:`engine_of`: stage ``i``'s :class:`~zeroth.pipeline.engine.StageEngine`;
* :func:`plan_of`: the micro-batches of a step ``[(ids, tokens, labels), ...]`` (of one replica);
* :func:`replica_sync_of`: a replica's part in averaging a stage (:mod:`zeroth.pipeline.replicas`).
"""

from __future__ import annotations


import numpy as np
from zeroth import config as _config
from zeroth import schedules as _schedules
from zeroth.pipeline import engine as _engine
from zeroth.pipeline import replicas as _replicas
from zeroth.stages import build as _sbuild
from zeroth.stages import examples as _pdata
from zeroth.stages import partition as _partition

__all__ = [
    "RUN_ID_EXCLUDE",
    "engine_of",
    "examples_of",
    "family_of",
    "full_steps_of",
    "lr_at",
    "optimizer_of",
    "partition_of",
    "plan_of",
    "replica_sync_of",
    "run_id_of",
    "tokenizer_of",
]

# deployment fields that may differ between the stages of one run
RUN_ID_EXCLUDE = (
    "run.out_dir",
    "run.name",
    "run.tensorboard",
    "pipeline.host",
    "pipeline.timeout_s",
    "pipeline.buffers",
    "pipeline.bandwidth_bps",
    "pipeline.latency_ms",
    "pipeline.emulate_bandwidths_bps",
    "pipeline.slowdown",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.log_every",
    "train.eval_every",
)


def family_of(cfg: _config.Config) -> str:
    """``transformer`` (zeroth's own) or ``smollm2`` (model.name ``smollm2_prompt``: SmolLM2-135M's weights)."""
    return "smollm2" if cfg.model.name == "smollm2_prompt" else "transformer"


def tokenizer_of(cfg: _config.Config) -> str:
    """``bytes`` for zeroth's transformer, ``smollm2`` for SmolLM2."""
    return "smollm2" if family_of(cfg) == "smollm2" else "bytes"


def examples_of(cfg: _config.Config) -> _pdata.Examples:
    """The fixed example set of the run (cached)."""
    p = cfg.pipeline
    return _sbuild.examples_of(cfg.data.dataset, p.examples, p.seq_len, tokenizer_of(cfg))


def partition_of(cfg: _config.Config, ex: _pdata.Examples) -> _partition.Partition:
    """The model of ``cfg`` cut into ``pipeline.stages`` stages, with its initial parameters."""
    p = cfg.pipeline
    if family_of(cfg) == "smollm2":
        if cfg.model.kwargs:
            raise ValueError(
                f"config field model.kwargs: the SmolLM2 pipeline takes no arguments, got {cfg.model.kwargs}"
            )
        from zeroth.models.pretrained import llama

        params, lcfg = llama.load_smollm2()
        return _partition.smollm2_partition(params, lcfg, p.stages)
    model, params = _sbuild.transformer_of(cfg, ex, p.objective, p.seq_len)
    return _partition.transformer_partition(
        params, p.stages, objective=p.objective, heads=model.heads, mlp_dim=model.mlp_dim, pad_id=ex.pad_id
    )


def lr_at(cfg: _config.Config, step: int) -> float:
    """The learning rate of the update of step ``step`` (0-based): ``train.schedule`` with peak
    ``train.lr`` (:mod:`zeroth.schedules`, float64 on the host; ``train.lr`` without a schedule)."""
    return float(_schedules.from_train(cfg.train)(int(step)))


def optimizer_of(cfg: _config.Config):
    """Each stage's optimizer. Without a schedule (``train.schedule`` constant, no warm-up) at the
    constant ``train.lr``; otherwise at the rates :func:`lr_at` computes on the host for the run's
    ``train.steps`` updates, rounded to float32 and looked up by optax's update count (so every
    stage, and the single-process reference, applies the same rates)."""
    sched = _schedules.from_train(cfg.train)
    if sched.is_constant:
        return _sbuild.optimizer_of(cfg)
    table = np.asarray([sched(t) for t in range(max(cfg.train.steps, 1))], np.float32)

    def lr(count):
        import jax.numpy as jnp

        return jnp.asarray(table)[jnp.minimum(count, table.size - 1)]

    return _sbuild.optimizer_of(cfg, lr)


def full_steps_of(cfg: _config.Config) -> int:
    """Steps of the uncompressed warm-up: ``pipeline.full_epochs`` epochs of ``examples / batch_size`` steps."""
    return cfg.pipeline.full_epochs * (cfg.pipeline.examples // cfg.data.batch_size)


def run_id_of(cfg: _config.Config) -> str:
    """First 16 hex digits of the config digest without the deployment fields (:data:`RUN_ID_EXCLUDE`)."""
    return _config.config_digest(cfg, exclude=RUN_ID_EXCLUDE)[:16]


def engine_of(
    cfg: _config.Config, index: int, part: _partition.Partition, ex: _pdata.Examples, buffer_dir=None
) -> _engine.StageEngine:
    """Stage ``index``'s engine (its slice of the parameters, its optimizer, its link buffers)."""
    p = cfg.pipeline
    codecs = _engine.link_codecs(p.compression, p.fw_bits, p.bw_bits, p.scale_axis, p.rounding)
    return _engine.StageEngine(
        index,
        p.stages,
        part.fns[index],
        part.params[index],
        optimizer_of(cfg),
        codecs,
        run_seed=cfg.run.seed,
        run_id=run_id_of(cfg),
        n_examples=p.examples,
        row_shape=(p.seq_len, part.width),
        micro_batches=p.micro_batches,
        buffer_dir=buffer_dir,
        slowdown=p.slowdown,
        full_steps=full_steps_of(cfg),
    )


def replica_sync_of(cfg: _config.Config, replica: int, index: int, params) -> _replicas.ReplicaSync:
    """Replica ``replica``'s part in averaging stage ``index`` (``pipeline.replica_sync``) over the stage's ``params``."""
    p, o = cfg.pipeline, cfg.train.optimizer
    return _replicas.ReplicaSync(
        p.replica_sync,
        p.replicas,
        replica,
        index,
        run_id_of(cfg),
        params,
        warmup=p.replica_warmup_steps,
        b1=o.b1,
        b2=o.b2,
        weight_decay=o.weight_decay if o.name == "adamw" else 0.0,
    )


def plan_of(
    cfg: _config.Config, ex: _pdata.Examples, step: int, replica: int = 0
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``[(ids int64[b], tokens int32[b, T], labels int32[b]), ...]``: the micro-batches of ``step``
    for ``replica``: the ``replica``-th of ``pipeline.replicas`` equal contiguous shares of the batch
    (the whole batch with one replica), cut into ``pipeline.micro_batches``."""
    ids = _pdata.batch_ids(cfg.run.seed, step, cfg.data.batch_size, cfg.pipeline.examples)
    R = cfg.pipeline.replicas
    if not 0 <= replica < R:
        raise ValueError(f"replica {replica} is outside 0..{R - 1} (pipeline.replicas = {R})")
    ids = _pdata.micro_batches(ids, R)[replica]
    return [(m, ex.tokens[m], ex.labels[m]) for m in _pdata.micro_batches(ids, cfg.pipeline.micro_batches)]

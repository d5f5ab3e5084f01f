"""What a Just One Byte peer computes: projected gradients of its perturbations, the exact replay
of a decided iteration, evaluation. The network never touches parameters except through here.

* :meth:`Worker.compute` evaluates perturbations ``sample_key(run.seed, machine, iteration, i)``,
  ``i = 0, 1, ...``, in chunks of ``chunk`` keys (one compiled shape), each chunk on its own
  batch of this machine's data stream, until ``n = peers.inferences_per_iteration`` projected
  gradients or the deadline; then encodes them with the run's codec.
* :meth:`Worker.apply` replays a decided iteration: every contributor's payload is *decoded*
  (its own included), the coefficients come from :func:`zeroth.zo.canonical_updates` (machine id,
  then sample index; N = all projected gradients of the iteration; learning rate ``η_t`` of
  ``train.schedule`` at the iteration, host float64, so every peer computes the same) and go through
  :func:`zeroth.replay.replay` as one canonical unit, then the optional exact weight decay.
  With ``peers.clip = c`` every decoded value is first clipped to ``[-c, c]`` (float32, exact on
  every backend), so an authenticated member sending outlier bytes moves the parameters by at
  most what ``c`` allows; :meth:`Worker.updates` also returns per-member statistics (count,
  sum and max of ``|g|`` before the clip, values clipped) that the peer sums into its summary.
  The key list is padded with zero-coefficient updates to a power of two (at least 8) so that
  a changing number of contributors compiles a handful of shapes only; a zero coefficient is an
  exact no-op (``p + 0·k = p`` after the flush), so the bits are those of the unpadded replay.

Data: machine ``m`` draws its batches from its own stream ``zeroth.data.batch_at(train,
batch_seed(run.seed, m), iteration * chunks + chunk, batch_size)``: peers train on different
examples, as in seed 000.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import codecs as _codecs
from zeroth import data as _data
from zeroth import objectives as _objectives
from zeroth import reference as _ref
from zeroth import replay as _replay
from zeroth import rng as _rng
from zeroth import schedules as _schedules
from zeroth import zo as _zo
from zeroth.config import Config

__all__ = ["BATCH_STREAM_TAG", "batch_seed", "padded_size", "Worker"]

BATCH_STREAM_TAG = 0x6A6F6273  # "jobs": names the per-machine batch streams


@functools.lru_cache(maxsize=256)
def batch_seed(run_seed: int, machine: int) -> int:
    """The batch-stream seed of ``machine``: word 0 of ``fold_in(fold_in(root_key(run_seed), TAG), machine)``.

    Cached: a peer draws two batches per iteration, and each would otherwise run two NumPy threefry chains.
    """
    key = _ref.fold_in(_ref.fold_in(_ref.root_key(run_seed), BATCH_STREAM_TAG), machine)
    return int(key[0])


def padded_size(k: int) -> int:
    """The replay length for ``k`` updates: the next power of two, at least 8."""
    return max(8, 1 << max(0, k - 1).bit_length())


class Worker:
    """The model, data, estimator and replay of one peer, built from a config with a ``peers`` section.

    Args:
      cfg: the run's config.
      chunk: keys per compiled estimator call (default ``min(n, 8)``).
    """

    def __init__(self, cfg: Config, *, chunk: int | None = None):
        if cfg.peers is None:
            raise ValueError(
                "the config has no 'peers' section; a peer needs peers.inferences_per_iteration and timeouts"
            )
        self.cfg = cfg
        t = cfg.train
        self.seed = cfg.run.seed
        self.n = cfg.peers.inferences_per_iteration
        self.chunk = int(chunk or min(self.n, 8))
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.chunks = math.ceil(self.n / self.chunk)
        self.codec = _codecs.get_codec(t.codec)
        self.distribution = t.distribution
        self.eps = _zo.round_eps(t.eps)
        self.clip = cfg.peers.clip
        self.schedule = _schedules.from_train(t)
        self.train_ds = _data.load(cfg.data.dataset, "train")
        test = _data.load(cfg.data.dataset, "test")
        k = cfg.data.eval_size or test.x.shape[0]
        self.eval_x, self.eval_y = test.x[:k], test.y[:k]
        self.model, self._init = _objectives.build_model(cfg, self.train_ds.num_classes, self.train_ds.x[:1])
        self.loss_fn = _objectives.make_objective(t.objective, self.model)
        self.grads_fn = _zo.projected_gradients_fn(self.loss_fn, distribution=self.distribution)
        self.eval_fn = _objectives.make_eval_fn(self.model, cfg.data.eval_batch_size)
        self.d = int(sum(np.size(x) for x in jax.tree_util.tree_leaves(self._init)))

    def initial_params(self) -> Any:
        """The founder's parameters at iteration 0 (others download them)."""
        return self._init

    def template(self) -> Any:
        """A pytree with the parameters' structure, dtypes and shapes (for :func:`zeroth.net.state.unflatten`)."""
        return self._init

    def batch(self, machine: int, iteration: int, chunk: int):
        """``(x, y)`` of chunk ``chunk`` of ``machine`` at ``iteration``."""
        step = iteration * self.chunks + chunk
        return _data.batch_at(self.train_ds, batch_seed(self.seed, machine), step, self.cfg.data.batch_size)

    def compute(self, params, machine: int, iteration: int, deadline: float | None = None) -> tuple[int, bytes, float]:
        """Projected gradients of ``machine`` at ``iteration``: ``(count, payload, mean loss)``.

        Stops after ``n`` values, or after the chunk during which ``time.monotonic()`` passed
        ``deadline`` (at least one chunk is evaluated).

        Raises:
          FloatingPointError: a projected gradient is not finite (the run diverged).
        """
        gs, ls = [], []
        done = 0
        c = 0
        while done < self.n:
            keys = _rng.sample_keys(self.seed, [(machine, iteration, done + i) for i in range(self.chunk)])
            g, loss = jax.device_get(self.grads_fn(params, self.batch(machine, iteration, c), keys, self.eps))
            take = min(self.chunk, self.n - done)
            gs.append(np.asarray(g, np.float32)[:take])
            ls.append(np.asarray(loss, np.float32)[:take])
            done += take
            c += 1
            if deadline is not None and time.monotonic() >= deadline:
                break
        g = np.concatenate(gs)
        if not np.all(np.isfinite(g)):
            raise FloatingPointError(
                f"machine {machine} iteration {iteration}: projected gradients are not finite ({g.tolist()[:8]}); "
                f"the run diverged, lower train.lr ({self.cfg.train.lr}) or train.eps ({self.cfg.train.eps})"
            )
        return int(g.size), self.codec.encode(g), float(np.mean(np.concatenate(ls)))

    def check_payload(self, payload: bytes) -> str | None:
        """Codec-level validation of a received payload: the error, or None."""
        try:
            values = self.codec.decode(payload)
        except (ValueError, TypeError) as e:
            return str(e)
        if not np.all(np.isfinite(values)):
            return f"payload decodes to non-finite values with codec {self.codec.name}"
        return None

    def decode(
        self, contributors, payloads, clip: float | None = None
    ) -> tuple[dict[int, np.ndarray], dict[int, tuple[int, float, float, int]]]:
        """Decoded projected gradients ``{machine: f32[n]}``, clipped to ``[-clip, clip]`` (default
        ``peers.clip``), and per-member statistics ``{machine: (count, sum |g|, max |g|, clipped)}``
        (``|g|`` before the clip)."""
        clip = self.clip if clip is None else clip
        grads, stats = {}, {}
        for (m, _), p in zip(contributors, payloads, strict=True):
            g = np.asarray(self.codec.decode(p), np.float32)
            a = np.abs(g)
            clipped = 0
            if clip is not None:
                c = np.float32(clip)
                clipped = int(np.count_nonzero(a > c))
                g = np.clip(g, -c, c)
            stats[m] = (int(g.size), float(a.sum(dtype=np.float64)), float(a.max()) if g.size else 0.0, clipped)
            grads[m] = g
        return grads, stats

    def updates(
        self, iteration: int, contributors, payloads, clip: float | None = None
    ) -> tuple[np.ndarray, np.ndarray, dict]:
        """``(keys u32[K', 2], coefficients f64[K'], stats)`` of a decided iteration, padded (see the module docstring)."""
        grads, stats = self.decode(contributors, payloads, clip)
        ups = _zo.canonical_updates(self.seed, iteration, grads, self.schedule, self.cfg.train.lr_scaling)
        k = padded_size(len(ups))
        keys = np.zeros((k, 2), np.uint32)
        coeffs = np.zeros(k, np.float64)
        for i, (key, c) in enumerate(ups):
            keys[i] = key
            coeffs[i] = c
        return keys, coeffs, stats

    def apply(
        self, params, iteration: int, contributors, payloads, clip: float | None = None, *, impl: str = "auto"
    ) -> tuple[Any, dict]:
        """``(parameters after the decided iteration, per-member statistics)`` (exact; the input buffers
        are donated; ``impl``: the replay's kernel, :func:`zeroth.replay.replay`)."""
        keys, coeffs, stats = self.updates(iteration, contributors, payloads, clip)
        params = _replay.replay(params, (keys, coeffs), distribution=self.distribution, donate=True, impl=impl)
        if self.cfg.train.weight_decay:
            params = _zo.weight_decay(params, self.schedule(iteration), self.cfg.train.weight_decay, donate=True)
        return params, stats

    def evaluate(self, params) -> dict:
        """``{"eval_loss", "eval_accuracy"}`` on the test split (``data.eval_size`` examples)."""
        return self.eval_fn(params, self.eval_x, self.eval_y)

    def _compile_replay(self, k: int) -> None:
        params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), self._init)
        _replay.replay(params, (np.zeros((k, 2), np.uint32), np.zeros(k)), distribution=self.distribution, donate=True)

    def warm_up(self, contributors: int) -> None:
        """Compile the estimator and the replay for ``contributors`` peers before taking part."""
        params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), self._init)
        self.compute(params, 0, 0)
        self._compile_replay(padded_size(contributors * self.n))

    def warm_up_more(self, contributors: int) -> None:
        """Compile the replay lengths of 1 .. ``contributors + 2`` peers and the evaluation (a new
        shape met mid-run would otherwise stall that iteration by one compilation)."""
        for k in sorted({padded_size(m * self.n) for m in range(1, contributors + 3)}):
            self._compile_replay(k)
        self.evaluate(self._init)

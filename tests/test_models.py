"""Models: shapes, float32 parameters, deterministic init, registry and argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroth import models
from zeroth.replay import checksum

CASES = [
    ("mlp", {"hidden": (16,)}, (8, 8, 1)),
    ("mlp", {"hidden": (), "activation": "tanh"}, (28, 28, 1)),
    ("cnn", {"features": (4, 8), "dense": 16}, (8, 8, 1)),
    ("cnn", {"features": (4,), "dense": 0}, (28, 28, 1)),
    ("transformer", {"d_model": 16, "heads": 2, "layers": 1, "mlp_dim": 32}, (8, 8, 1)),
    ("transformer", {"d_model": 16, "heads": 4, "layers": 2, "mlp_dim": 32}, (28, 28, 1)),
]


@pytest.mark.parametrize("name, kwargs, shape", CASES, ids=[f"{c[0]}-{c[2][0]}" for c in CASES])
def test_shapes_dtypes_and_jit(name, kwargs, shape):
    model = models.build(name, num_classes=7, **kwargs)
    params = models.init(model, models.init_key(0), np.zeros((1, *shape), np.float32))
    leaves = jax.tree_util.tree_leaves(params)
    assert leaves and all(leaf.dtype == jnp.float32 for leaf in leaves)
    x = np.linspace(0, 1, 5 * int(np.prod(shape)), dtype=np.float32).reshape(5, *shape)
    logits = jax.jit(lambda p, x: models.apply(model, p, x))(params, x)
    assert logits.shape == (5, 7) and logits.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(logits)))
    # logits depend on the input (the model is not constant)
    assert not np.allclose(logits[0], logits[-1])


def test_mlp_parameter_count():
    params = models.init("mlp", models.init_key(0), np.zeros((1, 8, 8, 1), np.float32), num_classes=10, hidden=[32])
    assert models.param_count(params) == 64 * 32 + 32 + 32 * 10 + 10
    assert set(params) == {"Dense_0", "Dense_1"} and params["Dense_0"]["kernel"].shape == (64, 32)


def test_exact_init_is_deterministic_and_seeded():
    x = np.zeros((1, 8, 8, 1), np.float32)
    a = models.init("cnn", models.init_key(3), x)
    b = models.init("cnn", models.init_key(3), x)
    c = models.init("cnn", models.init_key(4), x)
    assert checksum(a) == checksum(b) != checksum(c)


def test_transformer_on_tokens_masks_padding():
    model = models.build(
        "transformer", num_classes=3, vocab_size=50, d_model=16, heads=2, layers=1, mlp_dim=16, pad_id=0
    )
    params = models.init(model, models.init_key(0), np.ones((1, 6), np.int32))
    tokens = np.array([[5, 6, 7, 0, 0, 0]], np.int32)
    longer_pad = np.array([[5, 6, 7, 0, 0, 0, 0, 0]], np.int32)
    fwd = jax.jit(lambda p, x: models.apply(model, p, x))
    a = fwd(params, tokens)
    b = fwd(params, longer_pad)
    assert a.shape == (1, 3)
    # padding is masked out of attention and pooling; positions of real tokens are unchanged
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"unknown model 'resnet'.*'mlp'"):
        models.build("resnet")
    with pytest.raises(ValueError, match=r"no argument 'width'.*'hidden'"):
        models.build("mlp", width=3)
    with pytest.raises(TypeError, match="float inputs"):
        models.init("mlp", models.init_key(0), np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="vocab_size"):
        models.init("transformer", models.init_key(0), np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="must divide d_model"):
        models.init("transformer", models.init_key(0), np.zeros((1, 8, 8, 1), np.float32), d_model=10, heads=4)
    with pytest.raises(ValueError, match="unknown activation"):
        models.init("mlp", models.init_key(0), np.zeros((1, 4), np.float32), activation="swish2")


def test_names_include_builtins():
    assert {"mlp", "cnn", "transformer"} <= set(models.names())


def test_exact_init_follows_the_reference_noise():
    from zeroth import reference as ref

    key = models.init_key(5)
    params = models.init(
        "transformer", key, np.zeros((1, 8, 8, 1), np.float32), d_model=8, heads=2, layers=1, mlp_dim=8
    )
    q = params["_Block_0"]["MultiHeadDotProductAttention_0"]["query"]["kernel"]
    path = "['_Block_0']['MultiHeadDotProductAttention_0']['query']['kernel']"
    k = ref.binomial_int(ref.leaf_key(key, path), q.size).astype(np.float32) * np.float32(0.5)
    np.testing.assert_array_equal(np.asarray(q), k.reshape(q.shape) * np.float32(1 / np.sqrt(8)))
    d1 = params["Dense_0"]["kernel"]  # (8 features of a row, 8), fan_in 8
    k1 = ref.binomial_int(ref.leaf_key(key, "['Dense_0']['kernel']"), d1.size).astype(np.float32) * np.float32(0.5)
    np.testing.assert_array_equal(np.asarray(d1), k1.reshape(d1.shape) * np.float32(1 / np.sqrt(8)))
    assert np.all(np.asarray(params["LayerNorm_0"]["scale"]) == 1) and np.all(
        np.asarray(params["Dense_0"]["bias"]) == 0
    )
    assert abs(float(np.std(np.asarray(params["pos_embedding"]))) - 0.02) < 0.002


def test_flax_init_is_available():
    params = models.init("mlp", models.init_key(0), np.zeros((1, 4), np.float32), exact=False, hidden=[3])
    assert params["Dense_0"]["kernel"].shape == (4, 3) and params["Dense_0"]["kernel"].dtype == jnp.float32

"""zeroth.rng: threefry-2x32 equals jax's own, key derivation is collision-free and validated,
leaf ids are stable functions of pytree paths."""

import os
import subprocess
import sys
from collections import namedtuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth import reference as ref
from zeroth import rng

U32 = st.integers(0, 2**32 - 1)
SIZES = st.sampled_from([1, 2, 7, 64, 129])


@jax.jit
def _bits_via_zeroth(key, counters):
    x0, x1 = rng.threefry2x32((key[0], key[1]), (jnp.zeros_like(counters), counters))
    return x0 ^ x1


@pytest.mark.parametrize(
    "key, counter, expected",
    [  # Random123 known-answer vectors for threefry2x32_20
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ],
)
def test_threefry_known_answers(key, counter, expected):
    k = tuple(np.uint32(v) for v in key)
    c = tuple(np.uint32(v) for v in counter)
    assert tuple(int(v) for v in rng.threefry2x32(k, c)) == expected
    assert tuple(int(v) for v in ref.threefry2x32(k, c)) == expected


@given(seed=U32, n=SIZES)
def test_threefry_xor_equals_jax_random_bits(seed, n):
    key = jax.random.PRNGKey(seed)
    expected = np.asarray(jax.random.bits(key, (n,), jnp.uint32))
    got = np.asarray(_bits_via_zeroth(key, jnp.arange(n, dtype=jnp.uint32)))
    np.testing.assert_array_equal(got, expected)
    x0, x1 = ref.threefry2x32(np.asarray(key), (np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32)))
    np.testing.assert_array_equal(x0 ^ x1, expected)


@given(k0=U32, k1=U32, c0=U32, c1=U32)
def test_threefry_jnp_equals_reference_on_arbitrary_words(k0, k1, c0, c1):
    counters = (np.array([c0, c1, 0], np.uint32), np.array([c1, c0, 2**32 - 1], np.uint32))
    got = jax.jit(rng.threefry2x32)((np.uint32(k0), np.uint32(k1)), counters)
    want = ref.threefry2x32((k0, k1), counters)
    np.testing.assert_array_equal(np.asarray(got[0]), want[0])
    np.testing.assert_array_equal(np.asarray(got[1]), want[1])


@given(seed=U32, data=U32)
def test_fold_in_equals_jax_random_fold_in(seed, data):
    key = jax.random.PRNGKey(seed)
    expected = np.asarray(jax.random.fold_in(key, data))
    np.testing.assert_array_equal(np.asarray(_fold_in_jit(key, np.uint32(data))), expected)
    np.testing.assert_array_equal(ref.fold_in(np.asarray(key), data), expected)


_fold_in_jit = jax.jit(rng.fold_in)


def test_fold_in_traced_data_does_not_recompile():
    f = jax.jit(lambda k, d: rng.fold_in(k, d))  # a fresh cache
    key = rng.root_key(3)
    outs = [np.asarray(f(key, np.uint32(d))) for d in (0, 1, 2**32 - 1)]
    assert f._cache_size() == 1
    assert len({o.tobytes() for o in outs}) == 3


@given(seed=U32)
def test_root_key_is_prngkey(seed):
    np.testing.assert_array_equal(rng.root_key(seed), np.asarray(jax.random.PRNGKey(seed)))
    assert rng.root_key(seed).dtype == np.uint32


@given(run=U32, machine=U32, iteration=U32, sample=U32)
def test_sample_key_is_a_fold_in_chain(run, machine, iteration, sample):
    key = jax.random.PRNGKey(run)
    for d in (machine, iteration, sample):
        key = jax.random.fold_in(key, d)
    got = rng.sample_key(run, machine, iteration, sample)
    assert got.dtype == np.uint32 and got.shape == (2,)
    np.testing.assert_array_equal(got, np.asarray(key))


def test_sample_key_no_concatenation_collision():
    # str(iteration) + str(sample) + str(machine) == "1023" for both: a concatenated seed collides.
    a = rng.sample_key(0, machine=23, iteration=1, sample=0)
    b = rng.sample_key(0, machine=3, iteration=10, sample=2)
    assert f"{1}{0}{23}" == f"{10}{2}{3}"
    assert a.tobytes() != b.tobytes()


def test_sample_keys_distinct_over_a_grid():
    tuples = [(m, it, s) for m in (0, 1, 2, 3, 23, 2**32 - 1) for it in (0, 1, 2, 10, 11) for s in range(12)]
    keys = rng.sample_keys(7, tuples)
    assert keys.shape == (len(tuples), 2) and keys.dtype == np.uint32
    assert len({k.tobytes() for k in keys}) == len(tuples)
    for i in (0, 17, len(tuples) - 1):
        np.testing.assert_array_equal(keys[i], rng.sample_key(7, *tuples[i]))
    assert rng.sample_keys(7, []).shape == (0, 2)
    # a different run seed changes every key
    other = rng.sample_keys(8, tuples)
    assert not (other == keys).all(axis=1).any()


@given(a=st.tuples(U32, U32, U32, U32), b=st.tuples(U32, U32, U32, U32))
def test_distinct_tuples_distinct_keys(a, b):
    ka, kb = rng.sample_key(*a), rng.sample_key(*b)
    assert (ka.tobytes() == kb.tobytes()) == (a == b)


@pytest.mark.parametrize("position, name", list(enumerate(["run_seed", "machine", "iteration", "sample"])))
@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, 1.0, 2.5, True, False, "3", None, np.float32(1)])
def test_sample_key_rejects_bad_arguments_by_name(position, name, bad):
    args = [1, 2, 3, 4]
    args[position] = bad
    with pytest.raises(ValueError, match=name) as info:
        rng.sample_key(*args)
    assert repr(bad) in str(info.value) or str(int(bad)) in str(info.value)
    assert "[0, 2**32)" in str(info.value)


def test_sample_key_accepts_numpy_integers_and_the_bounds():
    np.testing.assert_array_equal(
        rng.sample_key(np.uint32(5), np.int64(0), 2**32 - 1, np.uint64(9)), rng.sample_key(5, 0, 2**32 - 1, 9)
    )


@settings(max_examples=60, deadline=None)
@given(
    run=U32, triples=st.lists(st.tuples(U32, st.sampled_from([0, 1, 2**32 - 1]) | U32, U32), min_size=1, max_size=40)
)
def test_sample_keys_on_integers_and_on_numpy_are_the_reference_keys(run, triples):
    cols = [list(c) for c in zip(*triples)]
    ints, arrays = rng._sample_keys_ints(run, *cols), rng._sample_keys_numpy(run, *cols)
    assert ints.dtype == arrays.dtype == np.uint32 and ints.shape == arrays.shape == (len(triples), 2)
    np.testing.assert_array_equal(ints, arrays)
    for r in {0, len(triples) - 1}:
        np.testing.assert_array_equal(ints[r], ref.sample_key(run, *triples[r]))
    np.testing.assert_array_equal(rng.sample_keys(run, triples), ints)  # whichever path the size picks


def test_sample_keys_small_and_large_calls_agree_across_the_threshold():
    triples = [(3, 9, s) for s in range(rng.SCALAR_ROWS + 1)]
    large = rng.sample_keys(11, triples)  # NumPy path
    small = np.concatenate(
        [
            rng.sample_keys(11, triples[:1]),
            rng.sample_keys(11, triples[1 : rng.SCALAR_ROWS]),
            rng.sample_keys(11, triples[rng.SCALAR_ROWS :]),
        ]
    )
    np.testing.assert_array_equal(large, small)
    with pytest.raises(ValueError, match="run_seed"):
        rng.sample_keys(-1, [])


@pytest.mark.parametrize(
    "machines, iterations", [(3, 1), (rng.SCALAR_ROWS + 1, 2)], ids=["few-prefixes", "many-prefixes"]
)
def test_large_calls_fold_shared_prefixes_once_and_give_the_reference_keys(machines, iterations):
    # more rows than SCALAR_ROWS: an iteration's keys (few (machine, iteration) prefixes, folded
    # on integers, samples over NumPy rows) and a log's (more prefixes than that: all over NumPy)
    triples = [
        (m * 977, 40_000 + it, s)
        for m in range(machines)
        for it in range(iterations)
        for s in (0, 1, 7, 8, 2**31, 2**32 - 1)
    ]
    assert len(triples) > rng.SCALAR_ROWS
    keys = rng.sample_keys(5, triples)
    assert keys.dtype == np.uint32 and keys.shape == (len(triples), 2)
    np.testing.assert_array_equal(keys, np.stack([ref.sample_key(5, *t) for t in triples]))


@pytest.mark.parametrize(
    "bad, name",
    [(-5, "iteration"), (2**32, "iteration"), (True, "iteration"), (2.0, "iteration"), (np.int64(-1), "iteration")],
)
@pytest.mark.parametrize("rows", [2, rng.SCALAR_ROWS + 2])
def test_sample_keys_validate_each_tuple(bad, name, rows):
    triples = [(0, 0, s) for s in range(rows)]
    triples[-1] = (1, bad, 0)
    with pytest.raises(ValueError, match=rf"{name} \(row {rows - 1}\)"):
        rng.sample_keys(0, triples)


# ---------------------------------------------------------------- leaf ids

State = namedtuple("State", ["step", "params"])


def test_leaf_id_definition_is_pinned():
    # The first four bytes of SHA-256 of the key path string: changing this changes every perturbation.
    assert rng.leaf_id("['w']") == ref.leaf_id("['w']") == 0x183E6688
    path = jax.tree_util.tree_flatten_with_path({"w": 0})[0][0][0]
    assert rng.leaf_path(path) == "['w']"
    assert rng.leaf_id(path) == 0x183E6688


def test_leaf_ids_independent_of_insertion_order():
    a = {"dense": {"kernel": jnp.zeros((2, 3)), "bias": jnp.zeros(3)}, "out": [jnp.zeros(1), jnp.zeros(())]}
    b = {"out": [jnp.zeros(1), jnp.zeros(())], "dense": {"bias": jnp.zeros(3), "kernel": jnp.zeros((2, 3))}}
    ids_a, ids_b = rng.leaf_ids(a), rng.leaf_ids(b)
    assert ids_a == ids_b
    assert ids_a["dense"]["kernel"] == rng.leaf_id("['dense']['kernel']")
    assert ids_a["out"][1] == rng.leaf_id("['out'][1]")
    flat = jax.tree_util.tree_leaves(ids_a)
    assert len(set(flat)) == len(flat) == 4


def test_leaf_ids_follow_paths_not_positions():
    # The same leaf under another name gets another id; the same name in another tree the same id.
    t1 = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
    t2 = {"b": jnp.zeros(5), "c": jnp.zeros(2)}
    assert rng.leaf_ids(t1)["b"] == rng.leaf_ids(t2)["b"]
    assert rng.leaf_ids(t1)["a"] != rng.leaf_ids(t2)["c"]
    s = State(step=jnp.zeros(()), params={"w": jnp.zeros(2)})
    ids = rng.leaf_ids(s)
    assert ids.params["w"] == rng.leaf_id(".params['w']")
    assert ids.step == rng.leaf_id(".step")


def test_leaf_ids_reject_collisions(monkeypatch):
    monkeypatch.setattr(rng, "leaf_id", lambda path: 7)
    with pytest.raises(ValueError, match=r"collision.*\['a'\].*\['b'\]"):
        rng.leaf_ids({"a": jnp.zeros(1), "b": jnp.zeros(1)})


def test_leaf_id_is_the_same_in_another_process():
    paths = ["['dense']['kernel']", "['out'][1]", ".params['w']"]
    code = "import sys; from zeroth import reference as r; print(*[r.leaf_id(p) for p in sys.argv[1:]])"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code, *paths], env=env, capture_output=True, text=True, check=True)
    assert [int(v) for v in out.stdout.split()] == [rng.leaf_id(p) for p in paths]
    # the reference really is jax-free
    probe = "import sys, zeroth.reference; print('jax' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )

"""Tests of the Updater's `jit` backend: global arrays on a mesh, replicated or FSDP-sharded.

Every test runs with 4 simulated CPU devices (tests/conftest.py). The runs each
test compares are made once per module (`runs`): pmap with cross-replica
BatchNorm, and jit with BatchNorm over the global batch, replicated and fsdp,
3 steps each on the same global batches.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from trees import is_typed_key
from updater_helpers import (
    AXIS,
    NUM_CLASSES,
    NUM_DEVICES,
    flat_result,
    host_batch,
    plain_mlp,
    run_steps,
    to_host,
    train_jit_with_dropout,
)

import haiku_state as hs
from haiku_state import initialization, losses, models, replication, sharding, updater
from haiku_state.guards import replicas, updater_arguments

NUM_STEPS = 3
HIDDEN = 256  # The first layer's weights, 64 x 256 float32, are FSDP_MIN_BYTES: split.
# jit and pmap compile different programs (global reductions vs per-device means and
# pmeans): about 1e-7 apart after 3 steps here.
RTOL, ATOL = 1e-5, 1e-6


def _network(cross_replica_axis=None, hidden_sizes=(HIDDEN,), dropout_rate=0.0):
    """The project's MLP over `hk.BatchNorm` (the tests name its state's leaves)."""
    return models.make_network(
        "mlp",
        NUM_CLASSES,
        cross_replica_axis=cross_replica_axis,
        hidden_sizes=hidden_sizes,
        dropout_rate=dropout_rate,
        batch_norm="haiku",
    )


def _updater(backend="jit", param_sharding="replicated", network=None, **kwargs):
    if network is None:
        network = _network(AXIS if backend != "jit" else None)
    # Not Adam: the bias before BatchNorm has a zero gradient up to rounding, which Adam
    # would scale up to full-size steps and so amplify the last-bit differences.
    return hs.Updater(
        network,
        kwargs.pop("optimizer", optax.sgd(0.1, momentum=0.9)),
        losses.classification_loss(NUM_CLASSES),
        backend=backend,
        param_sharding=param_sharding,
        **kwargs,
    )


def _batches():
    return [hs.shard(host_batch(seed)) for seed in range(10, 10 + NUM_STEPS)]


def _eval_batch():
    batch = host_batch(99)
    batch["mask"] = (np.arange(len(batch["label"])) < 20).astype(np.float32)
    return hs.shard(batch)


def _train(step_updater):
    batches = _batches()
    initial = step_updater.init(0, batches[0])
    initial_host = to_host(initial)
    train_state, metrics = run_steps(step_updater, initial, batches)
    return {
        "initial": initial_host,
        "final": train_state,
        "metrics": metrics,
        "eval": jax.device_get(step_updater.evaluate(train_state, _eval_batch())),
        "updater": step_updater,
    }


@pytest.fixture(scope="module")
def runs():
    return {
        "pmap": _train(_updater("pmap")),
        "replicated": _train(_updater("jit", "replicated")),
        "fsdp": _train(_updater("jit", "fsdp")),
    }


def _comparable(run):
    train_state = run["final"]
    if not sharding.is_global(train_state):
        train_state = hs.unreplicate(train_state)
    result = flat_result(train_state, run["metrics"])
    del result["rng"]  # One key per device under pmap; compared apart.
    return result


def _assert_results_close(actual, expected, rtol=RTOL, atol=ATOL):
    assert set(actual) == set(expected)
    for key in sorted(actual):
        assert actual[key].dtype == expected[key].dtype, key
        np.testing.assert_allclose(actual[key], expected[key], rtol=rtol, atol=atol, err_msg=key)


# The layout.


def test_jit_train_state_is_global_arrays_without_device_axis(runs):
    train_state = runs["replicated"]["final"]
    pmap_state = runs["pmap"]["final"]
    unreplicated = hs.unreplicate(pmap_state)
    shapes = lambda tree: jax.tree.map(np.shape, tree)  # noqa: E731
    assert shapes(train_state._replace(rng=())) == shapes(unreplicated._replace(rng=()))
    assert is_typed_key(train_state.rng) and train_state.rng.shape == ()
    assert train_state.step.dtype == jnp.int32 and train_state.step.shape == ()
    mesh = replication.global_mesh(AXIS)
    for path, leaf in jax.tree_util.tree_leaves_with_path(train_state):
        assert leaf.sharding == sharding.replicated(mesh), jax.tree_util.keystr(path)
    assert sharding.is_global(train_state) and not sharding.is_global(pmap_state)
    assert updater.step_of(train_state) == NUM_STEPS == updater.step_of(pmap_state)


def test_init_key_derivation_matches_pmap_and_is_the_second_key_of_the_seed(runs):
    sequence = hk.PRNGSequence(0)
    init_key, run_key = next(sequence), next(sequence)
    np.testing.assert_array_equal(runs["replicated"]["initial"].rng, jax.random.key_data(run_key))
    # The same init key: the params of both backends start bit for bit alike, drawn on the host.
    pmap_initial = jax.tree.map(lambda x: x[0], runs["pmap"]["initial"].params)
    expected_params, _ = initialization.init(_network(), init_key, host_batch(10))
    for expected in (pmap_initial, expected_params):
        jax.tree.map(
            np.testing.assert_array_equal, to_host(runs["replicated"]["initial"].params), expected
        )


def test_fsdp_splits_the_large_leaves_of_params_and_opt_state_and_replicates_the_rest(runs):
    train_state = runs["fsdp"]["final"]
    split = P(None, AXIS)  # The 256 axis of the 64 x 256 weights.
    specs = jax.tree.map(lambda x: x.sharding.spec, train_state)
    assert specs.params["mlp/linear"]["w"] == split
    assert specs.opt_state[0].trace["mlp/linear"]["w"] == split  # Momentum, like its param.
    for small in (
        specs.params["mlp/linear"]["b"],  # 1 KiB
        specs.params["mlp/linear_1"]["w"],  # 256 x 10: 10 KiB
        specs.params["mlp/batch_norm"]["scale"],
        specs.opt_state[0].trace["mlp/linear_1"]["w"],
    ):
        assert small == P()
    for tree in (train_state.state, train_state.rng, train_state.step):
        assert all(
            spec == P() for spec in jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, tree))
        )
    shard_shapes = {s.data.shape for s in train_state.params["mlp/linear"]["w"].addressable_shards}
    assert shard_shapes == {(64, HIDDEN // NUM_DEVICES)}
    replicas.assert_train_state_invariants(train_state)


# The step computes what pmap computes.


def test_jit_replicated_equals_pmap_with_cross_replica_batchnorm(runs):
    jit_result, pmap_result = _comparable(runs["replicated"]), _comparable(runs["pmap"])
    _assert_results_close(jit_result, pmap_result)
    # The comparison covers BatchNorm's statistics, and training moved the params.
    assert "state['mlp/batch_norm/~/mean_ema']['average']" in jit_result
    np.testing.assert_array_equal(jit_result["state['mlp/batch_norm/~/mean_ema']['counter']"], 3)
    initial = runs["replicated"]["initial"].params["mlp/linear"]["w"]
    moved = np.abs(jit_result["params['mlp/linear']['w']"] - initial).max()
    assert moved > 1e3 * ATOL
    for name in runs["pmap"]["metrics"][-1]:
        np.testing.assert_allclose(
            runs["replicated"]["metrics"][-1][name], runs["pmap"]["metrics"][-1][name], rtol=RTOL
        )
    assert set(runs["replicated"]["eval"]) == {"loss", "accuracy", "weight"}
    for name, value in runs["pmap"]["eval"].items():
        np.testing.assert_allclose(runs["replicated"]["eval"][name], value, rtol=RTOL)


def test_fsdp_equals_replicated(runs):
    _assert_results_close(_comparable(runs["fsdp"]), _comparable(runs["replicated"]), 1e-6, 1e-6)
    for name, value in runs["replicated"]["eval"].items():
        np.testing.assert_allclose(runs["fsdp"]["eval"][name], value, rtol=1e-6)


def test_metrics_come_back_as_replicated_scalars(runs):
    step_updater = runs["fsdp"]["updater"]
    batch = _batches()[0]
    train_state = step_updater.init(0, batch)
    _, metrics = step_updater.update(train_state, batch, with_global_norms=False)
    assert set(metrics) == {"loss", "accuracy"}
    for value in metrics.values():
        assert value.shape == () and value.sharding.is_fully_replicated


def test_loss_scaling_under_fsdp_gives_the_unscaled_step(runs):
    # A power-of-two scale is exact in float32: the steps equal those without scaling.
    scaled = _updater("jit", "fsdp", loss_scale=jmp.DynamicLossScale(jnp.float32(2**10)))
    batches = _batches()
    train_state, metrics = run_steps(scaled, scaled.init(0, batches[0]), batches)
    assert isinstance(train_state.opt_state, updater.LossScaledOptState)
    assert train_state.opt_state.loss_scale.sharding.spec == P()
    assert train_state.opt_state.optimizer[0].trace["mlp/linear"]["w"].sharding.spec == P(
        None, AXIS
    )
    np.testing.assert_array_equal(metrics[-1]["loss_scale"], 2.0**10)
    unscaled = runs["fsdp"]
    np.testing.assert_allclose(metrics[-1]["loss"], unscaled["metrics"][-1]["loss"], rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        to_host(train_state.params),
        to_host(unscaled["final"].params),
    )


# Randomness: one key, drawn over the global batch, whatever the device count.

_OTHER_DEVICE_COUNT_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    assert jax.device_count() == int(sys.argv[2]), jax.devices()
    import updater_helpers
    np.savez(sys.argv[1], **updater_helpers.train_jit_with_dropout())
    """
)


def _train_on_devices(num_devices: int, out_path: str) -> dict[str, np.ndarray]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(num_devices))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={num_devices}"
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    python_path = [tests_dir, os.path.dirname(tests_dir), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path for path in python_path if path)
    result = subprocess.run(
        [sys.executable, "-c", _OTHER_DEVICE_COUNT_SCRIPT, out_path, str(num_devices)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, f"{num_devices}-device run failed:\n{result.stdout[-4000:]}"
    with np.load(out_path) as saved:
        return dict(saved)


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory):
    """The same dropout run on 1, 4 and 8 devices (the others in subprocesses, run first)."""
    out_dir = tmp_path_factory.mktemp("device_counts")
    others = {n: _train_on_devices(n, str(out_dir / f"{n}.npz")) for n in (1, 8)}
    return {**others, NUM_DEVICES: train_jit_with_dropout()}


@pytest.mark.parametrize("num_devices", [1, 8])
def test_dropout_run_on_4_devices_equals_the_run_on_other_device_counts(dropout_runs, num_devices):
    four, other = dropout_runs[NUM_DEVICES], dropout_runs[num_devices]
    np.testing.assert_array_equal(four["rng"], other["rng"])
    _assert_results_close(four, other)


def test_dropout_run_depends_on_the_key(dropout_runs):
    # The comparison is sensitive: the dropout masks move the run. The same run with
    # no dropout ends elsewhere by far more than the tolerance.
    step_updater = _updater("jit", network=_network(hidden_sizes=(16,)))
    batches = _batches()
    train_state, metrics = run_steps(step_updater, step_updater.init(0, batches[0]), batches)
    without = flat_result(train_state, metrics)
    key = "params['mlp/linear']['w']"
    assert not np.allclose(without[key], dropout_runs[NUM_DEVICES][key], rtol=1e-3, atol=1e-4)


# Memory.


def test_fsdp_holds_a_quarter_of_the_split_leaves_per_device(runs):
    replicated, fsdp = runs["replicated"]["final"], runs["fsdp"]["final"]
    per_device, total = sharding.bytes_per_device(fsdp)
    replicated_per_device, replicated_total = sharding.bytes_per_device(replicated)
    assert total == replicated_total == replicated_per_device
    kept_whole = sum(
        leaf.nbytes for leaf in jax.tree.leaves(fsdp) if leaf.sharding.is_fully_replicated
    )
    split = total - kept_whole
    assert split >= total // 2  # The test means something: most bytes are split.
    assert per_device == split // NUM_DEVICES + kept_whole
    assert sharding.format_bytes_per_device(per_device, total) == (
        f"train state: {per_device / 1e3:.1f} kB per device of {total / 1e3:.1f} kB"
    )


def test_compiled_step_takes_fewer_argument_bytes_per_device_with_fsdp(runs):
    batch = _batches()[0]

    def argument_bytes(run):
        lowered = run["updater"].lower("update", run["final"], batch)
        return lowered.compile().memory_analysis().argument_size_in_bytes

    replicated, fsdp = argument_bytes(runs["replicated"]), argument_bytes(runs["fsdp"])
    state_total = sharding.bytes_per_device(runs["fsdp"]["final"])[1]
    state_per_device = sharding.bytes_per_device(runs["fsdp"]["final"])[0]
    # The arguments are the train state and the device's batch: the state's saving shows.
    assert replicated - fsdp == state_total - state_per_device
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(runs["fsdp"]["final"]))


def test_a_model_too_large_to_replicate_in_the_budget_trains_with_fsdp():
    budget = 2**20  # bytes of train state per device
    network = _network(hidden_sizes=(512, 512))
    step_updater = _updater("jit", "fsdp", network=network)
    batches = _batches()
    train_state = step_updater.init(0, batches[0])
    per_device, total = sharding.bytes_per_device(train_state)
    assert total > budget  # Replicated, every device would hold all of it.
    assert per_device <= budget
    initial = to_host(train_state.params)
    # The same batch three times: the loss on it goes down.
    train_state, metrics = run_steps(step_updater, train_state, batches[:1] * 3)
    assert sharding.bytes_per_device(train_state) == (per_device, total)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert not np.array_equal(
        to_host(train_state.params)["mlp/linear_1"]["w"], initial["mlp/linear_1"]["w"]
    )
    replicas.assert_train_state_invariants(train_state)


# Replica checks of a real train state, donation, compile once.


def _with_one_copy_changed(leaf: jax.Array, device_index: int) -> jax.Array:
    """`leaf` (replicated) with global device `device_index`'s copy one ulp larger."""
    devices = jax.devices()
    copies = []
    for shard in leaf.addressable_shards:
        copy = np.array(shard.data)
        if shard.device == devices[device_index]:
            copy = np.nextafter(copy, np.float32(np.inf))
        copies.append(jax.device_put(copy, shard.device))
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, copies)


def test_replica_check_names_a_perturbed_replicated_leaf(runs):
    train_state = runs["fsdp"]["final"]
    state = jax.tree.map(lambda x: x, train_state.state)
    leaf = state["mlp/batch_norm/~/var_ema"]["average"]
    state["mlp/batch_norm/~/var_ema"]["average"] = _with_one_copy_changed(leaf, 2)
    pattern = r"\.state\['mlp/batch_norm/~/var_ema'\]\['average'\].*devices \[2\] differ from"
    with pytest.raises(AssertionError, match=pattern):
        replicas.assert_train_state_invariants(train_state._replace(state=state))


def test_replica_check_names_a_key_that_differs_across_devices(runs):
    train_state = runs["replicated"]["final"]
    devices = jax.devices()
    keys = [
        jax.device_put(jax.random.key(7 if device == devices[3] else 0), device)
        for device in devices
    ]
    rng = jax.make_array_from_single_device_arrays((), train_state.rng.sharding, keys)
    with pytest.raises(AssertionError, match=r"\.rng: devices \[3\] differ from device 0"):
        replicas.assert_train_state_invariants(train_state._replace(rng=rng))


def test_tiling_check_names_a_sharded_leaf_whose_shards_overlap(runs):
    train_state = runs["fsdp"]["final"]
    # Split over 2 of a 2 x 2 mesh's devices, each half held twice.
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    weights = train_state.params["mlp/linear"]["w"]
    twice = jax.device_put(weights, jax.sharding.NamedSharding(mesh, P(None, "a")))
    params = {**train_state.params, "mlp/linear": {**train_state.params["mlp/linear"], "w": twice}}
    pattern = (
        r"Shards of leaf \.params\['mlp/linear'\]\['w'\] do not tile.*devices \[0, 1\] all hold"
    )
    with pytest.raises(AssertionError, match=pattern):
        replicas.assert_train_state_invariants(train_state._replace(params=params))


def test_update_donates_the_train_state_and_refuses_it_afterwards(runs):
    step_updater = runs["fsdp"]["updater"]
    batch = _batches()[0]
    train_state = step_updater.init(0, batch)
    new_state, _ = step_updater.update(train_state, batch)
    # As under pmap: all but BatchNorm's state, some of whose leaves init makes alike.
    for field in ("params", "opt_state", "rng", "step"):
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(getattr(train_state, field)))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_state))
    # Refused before jit sees it (jax 0.10 would crash on the deleted buffers).
    with pytest.raises(ValueError, match=r"^update: train_state\.params.* is deleted: this Train"):
        step_updater.update(train_state, batch)


def test_update_compiles_once_over_steps_and_fresh_inits():
    traces = []

    def loss_fn(outputs, batch):
        traces.append(1)
        return losses.classification_loss(NUM_CLASSES)(outputs, batch)

    step_updater = hs.Updater(plain_mlp(), optax.adam(1e-2), loss_fn, backend="jit")
    batches = _batches()
    train_state, _ = run_steps(step_updater, step_updater.init(0, batches[0]), batches)
    run_steps(step_updater, step_updater.init(1, batches[0]), batches[:1])
    assert len(traces) == 1


def test_the_batch_becomes_global_without_moving_data():
    # plain_mlp has no BatchNorm: the only collectives are the gradient and metric
    # all-reduces; viewing the [devices, per_device, ...] batch as [global_batch, ...]
    # adds no gather, all-to-all or permutation.
    step_updater = hs.Updater(
        plain_mlp(), optax.sgd(0.1), losses.classification_loss(NUM_CLASSES), backend="jit"
    )
    batch = _batches()[0]
    train_state = step_updater.init(0, batch)
    hlo = step_updater.lower("update", train_state, batch).compile().as_text()
    for collective in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert collective not in hlo
    assert "all-reduce" in hlo  # The check can fail: the HLO text names collectives.


# Bad input, refused in one line before anything runs.


@pytest.mark.parametrize("backend", ["pmap", "shard_map"])
def test_fsdp_without_jit_is_refused_naming_both_values(backend):
    pattern = rf"^param_sharding='fsdp' needs backend='jit'; backend='{backend}' [^\n]*$"
    with pytest.raises(ValueError, match=pattern):
        _updater(backend, "fsdp")


def test_unknown_param_sharding_and_backend_are_refused_naming_the_choices():
    with pytest.raises(
        ValueError, match=r"^Unknown param_sharding 'zero3'; .*'replicated', 'fsdp'"
    ):
        _updater("jit", "zero3")
    with pytest.raises(ValueError, match=r"^Unknown backend 'vmap'; .*'pmap', 'shard_map', 'jit'"):
        _updater("vmap")
    # The same check, for a config to call before anything runs.
    updater_arguments.check_backend("jit", "fsdp")
    with pytest.raises(ValueError, match=r"^param_sharding='fsdp' needs backend='jit'"):
        updater_arguments.check_backend("shard_map", "fsdp")


def test_network_with_cross_replica_axis_is_refused_at_init():
    step_updater = _updater("jit", network=_network(AXIS, hidden_sizes=(16,)))
    pattern = r"^init: the network uses a device axis .*cross_replica_axis=None \(not 'i'\)"
    with pytest.raises(ValueError, match=pattern):
        step_updater.init(0, _batches()[0])


def test_a_pmap_train_state_is_refused_naming_its_key(runs):
    pattern = r"^update: train_state.rng has shape \(4,\): the per-device layout"
    with pytest.raises(ValueError, match=pattern):
        runs["replicated"]["updater"].update(runs["pmap"]["final"], _batches()[0])


def test_a_train_state_of_the_other_param_sharding_is_refused_naming_the_leaf(runs):
    fsdp_state = runs["fsdp"]["final"]
    leaf = r"train_state\.params\['mlp/linear'\]\['w'\]"
    pattern = rf"update: {leaf} has sharding .*P\(None, 'i'\).*lays it out as (P|PartitionSpec)\(\)"
    with pytest.raises(ValueError, match=pattern):
        runs["replicated"]["updater"].update(fsdp_state, _batches()[0])
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(fsdp_state))


def test_jit_programs_draw_partitionable_bits_whatever_the_process_setting():
    # The command line turns the partitionable threefry off on CPU for the per-device
    # backends; the jit programs keep it, so each device draws only its shard's bits.
    network = _network(dropout_rate=0.5)
    draws = []
    for partitionable in (False, True):
        with jax.threefry_partitionable(partitionable):
            step_updater = _updater("jit", "fsdp", network=network)
            initial = step_updater.init(0, _batches()[0])
            params = to_host(initial.params)
            _, metrics = step_updater.update(initial, _batches()[0])
            draws.append((params, jax.device_get(metrics["loss"])))
    chex.assert_trees_all_equal(draws[0], draws[1])

"""Tests of haiku_state.updater: a step on N devices equals one on 1 device, same global batch."""

import os
import subprocess
import sys
import tempfile
import textwrap

import chex
import numpy as np
from updater_helpers import train_for_comparison

_ONE_DEVICE_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax
    import numpy as np
    assert jax.local_device_count() == 1, jax.local_devices()
    import updater_helpers
    for name in sys.argv[2:]:
        np.savez(f"{sys.argv[1]}/{name}.npz", **updater_helpers.train_for_comparison(name))
    """
)
_COMPARED_MODELS = ("bn_mlp", "lean_bn_mlp", "plain_mlp")


class DeviceCountEquivalenceTest(chex.TestCase):
    """A 4-device step on a global batch equals a 1-device step on the same global batch.

    The 1-device reference runs the same `train_for_comparison` in a subprocess with one
    simulated CPU device (the device count is fixed when JAX starts). No dropout: dropout
    keys are per device, so they differ by design with the device count.
    """

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls._tempdir = tempfile.TemporaryDirectory()
        out_dir = cls.out_dir = cls._tempdir.name
        env = dict(os.environ)
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        env["JAX_NUM_CPU_DEVICES"] = "1"
        env["JAX_PLATFORMS"] = "cpu"
        tests_dir = os.path.dirname(os.path.abspath(__file__))
        python_path = [tests_dir, os.path.dirname(tests_dir), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(path for path in python_path if path)
        # Run before, not alongside, the 4-device runs: on 2 cores the 4 simulated devices'
        # collectives slow down badly when another process competes for the cores.
        one_device = subprocess.run(
            [sys.executable, "-c", _ONE_DEVICE_SCRIPT, out_dir, *_COMPARED_MODELS],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        if one_device.returncode:
            raise RuntimeError(f"1-device reference run failed:\n{one_device.stdout}")
        cls.four_devices = {
            name: train_for_comparison(name) for name in _COMPARED_MODELS + ("bn_mlp_per_device",)
        }

    @classmethod
    def tearDownClass(cls):
        cls._tempdir.cleanup()
        super().tearDownClass()

    def _one_device(self, name) -> dict[str, np.ndarray]:
        with np.load(os.path.join(self.out_dir, f"{name}.npz")) as one_device:
            return dict(one_device)

    def _compare(self, name):
        one_device = self._one_device(name)
        four_devices = self.four_devices[name]
        self.assertEqual(set(four_devices), set(one_device))
        for key in sorted(four_devices):
            with self.subTest(key):
                self.assertEqual(four_devices[key].dtype, one_device[key].dtype)
                np.testing.assert_allclose(four_devices[key], one_device[key], rtol=1e-5, atol=1e-5)
        return four_devices, one_device

    def test_cross_replica_batchnorm_step_on_4_devices_equals_1_device(self):
        four_devices, _ = self._compare("bn_mlp")
        # The comparison covers BatchNorm state and the training moved the params.
        self.assertIn("state['mlp/batch_norm/~/var_ema']['average']", four_devices)
        np.testing.assert_array_equal(
            four_devices["state['mlp/batch_norm/~/mean_ema']['counter']"], 3
        )
        self.assertLess(four_devices["loss"][-1], four_devices["loss"][0])

    def test_cross_replica_lean_batchnorm_step_on_4_devices_equals_1_device(self):
        four_devices, _ = self._compare("lean_bn_mlp")
        self.assertIn("state['mlp/batch_norm']['var']", four_devices)
        self.assertLess(four_devices["loss"][-1], four_devices["loss"][0])

    def test_per_device_batchnorm_on_4_devices_does_not_equal_1_device(self):
        # The comparison is sensitive: without cross_replica_axis, each device normalises
        # with its own shard's statistics, which a 1-device run cannot reproduce.
        four_devices = self.four_devices["bn_mlp_per_device"]
        one_device = self._one_device("bn_mlp")
        key = "params['mlp/linear']['w']"
        self.assertFalse(np.allclose(four_devices[key], one_device[key], rtol=1e-5, atol=1e-5))

    def test_plain_mlp_step_on_4_devices_equals_1_device(self):
        four_devices, _ = self._compare("plain_mlp")
        self.assertLess(four_devices["loss"][-1], four_devices["loss"][0])

"""Runs every test with 4 simulated CPU devices, so every pmap path is real."""

import chex

chex.set_n_cpu_devices(4)

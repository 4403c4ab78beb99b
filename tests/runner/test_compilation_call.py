"""CompilationManager.call: a program that rejects its arguments gives way to the jit,
but an argument already donated is the caller's error and leaves the program be."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.runner.compilation import CompilationManager


def _manager():
    jitted = jax.jit(lambda x: x + 1, donate_argnums=0)
    manager = CompilationManager(None, 1, 1, rebuild=None)
    manager.programs[("p", 4)] = jitted.lower(jnp.zeros(4)).compile()
    return manager, jitted


def test_arguments_unlike_the_warm_ups_fall_back_to_the_jit():
    manager, jitted = _manager()
    x = jnp.zeros(5)           # another shape: the program refuses it before running
    out = manager.call(("p", 4), (x,), jitted, (x,))
    np.testing.assert_array_equal(np.asarray(out), np.ones(5))
    assert ("p", 4) not in manager.programs


def test_a_donated_argument_raises_and_keeps_the_program():
    manager, jitted = _manager()
    x = jnp.zeros(4)
    manager.call(("p", 4), (x,), jitted, (x,))      # donates x
    assert x.is_deleted()
    with pytest.raises(ValueError, match="deleted or donated"):
        manager.call(("p", 4), (x,), jitted, (x,))
    assert ("p", 4) in manager.programs
    y = jnp.zeros(4)
    np.testing.assert_array_equal(np.asarray(manager.call(("p", 4), (y,), jitted, (y,))),
                                  np.ones(4))

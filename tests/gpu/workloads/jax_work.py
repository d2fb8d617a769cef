"""JAX: a jitted fixed-seed computation, hashed exactly.

JAX preallocates a fraction of what cuMemGetInfo reports; under the shim that is the kernel's own
view (its quota or the pool), so this also exercises the memory view.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from _common import emit


@jax.jit
def step(w, x):
    y = jnp.tanh(x @ w)
    return w - 0.01 * (x.T @ y) / x.shape[0], jnp.mean(y * y)


def main() -> None:
    key = jax.random.PRNGKey(3)
    k1, k2 = jax.random.split(key)
    w = jax.random.normal(k1, (512, 512), dtype=jnp.float32)
    x = jax.random.normal(k2, (1024, 512), dtype=jnp.float32)
    losses = []
    for _ in range(20):
        w, loss = step(w, x)
        losses.append(float(loss))
    host = np.asarray(w)
    emit(
        sha256=hashlib.sha256(host.tobytes()).hexdigest(),
        losses=[float.hex(v) for v in losses],
        backend=jax.default_backend(),
    )


if __name__ == "__main__":
    main()

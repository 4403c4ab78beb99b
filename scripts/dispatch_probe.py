"""Host cost of dispatching a jitted call by number of buffers (and donation)."""
import time
import numpy as np
import jax

def bench(fn, args, n=300):
    out = fn(*args); jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    return (t1 - t) / n * 1e6

def make(k):
    return [jax.device_put(np.zeros((8, 128), np.float32)) for _ in range(k)]

for k in (1, 10, 100, 300, 360):
    xs = make(k)
    f = jax.jit(lambda *a: a[0] + 1)
    print(f"{k:4d} args, no donation: {bench(f, xs):8.1f} us/call", flush=True)

# 300 inputs + 64 donated ones returned
xs = make(300)
def g(ws, kv):
    return ws[0] + 1, [c + 0 for c in kv]
gj = jax.jit(g, donate_argnums=(1,))
kv = make(64)
out = gj(xs, kv); jax.block_until_ready(out)
kv = out[1]
t = time.perf_counter()
for _ in range(300):
    o, kv = gj(xs, kv)
t1 = time.perf_counter(); jax.block_until_ready(kv)
print(f"300 + 64 donated (returned): {(t1 - t) / 300 * 1e6:8.1f} us/call")
kv1 = [jax.device_put(np.zeros((64, 8, 128), np.float32))]
out = gj(xs, kv1); kv1 = out[1]
t = time.perf_counter()
for _ in range(300):
    o, kv1 = gj(xs, kv1)
t1 = time.perf_counter(); jax.block_until_ready(kv1)
print(f"300 + 1 donated (returned): {(t1 - t) / 300 * 1e6:8.1f} us/call")
arr = {f"a{i}": np.zeros(256, np.int32) for i in range(7)}
t = time.perf_counter()
for _ in range(300):
    jax.device_put(arr)
print(f"device_put of 7 small numpy arrays: {(time.perf_counter() - t) / 300 * 1e6:8.1f} us")
one = np.zeros(7 * 256, np.int32)
t = time.perf_counter()
for _ in range(300):
    jax.device_put(one)
print(f"device_put of 1 numpy array: {(time.perf_counter() - t) / 300 * 1e6:8.1f} us")

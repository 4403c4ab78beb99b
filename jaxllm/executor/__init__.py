"""The device side: jax.distributed, the mesh, weights, KV pool sizing, the host swap
pool and compilation, behind one public step (`Executor.execute_model`)."""

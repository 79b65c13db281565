"""DFlash drafters in JAX. Importing the package first chooses JAX's platform and quiets the
compile extras' start-up (dflash_jax/startup.py), before any of its modules imports jax."""

from dflash_jax.startup import start

start()

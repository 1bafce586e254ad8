"""Several processes: the launcher behind ``python -m train.launch`` (hosts, coordinator, restarts) and JAX
distributed start-up with peer heartbeats."""

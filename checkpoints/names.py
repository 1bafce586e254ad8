"""The names of the two items inside a checkpoint step's folder (``<directory>/<step>/state`` and
``<directory>/<step>/meta``): the manager writes them (`checkpoints.manager`) and the verifier reads them back
(`checkpoints.verify`), so they live here, below both. Imports nothing."""

STATE = "state"
"""The train state pytree's item (parameters, optimizer state, step, RNG), written as Orbax's standard item."""

META = "meta"
"""The JSON item: model config, mesh and rules, data position, input pipeline and stage layout."""

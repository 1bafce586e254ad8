"""``python tests/_perturbed_train.py FLAGS...``: `train.train.main` with a train step that issues one more
collective than the real one (a sum of the first parameter over every device, added to the metrics): what a
process whose compiler ordered or merged the collectives differently would run. Test-only: it stands in for a
process on another GPU kind, which the CPU backend cannot produce with any XLA flag."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from train import train  # noqa: E402
from train.runtime.step import Trainer  # noqa: E402

_apply_gradients = Trainer.apply_gradients


def _perturbed(self, state, *args):
    new_state, metrics = _apply_gradients(self, state, *args)
    first = jax.tree.leaves(state["params"])[0]
    return new_state, {**metrics, "perturbed": jnp.sum(first * first)}


Trainer.apply_gradients = _perturbed

if __name__ == "__main__":
    sys.exit(train.main(sys.argv[1:]))

"""The training runtime: the jitted step, the loop around it, the train state and its layout, the optimizer,
and loading a model onto a mesh for the inference commands."""

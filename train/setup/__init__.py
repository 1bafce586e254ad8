"""Start-up: flags and config files into a `train.setup.config.RunConfig`, every check before device work, what
start-up reads of the strategy and pipeline, and the speeds it measures on the devices."""

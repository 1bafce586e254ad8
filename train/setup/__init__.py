"""Start-up: flags and config files into a `train.setup.config.RunConfig` (`cli`, `parser`, `layout_flags`,
`configfile`), library errors printed with their flags (`flagnames`), every check before device work
(`checks`, `folders`), what start-up reads of the strategy and pipeline (`strategy_setup`), the speeds it
measures on the devices (`calibrate`), ``--plan auto`` (`auto_plan`), and the mesh and trainer once the
devices are up (`startup`)."""

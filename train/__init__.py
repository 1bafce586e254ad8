"""meshwork's trainer: the entry points (`train.train`, `train.plan`, `train.generate`, `train.evaluate`,
`train.hf`, `train.launch`, ``python -m train.data``) over start-up (`train.setup`), the step and loop
(`train.runtime`, `train.strategies`), the launcher (`train.launcher`), the reports (`train.reports`) and
the data path (`train.data`)."""

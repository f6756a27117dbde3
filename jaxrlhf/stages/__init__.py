"""Training stages selected by `config.stage`."""

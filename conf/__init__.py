"""refit_app's Hydra configs, installed as the package ``refit_app.conf`` (see ``[tool.setuptools]`` in
pyproject.toml) so that ``pkg://refit_app.conf`` finds the same files in a checkout, an editable install and a
wheel. Hydra reads a config package only where it has this file."""

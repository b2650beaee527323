"""The loop tests' tiny model and prompt file, for the report's real runs."""

from tests.loop.conftest import prompt_file, tiny_model_dir  # noqa: F401 - fixtures, re-exported

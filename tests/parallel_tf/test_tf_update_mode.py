"""Update mode through Horovod's Keras wrappers with Keras 2 (tests/keras_update_mode_cases.py holds the cases)."""
from tests.keras_update_mode_cases import *  # noqa: F401,F403

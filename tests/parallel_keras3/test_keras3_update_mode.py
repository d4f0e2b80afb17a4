"""Update mode through the Keras optimizer wrappers with Keras 3 (tests/keras_update_mode_cases.py holds the cases)."""
from tests.keras_update_mode_cases import *  # noqa: F401,F403

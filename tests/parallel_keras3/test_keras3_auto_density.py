"""ratio="auto" through the Keras optimizer wrappers with Keras 3 (tests/keras_auto_density_cases.py holds the cases)."""
from tests.keras_auto_density_cases import *  # noqa: F401,F403

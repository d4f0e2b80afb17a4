"""Update mode's gradient route with Keras 2 (tests/keras_update_route_cases.py holds the cases)."""
from tests.keras_update_route_cases import *  # noqa: F401,F403

"""Test configuration: every test runs on CPU with float32 defaults unless it says otherwise."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis

hypothesis.settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
hypothesis.settings.register_profile("dev", max_examples=100, deadline=None)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "dev")
